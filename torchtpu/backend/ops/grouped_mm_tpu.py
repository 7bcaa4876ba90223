"""torch._grouped_mm on TPU through JAX's megablox grouped-matmul kernels (pure JAX functions).

Mixture-of-Experts layers call `_grouped_mm` in three forms (linalg.grouped_mm lists them); PyTorch's
own backward formulas produce the other two from the first. On TPU two of them run as megablox
kernels (`jax.experimental.pallas.ops.tpu.megablox`):

- (M, K) x (G, K, N) -> (M, N), the experts and their input gradients: `gmm`, which visits only
  the row tiles each group owns;
- (K, M) x (M, N) -> (G, K, N), the experts' weight gradients (groups along the contracted
  dimension): `tgmm`. jax 0.10.2's `ragged_dot_general` has no TPU lowering for this form and
  computes it masked and dense (num_groups times the routed work).

Both kernels declare their cost (2 M K N FLOPs) to XLA, so the dry run's cost model counts them.
Both accumulate in float32; the output is rounded once to the result dtype.

Where a kernel cannot apply (`unsupported_reason`: operands other than bfloat16, dimensions that
are not multiples of 128, row counts per shard the row tile does not divide), linalg.py keeps
`jax.lax.ragged_dot`, which is right for every shape, and logs the reason once per shape.

Sharding: a Pallas kernel is a custom call that XLA's partitioner cannot split, so inside a
program over a device mesh the kernel runs per shard under `jax.shard_map`. The routed rows
(sorted by group) are split over the mesh's batch axes (every axis but "tp") and the grouped
operand (the experts' weights) is whole on each device, as FSDP gathers it. Each shard counts
the rows of each group it holds from the global group ends; the weight gradient's per-shard
partial sums are added over the row axes (`psum`) in float32.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import sys

import jax
import jax.experimental.pallas.ops.tpu.megablox.gmm  # noqa: F401  (the module, for costable_metadata)
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm as _gmm
from jax.experimental.pallas.ops.tpu.megablox.gmm import tgmm as _tgmm
from jax.sharding import PartitionSpec as P

from .attention_tpu import MODEL_AXIS, interpreting, mesh_of

__all__ = ["ROW_TILES", "costable_metadata", "forward_gmm", "tiling", "unsupported_reason", "weight_grad_tgmm"]

log = logging.getLogger("torchtpu")

ROW_TILES = (512, 256, 128)  # row tiles tried, largest first (see tiling)
_COL_TILES = (1024, 512, 256, 128)
_LANES = 128


def _row_axes(mesh):
    """The mesh axes the routed rows are split over (every non-manual axis but "tp" with more
    than one device), or () when the program is not over a mesh."""
    if mesh is None:
        return ()
    sizes = dict(mesh.shape)
    manual = set()
    types = getattr(mesh, "axis_types", None)
    if types is not None:
        manual = {a for a, t in zip(mesh.axis_names, types) if t == jax.sharding.AxisType.Manual}
    return tuple(a for a in mesh.axis_names if a != MODEL_AXIS and sizes[a] > 1 and a not in manual)


def _largest_dividing(n: int, tiles) -> int | None:
    return next((t for t in tiles if n % t == 0), None)


def tiling(m: int, k: int, n: int, groups: int) -> tuple[int, int, int] | None:
    """(row tile, contracted tile, output tile) for `m` routed rows per shard; None when a
    dimension is off the 128 lanes. A row tile that straddles two groups is computed once for
    each, so the row tile is the largest that keeps that overhead (about groups x tile / 2 rows)
    under a tenth of the rows, else 128."""
    if m % _LANES or k % _LANES or n % _LANES:
        return None
    tm = next((t for t in ROW_TILES if m % t == 0 and groups * t / 2 <= 0.1 * m), _LANES)
    return tm, _largest_dividing(k, _COL_TILES), _largest_dividing(n, _COL_TILES)


def unsupported_reason(lhs_shape, rhs_shape, lhs_dtype, rhs_dtype, shards: int = 1) -> str | None:
    """Why the megablox kernel cannot compute this `_grouped_mm` form (None: it can). The forms
    are (M, K) x (G, K, N) and (K, M) x (M, N); `shards` is the number of row shards."""
    if jnp.dtype(lhs_dtype) != jnp.bfloat16 or jnp.dtype(rhs_dtype) != jnp.bfloat16:
        return f"operands {jnp.dtype(lhs_dtype)} x {jnp.dtype(rhs_dtype)} (the kernels take bfloat16 x bfloat16)"
    if len(lhs_shape) == 2 and len(rhs_shape) == 3:
        (m, k), (g, _, n) = lhs_shape, rhs_shape
    elif len(lhs_shape) == 2 and len(rhs_shape) == 2:
        (k, m), (_, n) = lhs_shape, rhs_shape
        g = 1
    else:
        return f"a {len(lhs_shape)}-D x {len(rhs_shape)}-D form (the kernels take 2-D x 3-D and 2-D x 2-D)"
    if m % shards:
        return f"{m} routed rows do not split evenly over {shards} shards"
    if tiling(m // shards, k, n, g) is None:
        return f"(rows per shard, K, N) = ({m // shards}, {k}, {n}) are not all multiples of {_LANES}"
    return None


class _CostableNumpy:
    """jax.numpy as megablox's tile bookkeeping (`make_group_metadata`) sees it while its kernels
    are traced here: the same functions, except `repeat` (with a total length) and `histogram`,
    which count with compares and sums instead of scatter-adds of scalars. XLA's TPU cost model
    gives no time for a program holding a scatter-add of scalars, so without this every
    Mixture-of-Experts step would get no step-time estimate. The results are the same integers."""

    def __getattr__(self, name):
        return getattr(jnp, name)

    @staticmethod
    def repeat(a, repeats, axis=None, *, total_repeat_length=None):
        if total_repeat_length is None or axis is not None or jnp.ndim(a) != 1 or jnp.ndim(repeats) != 1:
            return jnp.repeat(a, repeats, axis=axis, total_repeat_length=total_repeat_length)
        # position i takes the first entry whose cumulative count exceeds i; past the total, the last
        ends = jnp.cumsum(repeats)
        pos = jnp.arange(total_repeat_length, dtype=ends.dtype)
        idx = jnp.sum(ends[None, :] <= pos[:, None], axis=1, dtype=jnp.int32)
        return jnp.asarray(a)[jnp.minimum(idx, a.shape[0] - 1)]

    @staticmethod
    def histogram(a, bins=10, range=None, weights=None, density=None):  # noqa: A002  (numpy's names)
        if weights is not None or density or not isinstance(bins, int):
            return jnp.histogram(a, bins=bins, range=range, weights=weights, density=density)
        edges = jnp.histogram_bin_edges(a, bins, range)
        x = jnp.ravel(a).astype(edges.dtype)[:, None]
        last = jnp.arange(bins) == bins - 1  # the last bin includes its right edge
        inside = (x >= edges[None, :-1]) & jnp.where(last[None, :], x <= edges[None, 1:], x < edges[None, 1:])
        return jnp.sum(inside, axis=0), edges


@contextlib.contextmanager
def costable_metadata():
    module = sys.modules["jax.experimental.pallas.ops.tpu.megablox.gmm"]
    saved = module.jnp
    module.jnp = _CostableNumpy()
    try:
        yield
    finally:
        module.jnp = saved


def _local_sizes(ends, start, m_local):
    """Each group's row count inside rows [start, start + m_local) from the global group ends."""
    local_ends = jnp.clip(ends - start, 0, m_local)
    return jnp.diff(local_ends, prepend=jnp.zeros((1,), jnp.int32)).astype(jnp.int32)


def _per_shard(fn, mesh, axes, in_specs, out_specs):
    if not axes:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _shard_start(axes, m_local):
    """First global row of this shard's rows (inside shard_map over `axes`)."""
    if not axes:
        return jnp.int32(0)
    return (jax.lax.axis_index(axes) * m_local).astype(jnp.int32)


def shards_of(*arrays) -> int:
    mesh = mesh_of(*arrays)
    axes = _row_axes(mesh)
    return math.prod(dict(mesh.shape)[a] for a in axes) if axes else 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _differentiable_gmm(x, w, sizes, tile, interpret):
    """megablox's `gmm` in float32 for JAX's own autodiff (a step that differentiates a program
    holding the experts with `jax.vjp`, as expert_parallel's dispatch does; PyTorch's autograd never
    reaches this rule). The gradients are the ones PyTorch's `_grouped_mm` backward computes: the
    input's by `gmm` against the transposed weights, the weights' by `tgmm`, from the output
    gradient rounded to the operands' dtype; rows past the last group get zero."""
    with jax.enable_x64(False), costable_metadata():
        return _gmm(x, w, sizes, jnp.float32, tile, interpret=interpret)


def _differentiable_gmm_fwd(x, w, sizes, tile, interpret):
    return _differentiable_gmm(x, w, sizes, tile, interpret), (x, w, sizes)


def _differentiable_gmm_bwd(tile, interpret, res, g):
    x, w, sizes = res
    g = g.astype(x.dtype)
    (m, k), (groups, _, n) = x.shape, w.shape
    with jax.enable_x64(False), costable_metadata():
        dx = _gmm(g, w, sizes, jnp.float32, tiling(m, n, k, groups), transpose_rhs=True, interpret=interpret)
        dw = _tgmm(x.T, g, sizes, jnp.float32, tile, num_actual_groups=groups, interpret=interpret)
    valid = jnp.arange(m, dtype=jnp.int32)[:, None] < jnp.sum(sizes)
    return jnp.where(valid, dx, 0.0).astype(x.dtype), dw.astype(w.dtype), None


_differentiable_gmm.defvjp(_differentiable_gmm_fwd, _differentiable_gmm_bwd)


def forward_gmm(x, w, ends, out_dtype):
    """(M, K) x (G, K, N) -> (M, N) in `out_dtype`: rows ends[g-1]:ends[g] times w[g]; rows past
    the last end are zero. `ends` int32 (G,)."""
    mesh = mesh_of(x, w)
    axes = _row_axes(mesh)
    shards = math.prod(dict(mesh.shape)[a] for a in axes) if axes else 1
    m, g = x.shape[0], w.shape[0]
    m_local = m // shards
    tile = tiling(m_local, x.shape[1], w.shape[2], g)
    interpret = interpreting()
    rows = P(axes if len(axes) > 1 else axes[0]) if axes else P()

    def kernel(x, w, ends):
        start = _shard_start(axes, m_local)
        sizes = _local_sizes(ends, start, m_local)
        out = _differentiable_gmm(x, w, sizes, tile, interpret)  # Mosaic index maps are 32-bit (x64 off)
        # rows past the last group belong to no group: the kernel leaves them unwritten
        valid = jnp.arange(m_local, dtype=jnp.int32)[:, None] < jnp.sum(sizes)
        return jnp.where(valid, out, 0.0).astype(out_dtype)

    return _per_shard(kernel, mesh, axes, (rows, P(), P()), rows)(x, w, ends)


def weight_grad_tgmm(a, b, ends, out_dtype):
    """(K, M) x (M, N) -> (G, K, N) in `out_dtype`: the g-th product over columns/rows
    ends[g-1]:ends[g] of M only (the experts' weight gradients). `ends` int32 (G,)."""
    mesh = mesh_of(a, b)
    axes = _row_axes(mesh)
    shards = math.prod(dict(mesh.shape)[ax] for ax in axes) if axes else 1
    m = a.shape[1]
    m_local = m // shards
    groups = ends.shape[0]
    tile = tiling(m_local, a.shape[0], b.shape[1], groups)
    interpret = interpreting()
    row_axis = (axes if len(axes) > 1 else axes[0]) if axes else None

    def kernel(a, b, ends):
        start = _shard_start(axes, m_local)
        sizes = _local_sizes(ends, start, m_local)
        with jax.enable_x64(False), costable_metadata():
            out = _tgmm(a, b, sizes, jnp.float32, tile, num_actual_groups=groups, interpret=interpret)
        if axes:
            out = jax.lax.psum(out, axes)
        return out.astype(out_dtype)

    return _per_shard(kernel, mesh, axes, (P(None, row_axis), P(row_axis), P()), P())(a, b, ends)


@functools.cache
def note_fallback(form: str, reason: str) -> None:
    """Log once per (form, reason) that a grouped matmul on TPU keeps jax.lax.ragged_dot."""
    log.warning("torchtpu _grouped_mm %s on TPU: no megablox kernel (%s); it runs as jax.lax.ragged_dot", form, reason)
