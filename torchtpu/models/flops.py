"""Training FLOPs per token, the figure MFU divides by.

Dense decoders (Llama 3) use the 6 N + attention count below; torchtitan families that count their
own (`get_nparams_and_flops` on their arguments: Qwen3, its Mixture-of-Experts flavors counting only
the top-k experts a token runs through) use torchtitan's.
"""

from __future__ import annotations

__all__ = ["model_flops_per_token", "non_embedding_params", "num_flops_per_token", "torchtitan_flops_per_token"]


def num_flops_per_token(num_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """Training FLOPs per token of a dense decoder: 6 N + 12 L H Q T.

    N = parameters outside the embedding table (each is used in one multiply-add per token in the
    forward pass and two in the backward: 2 + 4 = 6 FLOPs). The attention term counts the two
    matmuls QK^T and AV (each Q = head_dim wide, over T = seq_len keys) for H heads in L layers,
    forward and backward, with no discount for causal masking (the usual MFU convention).
    """
    return int(6 * num_params + 12 * n_layers * n_heads * head_dim * seq_len)


def non_embedding_params(model) -> tuple[int, int]:
    """(all parameters, parameters outside the model's top-level nn.Embedding modules)."""
    import torch.nn as nn

    total = sum(p.numel() for p in model.parameters())
    embedding = sum(p.numel() for m in model.children() if isinstance(m, nn.Embedding) for p in m.parameters())
    return total, total - embedding


def model_flops_per_token(model, model_args, seq_len: int) -> tuple[int, int]:
    """(number of parameters, training FLOPs per token) for a torchtitan dense model (Llama 3).

    Works on a model built on the meta device. Weight tying (if the args enable it) removes the
    embedding from the parameter count, as the embedding is then also the output projection."""
    total, non_embedding = non_embedding_params(model)
    head_dim = getattr(model_args, "head_dim", None) or model_args.dim // model_args.n_heads
    flops = num_flops_per_token(non_embedding, model_args.n_layers, model_args.n_heads, head_dim, seq_len)
    if getattr(model_args, "enable_weight_tying", False):
        total = non_embedding
    return total, flops


def torchtitan_flops_per_token(model, model_args, seq_len: int) -> tuple[int, int]:
    """(number of parameters, training FLOPs per token) as torchtitan counts them for the family
    (`model_args.get_nparams_and_flops`); works on a model built on the meta device."""
    total, flops = model_args.get_nparams_and_flops(model, seq_len)
    return int(total), int(flops)
