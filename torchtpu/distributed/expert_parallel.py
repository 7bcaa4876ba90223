"""Expert parallelism: routed tokens travel to the chips that hold their experts and back.

    out = expert_parallel_ffn(rows, expert_ids, [w1, w2, w3], run_experts, mesh, num_experts=E)

`rows` (tokens x dim, one row per (token, chosen expert) pair) and `expert_ids` (which of the E
experts each row goes to) are global tensors, split inside over the data-parallel axes of the job
mesh, as the batch is, and over the axes of "ep" that are not data-parallel ones (with tensor
parallelism, "ep" spans the "tp" axis too: the rows a tensor-parallel group holds alike are divided
among its chips, as torchtitan's ReordererSequenceParallel does); each weight is (E, ...) and split
on its expert dim over the mesh dim "ep" (its other layout, e.g. FSDP's over "efsdp", is gathered by
XLA at the boundary). `out[i]` is row i through expert expert_ids[i]. Everything between runs per
chip, under one `jax.shard_map`:

1. the chip sorts its rows by expert (stable) and writes them into one bucket per "ep" rank: the
   rows for the experts rank r holds, in expert order, then zeros;
2. an all-to-all over "ep" swaps the buckets, so each chip holds every row routed to its experts,
   with each row's local expert id (padding rows get the id one past the last);
3. a stable sort by local expert id groups them, and `run_experts(weights, x, tokens_per_expert)`
   (torch code: torchtitan's grouped matmul, lowered to `jax.lax.ragged_dot`) runs each local
   expert on its own rows only; the padding rows lie past the last group and come out zero;
4. the rows go back through the inverse permutation and a second all-to-all, and are put back
   in their original order.

Without expert parallelism (`dim=None`: every chip holds every expert, gathered by FSDP as any
block's weights are), the same program runs without the all-to-alls: each data-parallel chip
sorts its own rows by expert, runs the experts on them and puts them back in order. This is what
torchtitan's MoE computes for each row, but its token reordering, written over the whole batch
(a global argsort and gathers by global positions), partitioned by XLA over a data-parallel mesh
gathers every chip's routed rows onto every chip (for Qwen3 30B-A3B on v5p:2x2x4, all-gathers of
2 GiB per layer, forward and backward); here no row leaves its chip.

No row is dropped: a bucket holds all of a chip's rows, the case where every row picks experts of
one rank. That worst case sizes the buffers (ep x the chip's rows each way); the all-to-all is a
plain, padded one, since XLA's CPU backend has no `ragged-all-to-all` and the same program runs
on every backend. Gradients are the shard_map's own (`jax.vjp`): the transposed all-to-alls bring
each row's gradient home, and the weights' gradients are summed over the data-parallel chips that
share an expert shard.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import torch
from jax import lax
from jax.sharding import PartitionSpec as P

from ..backend.state import tracing
from ..backend.tensor import new_base
from ..backend.views import array_of
from .batch import data_parallel_axes
from .mesh import DeviceMesh

__all__ = ["expert_parallel_ffn", "expert_axes"]


def expert_axes(mesh: DeviceMesh, dim: str = "ep") -> tuple[str, ...]:
    """The JAX axes of the job mesh's expert-parallel dim `dim` (empty when the mesh has none or it
    has one rank)."""
    root = mesh.root()
    try:
        view = root[dim]
    except KeyError:
        return ()
    return view.dims[0] if view.size() > 1 else ()


def expert_parallel_ffn(
    rows: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: Sequence[torch.Tensor],
    run_experts: Callable[..., torch.Tensor],
    mesh: DeviceMesh,
    *,
    num_experts: int,
    dim: str | None = "ep",
) -> torch.Tensor:
    """Each row of `rows` through the expert `expert_ids` names, the experts split over the mesh
    dim `dim`, or whole on every chip with `dim=None` (see the module docstring).
    `run_experts(local_weights, x, tokens_per_expert)` is torch code computing a chip's experts on
    `x` grouped by expert (rows past the groups must come out zero); it runs on each chip's pieces."""
    ep_axes = expert_axes(mesh, dim) if dim is not None else ()
    if dim is not None and not ep_axes:
        raise ValueError(f"expert_parallel_ffn: the mesh {mesh.root()} has no dim {dim!r} of more than one rank")
    root = mesh.root()
    n_ep = math.prod(root.jax_mesh.shape[a] for a in ep_axes)
    if num_experts % n_ep:
        raise ValueError(f"expert_parallel_ffn: {num_experts} experts do not split over {n_ep} expert-parallel ranks")
    # the rows are split over the data-parallel axes, as the batch is, and over the expert-parallel axes
    # that are not data-parallel ones (tensor parallelism's, which expert parallelism borrows): each chip
    # dispatches its own part of the rows, as torchtitan's ReordererSequenceParallel splits the tokens
    # over the tensor-parallel ranks
    data = data_parallel_axes(root)
    data = data + tuple(a for a in ep_axes if a not in data)
    n_data = math.prod(root.jax_mesh.shape[a] for a in data)
    if rows.shape[0] % n_data:
        raise ValueError(
            f"expert_parallel_ffn: {rows.shape[0]} rows do not split over the {n_data} chips of the data- and "
            "expert-parallel axes; the batch (times the sequence length, with tensor parallelism) must split evenly"
        )
    for w in weights:
        if w.shape[0] != num_experts:
            raise ValueError(
                f"expert_parallel_ffn: a weight of shape {tuple(w.shape)} has no expert dim of {num_experts}"
            )
    f = _function(
        root.jax_mesh, data, ep_axes, n_ep, num_experts, run_experts, tuple(w.dtype for w in weights), rows.dtype
    )
    return _ExpertParallel.apply(f, expert_ids, rows, *weights)


@functools.lru_cache(maxsize=64)
def _function(jax_mesh, data, ep_axes, n_ep, num_experts, run_experts, weight_dtypes, rows_dtype):
    """(ids, rows, *weights) -> out over global arrays, one per layout and dtypes (so the layers of a
    model share it, and a step run eagerly compiles it once)."""
    return _Plan(jax_mesh, data, ep_axes, n_ep, num_experts, run_experts, weight_dtypes).function(rows_dtype)


class _Plan:
    """What one expert-parallel call needs besides its tensors."""

    def __init__(self, jax_mesh, data, ep_axes, n_ep, num_experts, run_experts, weight_dtypes):
        self.jax_mesh = jax_mesh
        self.data = data
        self.ep = (ep_axes[0] if len(ep_axes) == 1 else tuple(ep_axes)) if ep_axes else None
        self.n_ep = n_ep
        self.num_experts = num_experts
        self.run_experts = run_experts
        self.weight_dtypes = weight_dtypes

    def function(self, rows_dtype: torch.dtype):
        """(ids, rows, *weights) -> out over global arrays: the shard_map of `_local`."""
        entry = self.data[0] if len(self.data) == 1 else tuple(self.data)
        n_w = len(self.weight_dtypes)
        # jitted: run eagerly (a step's first, uncompiled run), a shard_map would dispatch op by op
        return jax.jit(
            jax.shard_map(
                lambda ids, rows, *ws: self._local(ids, rows, ws, rows_dtype),
                mesh=self.jax_mesh,
                in_specs=(P(entry), P(entry, None)) + (P(self.ep) if self.ep else P(),) * n_w,
                out_specs=P(entry, None),
                check_vma=False,
            )
        )

    def _local(self, ids, rows, weights, rows_dtype):
        n, width = rows.shape
        n_ep, per_rank = self.n_ep, self.num_experts // self.n_ep
        ids = ids.astype(jnp.int32)
        if self.ep is None:  # every expert here: sort this chip's rows, run them, put them back
            order = jnp.argsort(ids, stable=True)
            done = self._experts(rows[order], _counts(ids, self.num_experts), weights, rows_dtype)
            return jnp.zeros_like(done).at[order].set(done, unique_indices=True)
        # 1. sort by expert; each row's destination rank and its slot in that rank's bucket
        order = jnp.argsort(ids, stable=True)
        sorted_ids = ids[order]
        dest = sorted_ids // per_rank
        sent = _counts(dest, n_ep)
        slot = jnp.arange(n, dtype=jnp.int32) - (jnp.cumsum(sent) - sent)[dest]
        bucket = jnp.zeros((n_ep, n, width), rows.dtype).at[dest, slot].set(rows[order], unique_indices=True)
        bucket_ids = jnp.full((n_ep, n), per_rank, jnp.int32)
        bucket_ids = bucket_ids.at[dest, slot].set(sorted_ids - dest * per_rank, unique_indices=True)
        # 2. swap the buckets: bucket s now holds what rank s sent here
        got = lax.all_to_all(bucket, self.ep, 0, 0, tiled=True).reshape(n_ep * n, width)
        got_ids = lax.all_to_all(bucket_ids, self.ep, 0, 0, tiled=True).reshape(n_ep * n)
        # 3. group by local expert (padding last) and run the experts
        group = jnp.argsort(got_ids, stable=True)
        tokens_per_expert = _counts(got_ids, per_rank)  # the padding rows' id (per_rank) counts nowhere
        done = self._experts(got[group], tokens_per_expert, weights, rows_dtype)
        # 4. back to the bucket layout, back to the sending chips, back to the original order
        back = jnp.zeros_like(done).at[group].set(done, unique_indices=True).reshape(n_ep, n, width)
        home = lax.all_to_all(back, self.ep, 0, 0, tiled=True)
        return jnp.zeros((n, width), home.dtype).at[order].set(home[dest, slot], unique_indices=True)

    def _experts(self, x, tokens_per_expert, weights, rows_dtype):
        ws = [new_base(w, 0, dt) for w, dt in zip(weights, self.weight_dtypes)]
        with tracing(), torch.no_grad():
            out = self.run_experts(ws, new_base(x, 0, rows_dtype), new_base(tokens_per_expert, 0, torch.int32))
        return array_of(out)


def _counts(ids, groups: int):
    """How many of `ids` (int32) equal each of 0..groups-1, by compares and a sum (a scatter-add
    of scalars, segment_sum's way, leaves XLA's TPU cost model without a time for the program)."""
    return jnp.sum(ids[:, None] == jnp.arange(groups, dtype=jnp.int32)[None, :], axis=0, dtype=jnp.int32)


class _ExpertParallel(torch.autograd.Function):
    """The dispatch as one autograd node. Its backward is the shard_map's `jax.vjp`, whose residuals
    (the sorted rows, the experts' intermediates, ...) are saved as tpu tensors with
    `ctx.save_for_backward`, not kept inside the vjp closure: PyTorch's saved-tensor hooks then see
    them, so non-reentrant activation checkpointing drops them after the forward and recomputes
    them in backward, as it does every other op's; the backward rebuilds the vjp from them."""

    @staticmethod
    def forward(ctx, f, expert_ids, rows, *weights):
        ids = array_of(expert_ids)
        arrays = [array_of(rows)] + [array_of(w) for w in weights]
        if not any(ctx.needs_input_grad[2:]):  # no gradient wanted (evaluation): no residuals kept
            return new_base(f(ids, *arrays), 0, rows.dtype)
        out, vjp = jax.vjp(lambda r, *ws: f(ids, r, *ws), *arrays)
        leaves, ctx.treedef = jax.tree_util.tree_flatten(vjp)
        ctx.saved = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, jax.core.Tracer))]
        ctx.others = {i: leaf for i, leaf in enumerate(leaves) if i not in set(ctx.saved)}
        ctx.save_for_backward(*(new_base(leaves[i], 0) for i in ctx.saved))
        return new_base(out, 0, rows.dtype)

    @staticmethod
    def backward(ctx, grad):
        leaves = dict(ctx.others)
        leaves.update(zip(ctx.saved, (array_of(t) for t in ctx.saved_tensors)))
        vjp = jax.tree_util.tree_unflatten(ctx.treedef, [leaves[i] for i in range(len(leaves))])
        grads = vjp(array_of(grad))
        return (None, None) + tuple(new_base(g, 0) for g in grads)
