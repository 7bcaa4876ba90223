"""The model registry and the families beyond Llama 3: torchtitan's Qwen3 (dense and
Mixture-of-Experts) trained by `Trainer` from the shipped train_configs/qwen3_debug.toml on the 8 XLA
CPU devices under FSDP 8, against the same torchtitan model trained by plain PyTorch on the CPU
(tests/train/reference.py) from the same initial weights and batches. The models are the debug
flavors made narrow and 2 layers deep (arguments torchtitan's classes take, nothing else), so a
2-core machine trains them in seconds per step.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from torchtpu.distributed.topology import libtpu_available
from torchtpu.train.config_manager import load_config

from .debug_run import REPO
from .reference import cpu_state, reference_losses

pytestmark = pytest.mark.usefixtures("keep_current_mesh")
needs_libtpu = pytest.mark.skipif(not libtpu_available(), reason="libtpu is not installed")

STEPS = 10
NARROW = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "hidden_dim": 128, "n_layers": 2}


def _narrow_moe():
    from torchtpu.models.registry import get_family

    moe = get_family("qwen3").model_args("debugmodel_moe").moe_args
    # 8 experts, 2 per token: the flavor's router (softmax, normalized top-k scores) on fewer experts
    return {**NARROW, "moe_inter_dim": 64, "moe_args": dataclasses.replace(moe, num_experts=8, top_k=2)}


def _argv(tmp_path, flavor, steps=STEPS, *extra):
    return [
        "--config",
        os.path.join(REPO, "train_configs", "qwen3_debug.toml"),
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "1",
        "--training.steps",
        str(steps),
        "--model.flavor",
        flavor,
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "3",
        "--validation.enable",
        "false",
        *extra,
    ]


def _train_and_reference(tmp_path, flavor, overrides):
    from torchtpu.train.trainer import Trainer

    cfg = load_config(_argv(tmp_path, flavor))
    t = Trainer(cfg, model_overrides=overrides)
    assert t.dims.dp_shard == 8 and t.dims.tp == 1
    init = cpu_state(t.model)
    hist = t.train()
    got = [h["loss"] for h in hist]
    assert [h["step"] for h in hist] == list(range(1, STEPS + 1))
    ref = reference_losses(cfg, init, STEPS, overrides)
    rel = [abs(g - r) / abs(r) for g, r in zip(got, ref)]
    print(f"trainer {got}\nCPU     {ref}\nmax relative difference {max(rel):.2e}")
    assert max(rel) <= 1e-4, (got, ref)
    assert min(ref[-3:]) < ref[0] - 0.1  # it learns: the comparison is not between two flat curves
    return t, got


def test_qwen3_dense_fsdp8_matches_pytorch(tmp_path):
    """Qwen3 (q/k norms, GQA, tied embedding and output) under FSDP 8: 10 losses = plain PyTorch's."""
    t, _ = _train_and_reference(tmp_path, "debugmodel", NARROW)
    assert t.model.output.weight is t.model.tok_embeddings.weight


@pytest.fixture(scope="module")
def moe_fsdp8(tmp_path_factory):
    """The narrow Qwen3 MoE trained 10 steps under FSDP 8 (expert parallel degree 1), checked
    against plain PyTorch: (trainer, losses)."""
    return _train_and_reference(tmp_path_factory.mktemp("moe_fsdp8"), "debugmodel_moe", _narrow_moe())


def test_qwen3_moe_fsdp8_matches_pytorch(moe_fsdp8):
    """Qwen3 MoE under FSDP 8: the router's top-k, the grouped matmuls over each expert's tokens and
    the weighted combine give plain PyTorch's 10 losses; the router counted every routed token."""
    import torch

    t, _ = moe_fsdp8
    moe = t.model.layers["0"].moe
    assert type(moe.experts).__name__ == "RaggedGroupedExperts"
    counts = moe.tokens_per_expert.cpu()
    # torchtitan's Qwen3 accumulates the counts over the run: 10 steps x 8 x 32 tokens x top-2
    assert counts.sum().item() == STEPS * 8 * 32 * 2
    assert torch.count_nonzero(counts).item() > 1


def test_registry_is_what_the_config_offers():
    """The configuration's [model] name/flavor choices are the registry's families and flavors, and
    each flavor is one of torchtitan's."""
    from torchtpu.models.registry import FAMILIES, UnknownModel, get_family, model_flavors
    from torchtpu.train.job_config import MODEL_FLAVORS

    assert MODEL_FLAVORS == model_flavors()
    for family in FAMILIES.values():
        for flavor in family.flavors:
            assert family.model_args(flavor) is not family.model_args(flavor)  # a fresh copy each time
    with pytest.raises(UnknownModel, match="families: llama3, qwen3"):
        get_family("llama4")
    with pytest.raises(UnknownModel, match="flavors: debugmodel, 8B, 70B, 405B"):
        get_family("llama3").model_args("7B")


def test_moe_flops_count_active_experts_only():
    """torchtitan's count for Qwen3 MoE: 6 x (dense + router + top_k / num_experts of the experts) +
    attention; the experts' share is what top-k routing runs, not all of them."""
    import torch

    from torchtpu.models.registry import get_family

    family = get_family("qwen3")
    args = family.model_args("30B-A3B")
    with torch.device("meta"):
        model = family.build_model(dataclasses.replace(args, n_layers=1))
    n, flops = family.flops_per_token(model, model.model_args, 4096)
    experts = sum(p.numel() for name, p in model.named_parameters() if "moe.experts" in name)
    embedding = model.tok_embeddings.weight.numel()
    others = n - experts - embedding - model.output.weight.numel()
    attention = 12 * 1 * args.n_heads * args.head_dim * 4096
    assert flops == 6 * (others + model.output.weight.numel() + experts * 8 // 128) + attention


def _max_diff(got, want):
    assert len(got) == len(want), (got, want)
    return max(abs(g - w) for g, w in zip(got, want))


def test_expert_parallel_gives_the_ep1_losses_and_resumes_under_another_degree(tmp_path, moe_fsdp8):
    """Expert parallelism 4 x FSDP 2 (each rank holds 2 of the 8 experts, sharded over 2 ranks; the
    tokens travel by all-to-all) trains the EP 1 run's losses within 1e-5; its step-2 checkpoint
    (the logical full tensors) resumes under EP 2 x FSDP 4 and goes on with the same losses."""
    from jax.sharding import PartitionSpec as P

    from torchtpu.backend.views import array_of
    from torchtpu.train.trainer import Trainer

    _, ep1 = moe_fsdp8
    save = ("--checkpoint.enable", "--checkpoint.interval", "2")
    t4 = Trainer(
        load_config(_argv(tmp_path, "debugmodel_moe", 3, "--parallelism.expert_parallel_degree", "4", *save)),
        model_overrides=_narrow_moe(),
    )
    assert t4.mesh.jax_mesh.shape == {"dp_replicate": 1, "efsdp": 2, "ep": 4, "tp": 1}
    moe = t4.model.layers["0"].moe
    assert type(moe).__name__ == "ExpertParallelMoE"
    # the expert dim split over ep, each rank's experts sharded over efsdp
    assert array_of(moe.experts.w1).sharding.spec == P(("ep", "efsdp"), None, None)
    got4 = [h["loss"] for h in t4.train()]
    print(f"EP 4 {got4}\nEP 1 {ep1[:3]}")
    assert _max_diff(got4, ep1[:3]) <= 1e-5
    assert moe.tokens_per_expert.cpu().sum().item() == 3 * 8 * 32 * 2  # every routed token counted
    resume = ("--checkpoint.enable", "--checkpoint.load_step", "2")
    t2 = Trainer(
        load_config(_argv(tmp_path, "debugmodel_moe", 4, "--parallelism.expert_parallel_degree", "2", *resume)),
        model_overrides=_narrow_moe(),
    )
    assert t2.mesh.jax_mesh.shape == {"dp_replicate": 1, "efsdp": 4, "ep": 2, "tp": 1}
    hist = t2.train()
    assert [h["step"] for h in hist] == [3, 4]
    got2 = [h["loss"] for h in hist]
    print(f"EP 2 (resumed) {got2}\nEP 1 {ep1[2:4]}")
    assert _max_diff(got2, ep1[2:4]) <= 1e-5


def test_expert_parallel_config_errors(tmp_path):
    """One line naming the keys and the fix: a degree that does not divide the FSDP shards or the
    experts, expert parallelism on a dense model or with tensor parallelism, and ETP other than 1."""
    from torchtpu.models.registry import get_family
    from torchtpu.train.job_config import ConfigError
    from torchtpu.train.parallel_dims import check_expert_parallel, resolve_dims

    def cfg(flavor, *extra):
        return load_config(_argv(tmp_path, flavor, 1, *extra))

    with pytest.raises(ConfigError, match=r"expert_parallel_degree = 3.*must divide 8; choose one of 1, 2, 4, 8"):
        resolve_dims(cfg("debugmodel_moe", "--parallelism.expert_parallel_degree", "3"), 8)
    with pytest.raises(
        ConfigError, match="together with tensor parallelism is not supported.*tensor_parallel_degree = 1"
    ):
        resolve_dims(
            cfg(
                "debugmodel_moe",
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
            ),
            8,
        )
    with pytest.raises(ConfigError, match="expert_tensor_parallel_degree = 2.*allowed: 1"):
        cfg("debugmodel_moe", "--parallelism.expert_tensor_parallel_degree", "2")
    dense = cfg("debugmodel", "--parallelism.expert_parallel_degree", "2")
    with pytest.raises(ConfigError, match="dense model with no experts.*expert_parallel_degree = 1"):
        check_expert_parallel(dense, resolve_dims(dense, 8), get_family("qwen3").model_args("debugmodel"))
    # 64 experts, 12 FSDP shards: 12 divides the shards but not the experts
    moe = cfg("debugmodel_moe", "--parallelism.expert_parallel_degree", "12")
    args = get_family("qwen3").model_args("debugmodel_moe")
    with pytest.raises(ConfigError, match="has 64 experts per layer, which 12 ranks cannot split evenly"):
        check_expert_parallel(moe, resolve_dims(moe, 12), args)


@needs_libtpu
def test_expert_parallel_step_compiles_for_tpu_with_all_to_all_and_grouped_matmuls(tmp_path):
    """The narrow 2-layer Qwen3 MoE step under EP 4 compiled ahead of time for v5p:2x2x1 (libtpu's
    compiler): the tokens travel by all-to-all (dispatch and combine, forward and backward, in
    both layers), the experts run as TPU ragged-dot kernels, and there is no loop at all (no
    per-expert loop)."""
    from torchtpu.train.dry_run import compile_step
    from torchtpu.train.trainer import Trainer

    argv = _argv(tmp_path, "debugmodel_moe", 1, "--dry-run", "--tpu.topology", "v5p:2x2x1")
    t = Trainer(load_config([*argv, "--parallelism.expert_parallel_degree", "4"]), model_overrides=_narrow_moe())
    assert t.mesh.jax_mesh.shape["ep"] == 4 and t.devices[0].platform == "tpu"
    text = compile_step(t).as_text()
    # 2 layers x (dispatch of rows and of expert ids, combine) forward + 2 x (dispatch, combine) backward
    assert text.count(" all-to-all(") >= 8, text.count(" all-to-all(")
    assert "ragged-dot" in text and 'custom_call_target="tpu_custom_call"' in text
    assert " while(" not in text
