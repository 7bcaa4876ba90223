"""Auxiliary-loss-free load balancing of Mixture-of-Experts layers, inside the compiled step.

torchtitan's MoE layer routes on `scores + expert_bias` and adds the tokens each expert received to
its `tokens_per_expert` buffer in every forward. For the families whose torchtitan optimizer is
`build_optimizers_with_moe_load_balancing` (ModelFamily.moe_load_balancing), a hook before each
optimizer step moves the bias: per MoE layer, with n the step's counts (summed over the
gradient-accumulation micro-batches and over the data-parallel ranks),

    delta = load_balance_coeff * sign(mean(n) - n);  expert_bias += delta - mean(delta);  n = 0

so an expert that got fewer tokens than the average is preferred in the next step. torchtitan halves
the counts of a block under activation checkpointing, whose forward (and its count) runs again in
backward. `update_expert_bias(balanced_moe_layers(model))` does the same, in the same order, inside
the compiled step; the counts are those of the global batch already (the buffer is one global
tensor, so no reduction).
"""

from __future__ import annotations

__all__ = ["balanced_moe_layers", "update_expert_bias"]


def balanced_moe_layers(model) -> list[tuple[object, bool]]:
    """(MoE layer, its block is recomputed in backward) for each block of `model.layers` with a MoE
    layer, in order; empty when the model has none or its first MoE layer has no load_balance_coeff
    (torchtitan then registers no update)."""
    from torchtpu.backend.activation_checkpoint import is_checkpointed

    out = []
    for block in model.layers.values():
        inner = getattr(block, "module", block) if is_checkpointed(block) else block
        if not getattr(inner, "moe_enabled", False):
            continue
        out.append((inner.moe, is_checkpointed(block)))
    if not out or not out[0][0].load_balance_coeff:
        return []
    return out


def update_expert_bias(layers: list[tuple[object, bool]]):
    """torchtitan's expert-bias update for `layers` (balanced_moe_layers), in place. Returns the
    counts it used, [layers, experts] (the step's routed tokens: the metrics read them, since the
    update zeroes the buffers), or None when a layer without a coefficient stops the update."""
    import torch

    counts = []
    for moe, recomputed in layers:
        if moe.load_balance_coeff is None:
            return None  # as torchtitan: a layer without a coefficient stops the whole update
        n = moe.tokens_per_expert
        # torchtitan's n // 2; n holds whole counts, so floor(n / 2) is the same number, and it
        # lowers without the 64-bit float arithmetic of the tpu floor division by a Python integer
        counts.append(torch.floor(n * 0.5) if recomputed else n)
    by_layer = torch.vstack(counts)
    with torch.no_grad():
        for i, (moe, _) in enumerate(layers):
            n = by_layer[i].float()
            delta = moe.load_balance_coeff * torch.sign(n.mean() - n)
            moe.expert_bias.add_(delta - delta.mean())
            moe.tokens_per_expert.zero_()
    return by_layer
