"""A `jax.vjp` inside a `torch.autograd.Function`, its residuals kept as PyTorch saved tensors.

A Function whose forward runs a JAX program (a shard_map) takes its backward from `jax.vjp`. The vjp
function holds the program's residuals (the arrays its backward needs). Kept on `ctx` as they are,
they stay out of PyTorch's view: saved-tensor hooks never see them, so non-reentrant activation
checkpointing (torch.utils.checkpoint and torchtpu's) neither drops them after the forward nor
recomputes them, and a checkpointed step holds them for every layer at once. `save_vjp` saves the
residual arrays with `ctx.save_for_backward` as tpu tensors; `saved_vjp` rebuilds the vjp function
from them (the recomputed ones, under checkpointing) in backward.
"""

from __future__ import annotations

import jax

from ..backend import array_of, new_base

__all__ = ["save_vjp", "saved_vjp"]


def save_vjp(ctx, vjp) -> None:
    """Keep `vjp` (what `jax.vjp` returned) on `ctx`: its array leaves as saved tensors, the rest
    and its structure as attributes."""
    leaves, ctx.vjp_treedef = jax.tree_util.tree_flatten(vjp)
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, jax.core.Tracer))]
    taken = set(arrays)
    ctx.vjp_arrays = arrays
    ctx.vjp_others = {i: leaf for i, leaf in enumerate(leaves) if i not in taken}
    ctx.save_for_backward(*(new_base(leaves[i], 0) for i in arrays))


def saved_vjp(ctx):
    """The vjp function `save_vjp` kept, rebuilt from `ctx.saved_tensors`."""
    leaves = dict(ctx.vjp_others)
    leaves.update(zip(ctx.vjp_arrays, (array_of(t) for t in ctx.saved_tensors)))
    return jax.tree_util.tree_unflatten(ctx.vjp_treedef, [leaves[i] for i in range(len(leaves))])
