"""The model registry and the families beyond Llama 3: torchtitan's Qwen3 (dense and
Mixture-of-Experts), DeepSeek-V3 and Llama 4 trained by `Trainer` from the shipped
train_configs/<family>_debug.toml on the 8 XLA CPU devices under FSDP 8, against the same torchtitan
model trained by plain PyTorch on the CPU with torchtitan's optimizer for it (tests/train/reference.py)
from the same initial weights and batches. The models are the debug flavors made narrow and 2 layers
deep (arguments torchtitan's classes take, nothing else), so a 2-core machine trains them in seconds
per step.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from torchtpu.distributed.topology import libtpu_available
from torchtpu.train.config.manager import load_config

from .debug_run import REPO
from .reference import cpu_state, reference_run

pytestmark = pytest.mark.usefixtures("keep_current_mesh")


needs_libtpu = pytest.mark.skipif(not libtpu_available(), reason="libtpu is not installed")

STEPS = 10
NARROW = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "hidden_dim": 128, "n_layers": 2}


def _narrow_moe():
    from torchtpu.models.registry import get_family

    moe = get_family("qwen3").model_args("debugmodel_moe").moe_args
    # 8 experts, 2 per token: the flavor's router (softmax, normalized top-k scores) on fewer experts
    return {**NARROW, "moe_inter_dim": 64, "moe_args": dataclasses.replace(moe, num_experts=8, top_k=2)}


def _narrow_deepseek_v3():
    # MLA narrowed (KV latent 32, rotary part 8 of 24 per query/key head); layer 0 dense, layer 1 MoE:
    # the flavor's 8 routed experts (3 per token) and 2 shared ones, its softmax router
    return {
        "dim": 64,
        "n_heads": 4,
        "inter_dim": 128,
        "moe_inter_dim": 32,
        "n_layers": 2,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    }


def _narrow_llama4():
    # layer 0 dense, layer 1 MoE (the flavor's 8 routed experts, 1 per token, and a shared one)
    return {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2, "multiple_of": 32}


def _argv(tmp_path, flavor, steps=STEPS, *extra, family="qwen3"):
    return [
        "--config",
        os.path.join(REPO, "train_configs", f"{family}_debug.toml"),
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
        # qwen3_debug.toml recomputes (the layer scan) for debugmodel_moe's memory; these tests check
        # unscanned layouts and losses unless they ask for a mode themselves (a later flag wins)
        "--activation_checkpoint.mode",
        "none",
        *extra,
    ]


def _train_and_reference(tmp_path, flavor, overrides, family="qwen3", extra=()):
    """Train 10 steps and check the losses against plain PyTorch on CPU: (trainer, losses, CPU model)."""
    from torchtpu.train.trainer import Trainer

    cfg = load_config(_argv(tmp_path, flavor, STEPS, *extra, family=family))
    t = Trainer(cfg, model_overrides=overrides)
    assert t.dims.dp_shard == 8 and t.dims.tp == 1
    init = cpu_state(t.model)
    hist = t.train()
    got = [h["loss"] for h in hist]
    assert [h["step"] for h in hist] == list(range(1, STEPS + 1))
    ref, ref_model = reference_run(cfg, init, STEPS, overrides)
    rel = [abs(g - r) / abs(r) for g, r in zip(got, ref)]
    print(f"trainer {got}\nCPU     {ref}\nmax relative difference {max(rel):.2e}")
    assert max(rel) <= 1e-4, (got, ref)
    assert min(ref[-3:]) < ref[0] - 0.1  # it learns: the comparison is not between two flat curves
    return t, got, ref_model


def test_qwen3_dense_fsdp8_matches_pytorch(tmp_path):
    """Qwen3 (q/k norms, GQA, tied embedding and output) under FSDP 8: 10 losses = plain PyTorch's."""
    t, _, _ = _train_and_reference(tmp_path, "debugmodel", NARROW)
    assert t.model.output.weight is t.model.tok_embeddings.weight


@pytest.fixture(scope="module")
def moe_fsdp8(tmp_path_factory):
    """The narrow Qwen3 MoE trained 10 steps under FSDP 8 (expert parallel degree 1), checked
    against plain PyTorch: (trainer, losses)."""
    return _train_and_reference(tmp_path_factory.mktemp("moe_fsdp8"), "debugmodel_moe", _narrow_moe())[:2]


def test_qwen3_moe_fsdp8_matches_pytorch(moe_fsdp8):
    """Qwen3 MoE under FSDP 8: the router's top-k, the grouped matmuls over each expert's tokens and
    the weighted combine give plain PyTorch's 10 losses; the router counted every routed token."""

    t, _ = moe_fsdp8
    moe = t.model.layers["0"].moe
    assert type(moe.experts).__name__ == "RaggedGroupedExperts"
    # the load metrics (logged every step here): each layer's experts received the step's 8 x 32
    # tokens x top-2, read from the layers' tokens_per_expert buffers, which each step zeroes first

    records = _metric_records(t)
    assert len(records) == STEPS
    for rec, hist in zip(records, t.history):
        counts = rec["moe/tokens_per_expert"]
        assert len(counts) == 2 and all(len(row) == 8 and sum(row) == 8 * 32 * 2 for row in counts), counts
        per_layer = [max(row) / (sum(row) / 8) for row in counts]
        assert rec["moe/max_over_mean"] == pytest.approx(max(per_layer)) == hist["moe/max_over_mean"]
        assert rec["moe/layer_1/max_over_mean"] == pytest.approx(per_layer[1])
        assert 0 < rec["moe/cv"] < 3 and rec["moe/layer_0/min_over_mean"] <= 1
    assert moe.tokens_per_expert.cpu().tolist() == records[-1]["moe/tokens_per_expert"][0]


@pytest.mark.parametrize("family", ["deepseek_v3", "llama4"])
def test_load_balanced_moe_fsdp8_matches_pytorch(tmp_path, family):
    """DeepSeek-V3 (MLA, a dense first layer, shared + routed experts) and Llama 4 (dense and MoE
    layers interleaved, a shared expert, sigmoid routing; its blocks under activation checkpointing,
    so their forward and token counts run again in backward) under FSDP 8: 10 losses = plain
    PyTorch's with torchtitan's optimizer, whose pre-step hook moves each MoE layer's expert bias;
    the trainer's update inside the compiled step leaves the same biases, and the counts zeroed as
    torchtitan does. Under expert parallelism (with tensor parallelism for DeepSeek-V3) the first 3
    losses are the same within 1e-5."""
    import torch

    from torchtpu.train.trainer import Trainer

    overrides = _narrow_deepseek_v3() if family == "deepseek_v3" else _narrow_llama4()
    extra = ("--activation_checkpoint.mode", "full") if family == "llama4" else ()
    t, got, ref_model = _train_and_reference(tmp_path, "debugmodel", overrides, family, extra)
    assert [recomputed for _, recomputed in t.balanced_moe] == [family == "llama4"]
    moe = t.model.layers["1"].moe
    assert not hasattr(t.model.layers["0"], "moe")  # the dense first layer
    assert type(moe.experts).__name__ == "RaggedGroupedExperts"
    bias = moe.expert_bias.cpu()
    ref_bias = ref_model.layers["1"].moe.expert_bias
    assert torch.count_nonzero(ref_bias).item() > 0  # the update moved the reference's biases
    torch.testing.assert_close(bias, ref_bias, rtol=0, atol=1e-7)
    assert torch.count_nonzero(moe.tokens_per_expert.cpu()).item() == 0
    # the load metrics hold each step's routed tokens, though the bias update zeroes the buffers
    # (and Llama 4's checkpointed block counts each token twice)
    top_k = t.model_args.moe_args.top_k
    for rec in _metric_records(t):
        (counts,) = rec["moe/tokens_per_expert"]
        assert sum(counts) == 8 * 32 * top_k, counts
    # expert parallelism 4 (each rank 2 of the 8 routed experts, tokens by all-to-all): Llama 4 under EP 4 x
    # FSDP 2; DeepSeek-V3 under EP 4 x TP 2 (MLA's tensor-parallel plan; EP takes both TP ranks and 2 of
    # the 4 FSDP shards, the experts sharded over the other 2): the first 3 losses of the FSDP 8 run
    par = ["--parallelism.expert_parallel_degree", "4"]
    if family == "deepseek_v3":
        par += ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "2"]
    t4 = Trainer(
        load_config(_argv(tmp_path / "ep", "debugmodel", 3, *extra, *par, family=family)), model_overrides=overrides
    )
    shape = {"dp_replicate": 1, "efsdp": 2, "ep": 2, "tp": 2} if family == "deepseek_v3" else {"ep": 4, "tp": 1}
    assert shape.items() <= dict(t4.mesh.jax_mesh.shape).items()
    assert type(t4.model.layers["1"].moe).__name__ == "ExpertParallelMoE"
    if family == "deepseek_v3":  # the latent's up-projection colwise, its down-projection replicated over tp
        from torchtpu.backend.views import array_of

        attention = t4.model.layers["0"].attention
        assert "tp" in str(array_of(attention.wkv_b.weight).sharding.spec[0])
        assert "tp" not in str(array_of(attention.wkv_a.weight).sharding.spec)
    got4 = [h["loss"] for h in t4.train()]
    print(f"EP 4 {got4}\nEP 1 {got[:3]}")
    assert _max_diff(got4, got[:3]) <= 1e-5


def _metric_records(t):
    import json

    path = os.path.join(t.cfg.job.dump_folder, "metrics.jsonl")
    return [json.loads(line) for line in open(path) if '"loss"' in line]


def test_registry_flavors_are_torchtitans():
    """Each flavor the registry offers (and so the configuration: [model] name/flavor) is one of
    torchtitan's, and every "module:attr" the registry names resolves."""
    import importlib

    from torchtpu.models.registry import FAMILIES, UnknownModel, get_family, resolve

    for family in FAMILIES.values():
        for path in (family.args_table, family.model_class, family.preparer, family.parallelizer, family.flops_counter):
            assert callable(resolve(path)) or isinstance(resolve(path), dict), path
    for family in FAMILIES.values():
        for flavor in family.flavors:
            assert family.model_args(flavor) is not family.model_args(flavor)  # a fresh copy each time
    with pytest.raises(UnknownModel, match="families: llama3, qwen3, deepseek_v3, llama4"):
        get_family("gpt_oss")
    with pytest.raises(UnknownModel, match="flavors: debugmodel, 8B, 70B, 405B"):
        get_family("llama3").model_args("7B")
    for name in ("deepseek_v3", "llama4"):  # every flavor of torchtitan's table
        family = get_family(name)
        module, _, table = family.args_table.partition(":")
        assert family.flavors == tuple(getattr(importlib.import_module(module), table))


def test_registry_declares_what_torchtitan_train_specs_do():
    """Each family's expert-bias update and Hugging Face adapter are those of torchtitan's TrainSpec."""
    import importlib

    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing

    from torchtpu.models.registry import FAMILIES

    for family in FAMILIES.values():
        spec = importlib.import_module(family.model_class.partition(":")[0]).get_train_spec()
        assert family.moe_load_balancing == (spec.build_optimizers_fn is build_optimizers_with_moe_load_balancing)
        if family.hf_adapter is not None:
            module, _, attr = family.hf_adapter.partition(":")
            assert getattr(importlib.import_module(module), attr) is spec.state_dict_adapter


def test_flex_attention_flavors_are_refused_or_sdpa_on_request(tmp_path):
    """The flavors torchtitan runs through flex_attention: one line naming it (and the fix), or with
    [model] attn_type = "sdpa" causal SDPA; iRoPE's chunked attention is refused either way."""
    from torchtpu.train.config.job_config import ConfigError
    from torchtpu.train.model_builder import build_model_args

    def args(name, flavor, *extra):
        cfg = load_config(["--model.name", name, "--model.flavor", flavor, "--training.seq_len", "64", *extra])
        return build_model_args(cfg, None)

    with pytest.raises(ConfigError, match="attention type 'flex' .*block_causal.* attn_type = 'sdpa'") as e:
        args("deepseek_v3", "16B")
    assert "\n" not in str(e.value) and "SDPA attention (debugmodel)" in str(e.value)
    a = args("deepseek_v3", "16B", "--model.attn_type", "sdpa")
    assert (a.attn_type, a.attn_mask_type, a.max_seq_len) == ("sdpa", "causal", 64)
    with pytest.raises(ConfigError, match=r"iRoPE .* not supported on tpu; use a flavor without it \(debugmodel, "):
        args("llama4", "17bx16e_irope", "--model.attn_type", "sdpa")
    assert args("llama4", "17bx16e").max_seq_len == 64


def test_deepseek_v3_flops_count_active_experts_only():
    """torchtitan's count for DeepSeek-V3 671B (3 dense layers, then MoE): 6 x (everything outside the
    embedding and routed experts + top_k / num_experts of the routed experts) + attention over the
    query-key and value head widths; shared experts and router run for every token."""
    import torch

    from torchtpu.models.registry import get_family

    family = get_family("deepseek_v3")
    args = dataclasses.replace(family.model_args("671B"), n_layers=4)
    with torch.device("meta"):
        model = family.build_model(args)
    n, flops = family.flops_per_token(model, model.model_args, 4096)
    params = dict(model.named_parameters())
    assert n == sum(p.numel() for p in params.values())
    routed = sum(p.numel() for name, p in params.items() if ".moe.experts." in name)
    assert routed == 256 * 3 * 7168 * 2048  # one MoE layer: layers 0-2 are dense
    active = n - model.tok_embeddings.weight.numel() - routed + routed * 8 // 256
    attention = 6 * 4 * 128 * (128 + 64 + 128) * 4096
    assert flops == 6 * active + attention


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


def _scan_check(t, start):
    from torchtpu.distributed.params import module_record
    from torchtpu.distributed.scan import is_scanned

    assert is_scanned(t.model.layers) and module_record(t.model.layers).scan_start == start
    assert t.stacked  # the scanned blocks' parameters are rows of stacked storage


def test_expert_parallel_under_the_layer_scan_gives_the_ep1_losses_and_counts_and_resumes_under_another_degree(
    tmp_path, moe_fsdp8
):
    """Expert parallelism 4 x FSDP 2 (each rank holds 2 of the 8 experts, sharded over 2 ranks; the
    tokens travel by all-to-all) inside the layer scan: the narrow Qwen3 MoE under full
    recomputation, scanned (the scan carries the MoE blocks' buffers: each block's
    tokens_per_expert, added to inside the loop, written back per block; recomputation in backward
    counts nothing twice), trains the unrolled EP 1 run's losses within 1e-5 and logs the same
    tokens per expert every step. Its step-2 checkpoint (the logical full tensors) resumes under
    EP 2 x FSDP 4, unscanned and without recomputation, and goes on with the same losses."""
    from jax.sharding import PartitionSpec as P

    from torchtpu.distributed.params import partition_spec
    from torchtpu.train.trainer import Trainer

    t0, ep1 = moe_fsdp8
    save = ("--checkpoint.enable", "--checkpoint.interval", "2")
    extra = ("--activation_checkpoint.mode", "full", "--parallelism.expert_parallel_degree", "4")
    t4 = Trainer(load_config(_argv(tmp_path, "debugmodel_moe", 3, *extra, *save)), model_overrides=_narrow_moe())
    assert t4.mesh.jax_mesh.shape == {"dp_replicate": 1, "efsdp": 2, "ep": 4, "tp": 1}
    _scan_check(t4, 0)
    assert [recomputed for _, recomputed in t4.moe_layers] == [False, False]  # counted once, not halved
    moe = t4.model.layers["0"].moe
    assert type(moe).__name__ == "ExpertParallelMoE"
    # the expert dim split over ep, each rank's experts sharded over efsdp: the layout of block 0's row
    # of the stacked storage (the block dim unsplit)
    assert partition_spec(moe.experts.w1) == P(("ep", "efsdp"), None, None)
    got4 = [h["loss"] for h in t4.train()]
    print(f"EP 4 scanned {got4}\nEP 1 unrolled {ep1[:3]}")
    assert _max_diff(got4, ep1[:3]) <= 1e-5
    want = [r["moe/tokens_per_expert"] for r in _metric_records(t0)[:3]]
    assert [r["moe/tokens_per_expert"] for r in _metric_records(t4)] == want
    assert moe.tokens_per_expert.cpu().sum().item() == 8 * 32 * 2  # every routed token of the last step counted
    resume = ("--checkpoint.enable", "--checkpoint.load_step", "2")
    t2 = Trainer(
        load_config(_argv(tmp_path, "debugmodel_moe", 4, "--parallelism.expert_parallel_degree", "2", *resume)),
        model_overrides=_narrow_moe(),
    )
    assert t2.mesh.jax_mesh.shape == {"dp_replicate": 1, "efsdp": 4, "ep": 2, "tp": 1}
    assert not t2.stacked
    hist = t2.train()
    assert [h["step"] for h in hist] == [3, 4]
    got2 = [h["loss"] for h in hist]
    print(f"EP 2 (resumed) {got2}\nEP 1 {ep1[2:4]}")
    assert _max_diff(got2, ep1[2:4]) <= 1e-5


def test_deepseek_v3_layer_scan_runs_the_moe_blocks_and_keeps_the_dense_layer_out(tmp_path):
    """DeepSeek-V3 with a dense first layer and 2 MoE blocks under full recomputation: the scan runs
    the 2 MoE blocks (the dense layer stays outside, checkpointed), and gives the unrolled run's
    losses within 1e-5, its tokens per expert every step, and its expert biases (moved by the
    load-balancing update from the counts the scan wrote back)."""

    from torchtpu.backend.activation_checkpoint import is_checkpointed

    def scanned(t):
        _scan_check(t, 1)
        assert is_checkpointed(t.model.layers["0"]) and not is_checkpointed(t.model.layers["1"])

    overrides = {**_narrow_deepseek_v3(), "n_layers": 3}
    _scan_matches_unrolled(tmp_path, "deepseek_v3", overrides, scanned, moe_layers=(1, 2), top_k=3)


def _scan_matches_unrolled(tmp_path, family, overrides, scanned, moe_layers, top_k):
    """`family`'s debugmodel with `overrides`, trained 3 steps unrolled (no recomputation: a smaller
    program, the same numbers) and under the layer scan with full recomputation (`scanned(trainer)`
    checks the scan's layout first): the same losses within 1e-5, the same tokens per expert every
    step (8 x 32 x top_k routed rows per layer), and the same expert biases of `moe_layers`."""
    import torch

    from torchtpu.train.trainer import Trainer

    runs = {}
    for scan in (False, True):
        ac = ("--activation_checkpoint.mode", "full" if scan else "none")
        t = Trainer(
            load_config(_argv(tmp_path / str(scan), "debugmodel", 3, *ac, family=family)), model_overrides=overrides
        )
        if scan:
            scanned(t)
        losses = [h["loss"] for h in t.train()]
        counts = [r["moe/tokens_per_expert"] for r in _metric_records(t)]
        bias = [t.model.layers[str(i)].moe.expert_bias.cpu() for i in moe_layers]
        runs[scan] = losses, counts, bias
    print(f"scanned {runs[True][0]}\nunrolled {runs[False][0]}")
    assert _max_diff(runs[True][0], runs[False][0]) <= 1e-5
    assert runs[True][1] == runs[False][1]
    assert all(sum(row) == 8 * 32 * top_k for step in runs[True][1] for row in step), runs[True][1]
    for got, want in zip(runs[True][2], runs[False][2]):
        assert torch.count_nonzero(want).item() > 0
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def test_llama4_layer_scan_runs_uniform_blocks_only(tmp_path):
    """Llama 4 whose blocks are all alike (every block MoE, all with rotary embedding: 17bx16e's
    interleave_moe_layer_step 1) runs under the layer scan with full recomputation and gives the
    unrolled run's losses within 1e-5, its tokens per expert every step and its expert biases. The
    flavors whose blocks differ (dense and MoE interleaved, NoPE layers) are not uniform, so not
    scanned (test_load_balanced_moe_fsdp8_matches_pytorch trains one, checkpointed block by block)."""
    import torch
    from torchtitan.models.llama4.model.model import Transformer

    from torchtpu.models.llama4 import uniform_blocks
    from torchtpu.models.registry import get_family

    family = get_family("llama4")
    with torch.device("meta"):
        for flavor, uniform in (("17bx16e", True), ("17bx128e", False), ("17bx16e_irope", False)):
            args = dataclasses.replace(family.model_args(flavor), n_layers=4, dim=256, n_heads=4, n_kv_heads=2)
            assert uniform_blocks(Transformer(args)) is uniform, flavor

    def scanned(t):
        assert all(block.moe_enabled for block in t.model.layers.values())
        _scan_check(t, 0)
        assert [recomputed for _, recomputed in t.balanced_moe] == [False, False]  # counted once

    overrides = {**_narrow_llama4(), "interleave_moe_layer_step": 1}
    top_k = family.model_args("debugmodel").moe_args.top_k
    _scan_matches_unrolled(tmp_path, "llama4", overrides, scanned, moe_layers=(0, 1), top_k=top_k)


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_tensor_parallel_gives_the_ep1_losses(tmp_path, moe_fsdp8, ep):
    """torchtitan's tensor-parallel plan for the Qwen3 MoE, TP 2 x FSDP 4 (the same 8 sequences per step):
    without expert parallelism the routed experts split on their hidden dim (w1, w3 on dim 1, w2 on
    dim 2); under EP 2 x TP 2 (expert_tensor_parallel_degree 1) expert parallelism takes the two TP
    ranks, each expert whole on its ep rank and sharded over the 4 FSDP shards (efsdp), and each TP
    rank dispatches its own half of the tokens. The router's gate is not split over tp. Both give the
    EP 1 / FSDP 8 run's first 3 losses within 1e-5."""
    from jax.sharding import PartitionSpec as P

    from torchtpu.backend.views import array_of
    from torchtpu.train.trainer import Trainer

    _, ep1 = moe_fsdp8
    par = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", str(ep))
    t = Trainer(
        load_config(_argv(tmp_path, "debugmodel_moe", 3, "--training.local_batch_size", "2", *par)),
        model_overrides=_narrow_moe(),
    )
    moe = t.model.layers["0"].moe
    specs = [array_of(w).sharding.spec for w in (moe.experts.w1, moe.experts.w2)]
    if ep == 1:
        assert t.mesh.jax_mesh.shape == {"dp_replicate": 1, "dp_shard": 4, "tp": 2}
        assert specs == [P("dp_shard", "tp", None), P("dp_shard", None, "tp")], specs
    else:
        assert t.mesh.jax_mesh.shape == {"dp_replicate": 1, "efsdp": 4, "ep": 1, "tp": 2}
        assert type(moe).__name__ == "ExpertParallelMoE"
        assert specs == [P(("ep", "tp", "efsdp"), None, None)] * 2, specs
    assert "tp" not in str(array_of(moe.router.gate.weight).sharding.spec)
    got = [h["loss"] for h in t.train()]
    print(f"TP 2 x EP {ep} {got}\nEP 1 {ep1[:3]}")
    assert _max_diff(got, ep1[:3]) <= 1e-5


def test_expert_parallel_config_errors(tmp_path):
    """One line naming the keys and the fix: a degree that does not divide the FSDP shards or the
    experts, or (with tensor parallelism) is not the TP ranks times a divisor of them, expert
    parallelism on a dense model, and ETP other than 1."""
    from torchtpu.models.registry import get_family
    from torchtpu.train.config.job_config import ConfigError
    from torchtpu.train.parallel_dims import check_expert_parallel, resolve_dims

    def cfg(flavor, *extra):
        return load_config(_argv(tmp_path, flavor, 1, *extra))

    with pytest.raises(ConfigError, match=r"expert_parallel_degree = 3.*must divide 8; choose one of 1, 2, 4, 8"):
        resolve_dims(cfg("debugmodel_moe", "--parallelism.expert_parallel_degree", "3"), 8)
    # with TP 2 (4 FSDP shards) expert parallelism takes both TP ranks: 2, 4 or 8
    with pytest.raises(ConfigError, match=r"every one of the 2 tensor-parallel ranks.*choose one of 2, 4, 8$"):
        tp = ("--parallelism.tensor_parallel_degree", "2")
        resolve_dims(cfg("debugmodel_moe", *tp, "--parallelism.expert_parallel_degree", "3"), 8)
    with pytest.raises(ConfigError, match="expert_tensor_parallel_degree = 2.*allowed: 1"):
        cfg("debugmodel_moe", "--parallelism.expert_tensor_parallel_degree", "2")
    dense = cfg("debugmodel", "--parallelism.expert_parallel_degree", "2")
    with pytest.raises(ConfigError, match="dense model with no experts.*expert_parallel_degree = 1"):
        check_expert_parallel(dense, resolve_dims(dense, 8), get_family("qwen3").model_args("debugmodel"))
    # 64 experts, 12 FSDP shards: 12 divides the shards but not the experts
    moe = cfg("debugmodel_moe", "--parallelism.expert_parallel_degree", "12")
    args = get_family("qwen3").model_args("debugmodel_moe")
    with pytest.raises(
        ConfigError, match="has 64 experts per layer, which 12 ranks cannot split evenly; choose one of 1, 2, 4$"
    ):
        check_expert_parallel(moe, resolve_dims(moe, 12), args)


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "llama4"])
def test_for_loop_experts_are_refused_in_one_line(family):
    """torchtitan's use_grouped_mm=False (its for-loop experts, each expert's rows in the weights'
    dtype) splits the rows by token counts read on the host, which a compiled step does not have, and
    the dispatch parallelizing installs runs the grouped matmul (bfloat16 products): parallelizing such
    a model is one line naming the setting, on 8 chips (FSDP) as on one."""
    import jax
    import torch

    from torchtpu.distributed import init_device_mesh
    from torchtpu.models.registry import get_family

    fam = get_family(family)
    narrow = {"qwen3": _narrow_moe, "deepseek_v3": _narrow_deepseek_v3, "llama4": _narrow_llama4}[family]()
    flavor = "debugmodel_moe" if family == "qwen3" else "debugmodel"
    args = dataclasses.replace(fam.model_args(flavor), **narrow)
    args = dataclasses.replace(args, moe_args=dataclasses.replace(args.moe_args, use_grouped_mm=False))
    kw = dict(sequence_parallel=False, loss_parallel=False, param_dtype=torch.float32, reduce_dtype=torch.float32)
    for n in (8, 1):
        mesh = init_device_mesh("tpu", (n,), mesh_dim_names=("dp_shard",), devices=jax.devices()[:n])
        with torch.device("meta"):
            model = fam.build_model(args)
        with pytest.raises(ValueError) as e:
            fam.parallelize(model, mesh, ac_mode="none", ac_every=1, scan_layers=False, **kw)
        print(e.value)
        assert "\n" not in str(e.value) and "use_grouped_mm=False" in str(e.value)
        assert "set moe_args.use_grouped_mm=True" in str(e.value)


@needs_libtpu
def test_expert_parallel_step_compiles_for_tpu_with_all_to_all_and_grouped_matmuls(tmp_path):
    """The narrow 2-layer Qwen3 MoE step under EP 4 compiled ahead of time for v5p:2x2x1 (libtpu's
    compiler): the tokens travel by all-to-all (dispatch and combine, forward and backward, in
    both layers), the experts run as TPU ragged-dot kernels, and there is no loop at all (no
    per-expert loop)."""
    from torchtpu.train.dry_run.estimate import compile_step
    from torchtpu.train.trainer import Trainer

    argv = _argv(tmp_path, "debugmodel_moe", 1, "--dry-run", "--tpu.topology", "v5p:2x2x1")
    t = Trainer(load_config([*argv, "--parallelism.expert_parallel_degree", "4"]), model_overrides=_narrow_moe())
    assert t.mesh.jax_mesh.shape["ep"] == 4 and t.devices[0].platform == "tpu"
    text = compile_step(t.built_step()).as_text()
    # 2 layers x (dispatch of rows and of expert ids, combine) forward + 2 x (dispatch, combine) backward
    assert text.count(" all-to-all(") >= 8, text.count(" all-to-all(")
    assert "ragged-dot" in text and 'custom_call_target="tpu_custom_call"' in text
    assert " while(" not in text


def test_straight_line_copies_recompute_apart_from_the_forward(tmp_path):
    """The dry run's costing copies (the scanned step unrolled: `scan.straight_line_loops`) keep each
    block's recomputation apart from its forward, as the loop that runs does in its two bodies: in the
    Qwen3 MoE step under per-op checkpointing, each layer's dispatch sorts its rows by expert in the
    forward and again in the recomputation: the straight-line program holds the argsorts once per
    loop body, none merged with the forward's. Compiled for a v5p slice, the target the dry run
    costs: a program for XLA:CPU runs the experts' grouped matmuls as loops of their own
    (grouped_mm_blocked.py), and the two loop bodies counted here are the layer scan's."""
    import re

    from torchtpu.costing import computation, while_loops
    from torchtpu.distributed.scan import straight_line_loops
    from torchtpu.train.dry_run.estimate import compile_step
    from torchtpu.train.trainer import Trainer

    argv = _argv(tmp_path, "debugmodel_moe", 1, "--dry-run", "--tpu.topology", "v5p:2x2x1", "--tpu.scan_layers", "true")
    cfg = load_config(
        [*argv, "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
    )
    loop = compile_step(Trainer(cfg, model_overrides=_narrow_moe()).built_step()).as_text()
    with straight_line_loops():
        t = Trainer(cfg, model_overrides=_narrow_moe())
        straight = compile_step(t.built_step()).as_text()

    def sorts(text):  # the dispatch's argsorts (expert order and its inverse)
        return len(re.findall(r" sort\(.*jit\(argsort\)/sort\b", text))

    bodies = [lp["body"] for lp in while_loops(loop)]
    assert len(bodies) == 2 and not while_loops(straight)
    in_bodies = sum(sorts(computation(loop, b)) for b in bodies)
    assert in_bodies >= 2  # the forward's and the recomputation's
    assert sorts(straight) == sorts(loop) - in_bodies + t.model_args.n_layers * in_bodies


def test_scanned_moe_step_gathers_each_layers_experts_without_a_relayout(tmp_path):
    """The 2-layer Qwen3 MoE step under the layer scan and FSDP 4, compiled ahead of time for
    v5p:2x2x1: FSDP's all-gathers inside the loops take each layer's weight rows without the stacked
    dim (scan._layer_rows), so none gathers a (1, ...) array, whose gathered-dim-major layout XLA
    then copies whole into the usual one (the experts' weights, forward and backward)."""
    import re

    from torchtpu.train.dry_run.estimate import compile_step, estimate_lines
    from torchtpu.train.trainer import Trainer

    argv = _argv(tmp_path, "debugmodel_moe", 1, "--dry-run", "--tpu.topology", "v5p:2x2x1")
    cfg = load_config([*argv, "--tpu.scan_layers", "true", "--activation_checkpoint.mode", "full"])
    t = Trainer(cfg, model_overrides=_narrow_moe())
    # the dry run's FLOPs line: under this dispatch the recomputation skips the experts' w2 matmul
    [flops_line] = [
        x for x in estimate_lines(t.built_step(), {"method": "-", "flops_per_device": 1.0}, None) if "XLA FLOPs" in x
    ]
    assert flops_line.endswith(
        "'full' expects 1.33x, less where a MoE layer's recomputation stops before its experts' last matmul)"
    ), flops_line
    text = compile_step(t.built_step()).as_text()
    assert " while(" in text
    gathered = re.findall(r"= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(", text)
    assert any(g.startswith("bf16[8,") for g in gathered), gathered  # the 8 experts' weights, gathered
    assert not [g for g in gathered if re.match(r"\w+\[1,", g)], gathered
