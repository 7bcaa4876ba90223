"""Expert parallelism: routed tokens travel to the chips that hold their experts and back.

    out = expert_parallel_ffn(x, expert_ids, [w1, w2, w3], run_experts, mesh, num_experts=E,
                              top_k=k, scores=scores)

`x` (tokens x dim), `expert_ids` (tokens * k: entry t * k + j is the j-th of the E experts token t
goes to; one (token, expert) pair is a "row") and `scores` (tokens x k) are global tensors, split
inside over the data-parallel axes of the job mesh, as the batch is, and over the axes of "ep"
that are not data-parallel ones (with tensor parallelism, "ep" spans the "tp" axis too: the tokens
a tensor-parallel group holds alike are divided among its chips, as torchtitan's
ReordererSequenceParallel does); each weight is (E, ...) and split on its expert dim over the mesh
dim "ep" (its other layout, e.g. FSDP's over "efsdp", is gathered by XLA at the boundary). `out[t]`
is sum_j scores[t, j] * expert_{expert_ids[t*k + j]}(x[t]), summed in float32 (torchtitan's
combine); without `scores`, out has one row per entry of `expert_ids`. Everything between runs per
chip, under one `jax.shard_map`:

1. the chip sorts its rows by expert (stable), reading each from its token (no token is first
   written k times), and writes them into one bucket per "ep" rank: the rows for the experts rank
   r holds, in expert order, then zeros;
2. an all-to-all over "ep" swaps the buckets, so each chip holds every row routed to its experts,
   with each row's local expert id (padding rows get the id one past the last);
3. a stable sort by local expert id groups them, and `run_experts(weights, x, tokens_per_expert)`
   (torch code: torchtitan's grouped matmul, megablox's kernels on TPU, loops over row tiles
   elsewhere) runs each local expert on its own rows only; the padding rows lie past the last
   group and come out zero;
4. the rows go back through the inverse permutation and a second all-to-all, are put back in
   token order, and each token's k outputs are weighted by its scores and summed.

Without expert parallelism (`dim=None`: every chip holds every expert, gathered by FSDP as any
block's weights are), the same program runs without the all-to-alls: each data-parallel chip
sorts its own rows by expert, runs the experts on them (every row in a group, so the grouped
matmuls skip zeroing rows past the groups) and combines them. This is what torchtitan's MoE
computes for each token, but its token reordering, written over the whole batch (a global argsort
and gathers by global positions), partitioned by XLA over a data-parallel mesh gathers every
chip's routed rows onto every chip (for Qwen3 30B-A3B on v5p:2x2x4, all-gathers of 2 GiB per
layer, forward and backward); here no row leaves its chip. The rows are sorted and put back by
scatters, forward and backward (XLA's TPU cost model charges a gather of 1 GiB of rows about
nine times a scatter of them).

Where the experts' last step is a grouped matmul (`front`: everything before it) and the outputs
are combined by scores, that matmul, the way back and the combine are one custom-gradient step
(`_combined_outputs`). Its backward takes each score's gradient from the rows' gradient through the
matmul and the matmul's input, not from the experts' outputs, so activation checkpointing's
recomputation stops before the last matmul instead of rerunning it and the way back.

No row is dropped: a bucket holds all of a chip's rows, the case where every row picks experts of
one rank. That worst case sizes the buffers (ep x the chip's rows each way); the all-to-all is a
plain, padded one, since XLA's CPU backend has no `ragged-all-to-all` and the same program runs
on every backend. Gradients are the shard_map's own (`jax.vjp`, its residuals PyTorch saved
tensors, so activation checkpointing drops and recomputes them): the transposed all-to-alls bring
each row's gradient home, and the weights' gradients are summed over the data-parallel chips that
share an expert shard.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import torch
from jax import lax
from jax.sharding import PartitionSpec as P

from ..backend import array_of, new_base, tracing
from ..backend.ops.grouped_mm_tpu import every_row_grouped, routed_share
from ..backend.ops.linalg import grouped_mm, grouped_mm_stored
from .batch import data_parallel_axes
from .mesh import DeviceMesh
from .vjp_saved import save_vjp, saved_vjp

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
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: Sequence[torch.Tensor],
    run_experts: Callable[..., torch.Tensor],
    mesh: DeviceMesh,
    *,
    num_experts: int,
    dim: str | None = "ep",
    top_k: int = 1,
    scores: torch.Tensor | None = None,
    front: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Each token of `x` (T, width) through the `top_k` experts `expert_ids` (T * top_k, in token
    order: entry t * top_k + j is token t's j-th expert) names, the experts split over the mesh dim
    `dim`, or whole on every chip with `dim=None` (see the module docstring). Without `scores`, the
    (T * top_k, width) outputs, one row per entry of `expert_ids`; with `scores` (T, top_k), their
    combination, (T, width): sum_j scores[t, j] * output[t * top_k + j] in float32, rounded once to
    x's dtype (torchtitan's combine, a batched matmul in float32). `run_experts(local_weights, x,
    tokens_per_expert)` is torch code computing a chip's experts on `x` grouped by expert (rows past
    the groups must come out zero); it runs on each chip's pieces.

    `front(local_weights, x, tokens_per_expert)`, optional, is `run_experts` up to its last grouped
    matmul: `run_experts` must equal `torch._grouped_mm(h, weights[-1].to(h.dtype).transpose(-2, -1),
    offs=cumsum(tokens_per_expert)).type_as(x)` with `h = front(...)`. Given it, a dispatch that
    combines by `scores` runs that matmul, the outputs' way back and the combine as one step whose
    backward needs no expert output (`_combined_outputs`), so activation checkpointing does not
    recompute the last matmul."""
    ep_axes = expert_axes(mesh, dim) if dim is not None else ()
    if dim is not None and not ep_axes:
        raise ValueError(f"expert_parallel_ffn: the mesh {mesh.root()} has no dim {dim!r} of more than one rank")
    root = mesh.root()
    n_ep = math.prod(root.jax_mesh.shape[a] for a in ep_axes)
    if num_experts % n_ep:
        raise ValueError(f"expert_parallel_ffn: {num_experts} experts do not split over {n_ep} expert-parallel ranks")
    if expert_ids.shape != (x.shape[0] * top_k,):
        raise ValueError(
            f"expert_parallel_ffn: {tuple(expert_ids.shape)} expert ids for {x.shape[0]} tokens x top {top_k}"
        )
    if scores is not None and tuple(scores.shape) != (x.shape[0], top_k):
        raise ValueError(f"expert_parallel_ffn: scores of shape {tuple(scores.shape)} for {x.shape[0]} x {top_k}")
    # the tokens are split over the data-parallel axes, as the batch is, and over the expert-parallel
    # axes that are not data-parallel ones (tensor parallelism's, which expert parallelism borrows):
    # each chip dispatches its own part of them, as torchtitan's ReordererSequenceParallel splits the
    # tokens over the tensor-parallel ranks
    data = data_parallel_axes(root)
    data = data + tuple(a for a in ep_axes if a not in data)
    n_data = math.prod(root.jax_mesh.shape[a] for a in data)
    if x.shape[0] % n_data:
        raise ValueError(
            f"expert_parallel_ffn: {x.shape[0]} tokens do not split over the {n_data} chips of the data- and "
            "expert-parallel axes; the batch (times the sequence length, with tensor parallelism) must split evenly"
        )
    for w in weights:
        if w.shape[0] != num_experts:
            raise ValueError(
                f"expert_parallel_ffn: a weight of shape {tuple(w.shape)} has no expert dim of {num_experts}"
            )
    f = _function(
        root.jax_mesh,
        data,
        ep_axes,
        n_ep,
        num_experts,
        run_experts,
        tuple(w.dtype for w in weights),
        x.dtype,
        top_k,
        scores is not None,
        front,
    )
    return _ExpertParallel.apply(f, expert_ids, x, scores, *weights)


@functools.lru_cache(maxsize=64)
def _function(
    jax_mesh, data, ep_axes, n_ep, num_experts, run_experts, weight_dtypes, rows_dtype, top_k, combine, front
):
    """(ids, x[, scores], *weights) -> out over global arrays, one per layout and dtypes (so the
    layers of a model share it, and a step run eagerly compiles it once)."""
    plan = _Plan(jax_mesh, data, ep_axes, n_ep, num_experts, run_experts, weight_dtypes, front)
    return plan.function(rows_dtype, top_k, combine)


class _Plan:
    """What one expert-parallel call needs besides its tensors."""

    def __init__(self, jax_mesh, data, ep_axes, n_ep, num_experts, run_experts, weight_dtypes, front=None):
        self.jax_mesh = jax_mesh
        self.data = data
        self.ep = (ep_axes[0] if len(ep_axes) == 1 else tuple(ep_axes)) if ep_axes else None
        self.n_ep = n_ep
        self.num_experts = num_experts
        self.run_experts = run_experts
        self.weight_dtypes = weight_dtypes
        self.front = front

    def function(self, rows_dtype: torch.dtype, top_k: int, combine: bool):
        """(ids, x[, scores], *weights) -> out over global arrays: the shard_map of `_local`."""
        entry = self.data[0] if len(self.data) == 1 else tuple(self.data)
        n_w = len(self.weight_dtypes)
        tokens = (P(entry, None),) * (2 if combine else 1)

        def local(ids, x, *rest):
            scores, ws = (rest[0], rest[1:]) if combine else (None, rest)
            return self._local(ids, x, scores, ws, rows_dtype, top_k)

        # jitted: run eagerly (a step's first, uncompiled run), a shard_map would dispatch op by op
        return jax.jit(
            jax.shard_map(
                local,
                mesh=self.jax_mesh,
                in_specs=(P(entry),) + tokens + (P(self.ep) if self.ep else P(),) * n_w,
                out_specs=P(entry, None),
                check_vma=False,
            )
        )

    def _local(self, ids, x, scores, weights, rows_dtype, k):
        n = ids.shape[0]
        n_ep, per_rank = self.n_ep, self.num_experts // self.n_ep
        ids = ids.astype(jnp.int32)
        order = jnp.argsort(ids, stable=True)  # the rows (token, choice) sorted by expert
        inverse = jnp.argsort(order)  # where each row went
        rows = _sort_tokens(x, inverse, order, k)  # row i of the sorted rows is token order[i] // k
        if self.ep is None:  # every expert here: run the sorted rows (all of them in a group)
            route = None
            tokens_per_expert = _counts(ids, self.num_experts)
        else:
            # 1. each sorted row's destination rank and its slot in that rank's bucket
            sorted_ids = ids[order]
            dest = sorted_ids // per_rank
            sent = _counts(dest, n_ep)
            slot = jnp.arange(n, dtype=jnp.int32) - (jnp.cumsum(sent) - sent)[dest]
            bucket_ids = jnp.full((n_ep, n), per_rank, jnp.int32)
            bucket_ids = bucket_ids.at[dest, slot].set(sorted_ids - dest * per_rank, unique_indices=True)
            # 2. swap the buckets (bucket s then holds what rank s sent here) and 3. group the rows by
            # local expert, padding last
            got_ids = lax.all_to_all(bucket_ids, self.ep, 0, 0, tiled=True).reshape(n_ep * n)
            route = _Route(dest, slot, jnp.argsort(got_ids, stable=True), self.ep, n_ep)
            rows = route.to_experts(rows)
            tokens_per_expert = _counts(got_ids, per_rank)  # the padding rows' id (per_rank) counts nowhere
        # each expert-parallel rank's buffer holds room for every rank's rows; routed evenly, a
        # rank receives its own number (the kernels' declared costs: grouped_mm_tpu.routed_share)
        grouped = every_row_grouped() if route is None else routed_share(1 / n_ep)
        with grouped:
            if scores is not None and self.front is not None:
                h = self._experts(rows, tokens_per_expert, weights, rows_dtype, self.front)
                ends = jnp.cumsum(tokens_per_expert, dtype=jnp.int32)
                return _combined_outputs(h, weights[-1], scores, order, inverse, ends, route, k, x.dtype)
            done = self._experts(rows, tokens_per_expert, weights, rows_dtype)
        if route is not None:  # 4. back to the sending chips: the sorted rows' outputs
            done = route.from_experts(done)
        done = _unsort(done, order, inverse)  # the rows' outputs in token order
        return done if scores is None else _combine(done, scores, k)

    def _experts(self, x, tokens_per_expert, weights, rows_dtype, run=None):
        ws = [new_base(w, 0, dt) for w, dt in zip(weights, self.weight_dtypes)]
        with tracing(), torch.no_grad():
            out = (run or self.run_experts)(ws, new_base(x, 0, rows_dtype), new_base(tokens_per_expert, 0, torch.int32))
        return array_of(out)


def _counts(ids, groups: int):
    """How many of `ids` (int32) equal each of 0..groups-1, by compares and a sum (a scatter-add
    of scalars, segment_sum's way, leaves XLA's TPU cost model without a time for the program)."""
    return jnp.sum(ids[:, None] == jnp.arange(groups, dtype=jnp.int32)[None, :], axis=0, dtype=jnp.int32)


def _place(v, where):
    """The rows of `v` moved to the positions `where` (a permutation): a scatter. XLA's TPU cost
    model charges a scatter of rows a fraction of what it charges a gather of them."""
    return jnp.zeros_like(v).at[where].set(v, unique_indices=True)


def _expand(x, k):
    """Each token's row k times: row t * k + j is x[t] (a broadcast XLA fuses into its consumer)."""
    return jnp.broadcast_to(x[:, None, :], (x.shape[0], k, x.shape[1])).reshape(-1, x.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _sort_tokens(x, inverse, order, k):
    """The (token, choice) rows sorted: row t * k + j of the token order, x[t], goes to position
    inverse[t * k + j] (`order` is inverse's inverse). Its gradient moves the sorted rows' gradients
    back to token order and sums each token's k of them in float32, rounded once."""
    return _place(_expand(x, k), inverse)


def _sort_tokens_fwd(x, inverse, order, k):
    return _sort_tokens(x, inverse, order, k), (inverse, order)


def _sort_tokens_bwd(k, res, g):
    inverse, order = res
    per_row = _place(g, order)
    if k > 1:
        per_row = jnp.sum(per_row.reshape(-1, k, g.shape[1]).astype(jnp.float32), axis=1)
    return per_row.astype(g.dtype), None, None


_sort_tokens.defvjp(_sort_tokens_fwd, _sort_tokens_bwd)


@jax.custom_vjp
def _unsort(y, order, inverse):
    """The sorted rows back in token order (sorted row i goes to position order[i]); the gradient
    sorts again, both as scatters (JAX's own transpose of a scatter is a gather)."""
    return _place(y, order)


def _unsort_fwd(y, order, inverse):
    return _place(y, order), inverse


def _unsort_bwd(inverse, g):
    return _place(g, inverse), None, None


_unsort.defvjp(_unsort_fwd, _unsort_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _combine(y, scores, k):
    """torchtitan's combine: each token's k outputs (rows t * k .. t * k + k - 1 of `y`, in token
    order) weighted by its scores and summed in float32, rounded once to y's dtype. The residual is
    `y` itself, not a float32 copy."""
    return _combine_fwd(y, scores, k)[0]


def _combine_fwd(y, scores, k):
    rows = y.reshape(scores.shape[0], k, -1).astype(jnp.float32)
    out = jnp.sum(scores.astype(jnp.float32)[:, :, None] * rows, axis=1)
    return out.astype(y.dtype), (y, scores)


def _combine_bwd(k, res, g):
    y, scores = res
    g32 = g.astype(jnp.float32)[:, None, :]
    dy = (scores.astype(jnp.float32)[:, :, None] * g32).astype(y.dtype).reshape(y.shape)
    dscores = jnp.sum(g32 * y.reshape(scores.shape[0], k, -1).astype(jnp.float32), axis=2)
    return dy, dscores.astype(scores.dtype)


_combine.defvjp(_combine_fwd, _combine_bwd)


@jax.tree_util.register_pytree_node_class
class _Route:
    """How a chip's sorted rows reach the chips holding their experts and come back, under
    expert parallelism over the mesh axis (or axes) `axis` of `n_ep` ranks: sorted row i goes to
    slot `slot[i]` of the bucket for rank `dest[i]`, the buckets are swapped by an all-to-all, and
    the rows a chip receives are grouped by its local expert in the order `group` (padding rows,
    zeros, last)."""

    def __init__(self, dest, slot, group, axis, n_ep):
        self.dest, self.slot, self.group, self.axis, self.n_ep = dest, slot, group, axis, n_ep

    def tree_flatten(self):
        return (self.dest, self.slot, self.group), (self.axis, self.n_ep)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def to_experts(self, v):
        """Sorted rows (n, ...) here -> the rows this chip's experts receive, grouped (n_ep * n, ...)."""
        n = v.shape[0]
        bucket = jnp.zeros((self.n_ep, n) + v.shape[1:], v.dtype)
        bucket = bucket.at[self.dest, self.slot].set(v, unique_indices=True)
        got = lax.all_to_all(bucket, self.axis, 0, 0, tiled=True)
        return got.reshape((self.n_ep * n,) + v.shape[1:])[self.group]

    def from_experts(self, v):
        """`to_experts`'s inverse: grouped rows here -> the sorted rows of the chips that sent them."""
        back = _place(v, self.group).reshape((self.n_ep, -1) + v.shape[1:])
        return lax.all_to_all(back, self.axis, 0, 0, tiled=True)[self.dest, self.slot]


def _last_matmul(h, w, ends, out_dtype, every_row):
    """`run_experts`'s last grouped matmul as torch code reaches it (`expert_parallel_ffn`'s `front`):
    each group of rows of h times its expert's w, stored (E, N, H) and applied transposed, in h's
    dtype, then the rows' dtype. `every_row`: every row is in a group (the dispatch without expert
    parallelism), so no pass zeroes the rows past the groups."""
    with every_row_grouped() if every_row else contextlib.nullcontext():
        y = grouped_mm(h, jnp.swapaxes(w.astype(h.dtype), 1, 2), ends)
    return y.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _combined_outputs(h, w, scores, order, inverse, ends, route, k, out_dtype):
    """The experts' last grouped matmul on the hidden states `h` of the rows this chip's experts
    run, the outputs brought back (`route`, None without expert parallelism), put back in token
    order and combined by the scores (`_combine`): what `_unsort` then `_combine` compute on
    `run_experts`'s outputs, the same arithmetic. The backward does not need those outputs. A
    score's gradient, <g, y> with y = h w^T, is <g w, h>: g w is the rows' unscaled gradient
    through the matmul, which the backward computes anyway (the token gradients travel to the
    experts unscaled, with each row's score), and h is the matmul's input. Under activation
    checkpointing the recomputation therefore stops at h, and skips the matmul, the outputs' way
    back and the combine. The gradients are the same products in another order, with g w kept in
    float32 and rounded once:
    - h's is score x (g w);
    - w's is the sum over rows of g (score x h)."""
    return _combined_outputs_fwd(h, w, scores, order, inverse, ends, route, k, out_dtype)[0]


def _combined_outputs_fwd(h, w, scores, order, inverse, ends, route, k, out_dtype):
    y = _last_matmul(h, w, ends, out_dtype, route is None)
    if route is not None:
        y = route.from_experts(y)
    y = _place(y, order)
    return _combine_fwd(y, scores, k)[0], (h, w, scores, order, inverse, ends, route)


def _combined_outputs_bwd(k, out_dtype, res, g):
    h, w, scores, order, inverse, ends, route = res
    score = scores.reshape(-1).astype(jnp.float32)[order]  # each sorted row's score
    g_rows = _place(_expand(g, k), inverse)  # each sorted row's token's gradient, unscaled
    if route is not None:  # to the experts' chips, as the rows went (padding rows: zero, score 0)
        g_rows, score = route.to_experts(g_rows), route.to_experts(score)
    h32 = h.astype(jnp.float32)
    scaled = (h32 * score[:, None]).astype(h.dtype)
    every_row = route is None
    with every_row_grouped() if every_row else routed_share(1 / route.n_ep):
        # the rows' unscaled gradient through the matmul, g w, kept in float32 (rounded once, in dh)
        gw32 = grouped_mm_stored(g_rows.astype(h.dtype), w.astype(h.dtype), ends, jnp.float32)
        # w's gradient in its stored layout (E, N, H): per expert, the sum over its rows of g (score x h)
        dw = jnp.swapaxes(grouped_mm(scaled.T, g_rows.astype(h.dtype), ends), 1, 2).astype(w.dtype)
    dscore = jnp.sum(gw32 * h32, axis=1)
    if route is not None:
        dscore = route.from_experts(dscore)
    dh = (gw32 * score[:, None]).astype(h.dtype)
    return dh, dw, dscore[inverse].reshape(scores.shape).astype(scores.dtype), None, None, None, None


_combined_outputs.defvjp(_combined_outputs_fwd, _combined_outputs_bwd)


class _ExpertParallel(torch.autograd.Function):
    """The dispatch as one autograd node. Its backward is the shard_map's `jax.vjp`, whose residuals
    (the sorted rows, the experts' intermediates, ...) are PyTorch saved tensors (`vjp_saved`), so
    non-reentrant activation checkpointing drops them after the forward and recomputes them."""

    @staticmethod
    def forward(ctx, f, expert_ids, x, scores, *weights):
        ids = array_of(expert_ids)
        ctx.has_scores = scores is not None
        arrays = [array_of(x)] + ([array_of(scores)] if scores is not None else []) + [array_of(w) for w in weights]
        if not any(ctx.needs_input_grad[2:]):  # no gradient wanted (evaluation): no residuals kept
            return new_base(f(ids, *arrays), 0, x.dtype)
        out, vjp = jax.vjp(lambda *a: f(ids, *a), *arrays)
        save_vjp(ctx, vjp)
        return new_base(out, 0, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        grads = [new_base(g, 0) for g in saved_vjp(ctx)(array_of(grad))]
        if not ctx.has_scores:
            grads.insert(1, None)
        return (None, None) + tuple(grads)
