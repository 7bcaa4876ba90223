"""Load statistics of Mixture-of-Experts models for the trainer's metrics.

torchtitan's MoE layers keep a `tokens_per_expert` buffer that the router adds each forward's
counts to. The trainer's compiled step zeroes the buffers first (`reset_counts`, where torchtitan's
optimizer hook zeroes them after each step), so after a step they hold that step's counts, over
all its micro-batches. At each logged step the trainer reads them (the step's one host read,
beside the loss): the figures are the logged step's.

    layers = moe_layers(model)          # [] for a dense model: no MoE metrics
    reset_counts(layers)                # inside the step, before the forward passes
    counts = step_counts(layers)        # at its end (an output of the step), before a bias update zeroes them
    rec.update(load_metrics(layers, counts))    # after it

A block under activation checkpointing runs its forward, and so its router's count, again in
backward: its counts are halved, as torchtitan's bias update halves them.

Metrics (keys of the logged record):
- `moe/max_over_mean`: the largest, over layers, of a layer's busiest expert's tokens over the
  mean per expert (1.0 is perfect balance; the console shows it);
- `moe/cv`: the coefficient of variation of tokens per expert, averaged over layers;
- `moe/layer_<i>/max_over_mean`, `moe/layer_<i>/min_over_mean`, `moe/layer_<i>/cv`: per layer;
- `moe/expert_bias_abs_max`: the largest |expert_bias| (torchtitan's auxiliary-loss-free balancing
  bias), for layers that have one;
- `moe/tokens_per_expert`: the raw counts, one list per layer (metrics.jsonl only).
"""

from __future__ import annotations

__all__ = ["load_metrics", "moe_layers", "reset_counts", "step_counts"]


def moe_layers(model) -> list:
    """(module, its block is recomputed in backward) for each module of `model` holding a
    `tokens_per_expert` buffer (torchtitan's MoE), in order."""
    import torch

    from torchtpu.backend.activation_checkpoint import is_checkpointed

    out = []
    for name, m in model.named_modules():
        if isinstance(getattr(m, "tokens_per_expert", None), torch.Tensor):
            recomputed = any(is_checkpointed(b) for b in _blocks_holding(model, name))
            out.append((m, recomputed))
    return out


def _blocks_holding(model, name: str):
    """The modules on the path from `model` to its submodule `name` (the submodule excluded)."""
    mod, parts = model, name.split(".")
    for part in parts[:-1]:
        mod = getattr(mod, part)
        yield mod


def reset_counts(layers) -> None:
    """Zero the layers' token counts (in place; traced into the step)."""
    import torch

    with torch.no_grad():
        for m, _ in layers:
            m.tokens_per_expert.zero_()


def step_counts(layers):
    """The step's tokens per expert, [layers, experts] (None without layers): the buffers, halved for
    a layer whose block is recomputed in backward (it counted every token twice)."""
    import torch

    if not layers:
        return None
    return torch.stack(
        [torch.floor(m.tokens_per_expert * 0.5) if recomputed else m.tokens_per_expert for m, recomputed in layers]
    ).detach()


def load_metrics(layers, counts) -> dict:
    """Load statistics of the tokens each layer's experts received in the last step (`counts`, the
    step's step_counts); {} without layers."""
    import numpy as np
    import torch

    if not layers or counts is None:
        return {}
    counts = counts.cpu().double().numpy()
    mean = counts.mean(axis=1)
    safe = np.where(mean > 0, mean, 1.0)
    max_over_mean = counts.max(axis=1) / safe
    min_over_mean = counts.min(axis=1) / safe
    cv = counts.std(axis=1) / safe
    rec = {"moe/max_over_mean": float(max_over_mean.max()), "moe/cv": float(cv.mean())}
    for i in range(len(layers)):
        rec[f"moe/layer_{i}/max_over_mean"] = float(max_over_mean[i])
        rec[f"moe/layer_{i}/min_over_mean"] = float(min_over_mean[i])
        rec[f"moe/layer_{i}/cv"] = float(cv[i])
    biases = [m.expert_bias for m, _ in layers if isinstance(getattr(m, "expert_bias", None), torch.Tensor)]
    if biases:
        rec["moe/expert_bias_abs_max"] = max(float(b.detach().abs().max().cpu()) for b in biases)
    rec["moe/tokens_per_expert"] = [[int(round(c)) for c in row] for row in counts]
    return rec
