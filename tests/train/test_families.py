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

from torchtpu.train.config_manager import load_config

from .debug_run import REPO
from .reference import cpu_state, reference_losses

pytestmark = pytest.mark.usefixtures("keep_current_mesh")

STEPS = 10
NARROW = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "hidden_dim": 128, "n_layers": 2}


def _narrow_moe():
    from torchtpu.models.registry import get_family

    moe = get_family("qwen3").model_args("debugmodel_moe").moe_args
    # 8 experts, 2 per token: the flavor's router (softmax, normalized top-k scores) on fewer experts
    return {**NARROW, "moe_inter_dim": 64, "moe_args": dataclasses.replace(moe, num_experts=8, top_k=2)}


def _train_and_reference(tmp_path, flavor, overrides):
    from torchtpu.train.trainer import Trainer

    argv = [
        "--config",
        os.path.join(REPO, "train_configs", "qwen3_debug.toml"),
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
    ]
    cfg = load_config(argv)
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
    return t


def test_qwen3_dense_fsdp8_matches_pytorch(tmp_path):
    """Qwen3 (q/k norms, GQA, tied embedding and output) under FSDP 8: 10 losses = plain PyTorch's."""
    t = _train_and_reference(tmp_path, "debugmodel", NARROW)
    assert t.model.output.weight is t.model.tok_embeddings.weight


def test_qwen3_moe_fsdp8_matches_pytorch(tmp_path):
    """Qwen3 MoE under FSDP 8: the router's top-k, the grouped matmuls over each expert's tokens and
    the weighted combine give plain PyTorch's 10 losses; the router counted every routed token."""

    overrides = _narrow_moe()
    t = _train_and_reference(tmp_path, "debugmodel_moe", overrides)
    moe = t.model.layers["0"].moe
    assert type(moe.experts).__name__ == "RaggedGroupedExperts"
    # the load metrics (logged every step here): each layer's experts received the step's 8 x 32
    # tokens x top-2, read from the layers' tokens_per_expert buffers, which each step zeroes first
    import json

    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"loss"' in line]
    assert len(records) == STEPS
    for rec, hist in zip(records, t.history):
        counts = rec["moe/tokens_per_expert"]
        assert len(counts) == 2 and all(len(row) == 8 and sum(row) == 8 * 32 * 2 for row in counts), counts
        per_layer = [max(row) / (sum(row) / 8) for row in counts]
        assert rec["moe/max_over_mean"] == pytest.approx(max(per_layer)) == hist["moe/max_over_mean"]
        assert rec["moe/layer_1/max_over_mean"] == pytest.approx(per_layer[1])
        assert 0 < rec["moe/cv"] < 3 and rec["moe/layer_0/min_over_mean"] <= 1
    assert moe.tokens_per_expert.cpu().tolist() == records[-1]["moe/tokens_per_expert"][0]


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
