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

from torchtpu.train.config_manager import load_config

from .debug_run import REPO
from .reference import cpu_state, reference_run

pytestmark = pytest.mark.usefixtures("keep_current_mesh")

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


def _train_and_reference(tmp_path, flavor, overrides, family="qwen3", extra=()):
    from torchtpu.train.trainer import Trainer

    argv = [
        "--config",
        os.path.join(REPO, "train_configs", f"{family}_debug.toml"),
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "1",
        "--training.steps",
        str(STEPS),
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
    cfg = load_config(argv)
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
    return t, ref_model


def test_qwen3_dense_fsdp8_matches_pytorch(tmp_path):
    """Qwen3 (q/k norms, GQA, tied embedding and output) under FSDP 8: 10 losses = plain PyTorch's."""
    t, _ = _train_and_reference(tmp_path, "debugmodel", NARROW)
    assert t.model.output.weight is t.model.tok_embeddings.weight


def test_qwen3_moe_fsdp8_matches_pytorch(tmp_path):
    """Qwen3 MoE under FSDP 8: the router's top-k, the grouped matmuls over each expert's tokens and
    the weighted combine give plain PyTorch's 10 losses; the router counted every routed token."""
    import torch

    overrides = _narrow_moe()
    t, _ = _train_and_reference(tmp_path, "debugmodel_moe", overrides)
    moe = t.model.layers["0"].moe
    assert type(moe.experts).__name__ == "RaggedGroupedExperts"
    counts = moe.tokens_per_expert.cpu()
    # torchtitan's Qwen3 accumulates the counts over the run: 10 steps x 8 x 32 tokens x top-2
    assert counts.sum().item() == STEPS * 8 * 32 * 2
    assert torch.count_nonzero(counts).item() > 1


@pytest.mark.parametrize("family", ["deepseek_v3", "llama4"])
def test_load_balanced_moe_fsdp8_matches_pytorch(tmp_path, family):
    """DeepSeek-V3 (MLA, a dense first layer, shared + routed experts) and Llama 4 (dense and MoE
    layers interleaved, a shared expert, sigmoid routing; its blocks under activation checkpointing,
    so their forward and token counts run again in backward) under FSDP 8: 10 losses = plain
    PyTorch's with torchtitan's optimizer, whose pre-step hook moves each MoE layer's expert bias;
    the trainer's update inside the compiled step leaves the same biases, and the counts zeroed as
    torchtitan does."""
    import torch

    overrides = _narrow_deepseek_v3() if family == "deepseek_v3" else _narrow_llama4()
    extra = ("--activation_checkpoint.mode", "full") if family == "llama4" else ()
    t, ref_model = _train_and_reference(tmp_path, "debugmodel", overrides, family, extra)
    assert [recomputed for _, recomputed in t.balanced_moe] == [family == "llama4"]
    moe = t.model.layers["1"].moe
    assert not hasattr(t.model.layers["0"], "moe")  # the dense first layer
    assert type(moe.experts).__name__ == "RaggedGroupedExperts"
    bias = moe.expert_bias.cpu()
    ref_bias = ref_model.layers["1"].moe.expert_bias
    assert torch.count_nonzero(ref_bias).item() > 0  # the update moved the reference's biases
    torch.testing.assert_close(bias, ref_bias, rtol=0, atol=1e-7)
    assert torch.count_nonzero(moe.tokens_per_expert.cpu()).item() == 0


def test_registry_is_what_the_config_offers():
    """The configuration's [model] name/flavor choices are the registry's families and flavors, and
    each flavor is one of torchtitan's."""
    import importlib

    from torchtpu.models.registry import FAMILIES, UnknownModel, get_family, model_flavors
    from torchtpu.train.job_config import MODEL_FLAVORS

    assert MODEL_FLAVORS == model_flavors()
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
    from torchtpu.train.job_config import ConfigError
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
