"""torchtitan's Mixture-of-Experts layer (`torchtitan.models.moe`) on the tpu device.

The router (scores, token-choice top-k, tokens per expert by `torch.histc`), the token reordering
and the combine run as torchtitan writes them. The experts run through torchtitan's own
`_run_experts_grouped_mm`: three `torch._grouped_mm` calls over the tokens each expert received,
which the op table lowers to `jax.lax.ragged_dot` (backend/ops/linalg.py). Nothing is dropped and
no expert computes a token it was not routed.

One thing differs from torchtitan's path on CUDA, without changing a number: there, before the
grouped matmul, `indices_padding_wrapper` pads every expert's group of tokens to a multiple of 8
rows (what CUDA's grouped GEMM needs for alignment) with a triton kernel that only runs on CUDA.
`ragged_dot` takes groups of any size, so `use_ragged_experts(model)` makes each `GroupedExperts`
call the grouped matmul on the unpadded groups, as torchtitan does itself under expert parallelism.
The padding rows are zeros whose outputs are dropped, so the results are the same.
"""

from __future__ import annotations

import torch
from torchtitan.models.moe.moe import GroupedExperts, _run_experts_grouped_mm

__all__ = ["RaggedGroupedExperts", "use_ragged_experts"]


class RaggedGroupedExperts(GroupedExperts):
    """torchtitan's GroupedExperts whose grouped matmul runs on the unpadded groups of tokens (a
    subclass: same parameters, names and state_dict)."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if not self.use_grouped_mm:
            return super().forward(x, num_tokens_per_expert)
        return _run_experts_grouped_mm(self.w1, self.w2, self.w3, x, num_tokens_per_expert)


def use_ragged_experts(model: torch.nn.Module) -> torch.nn.Module:
    """Make every torchtitan `GroupedExperts` in `model` run its grouped matmul on unpadded groups
    of tokens, in place; returns `model`. A model without experts is returned unchanged."""
    for module in model.modules():
        if type(module) is GroupedExperts:
            module.__class__ = RaggedGroupedExperts
    return model
