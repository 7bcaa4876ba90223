"""torch._grouped_mm on TPU through JAX's megablox grouped-matmul kernels (pure JAX functions).

Mixture-of-Experts layers call `_grouped_mm` in three forms (linalg.grouped_mm lists them); PyTorch's
own backward formulas produce the other two from the first. On TPU two of them run as megablox
kernels (`jax.experimental.pallas.ops.tpu.megablox`):

- (M, K) x (G, K, N) -> (M, N), the experts and their input gradients: `gmm`, which visits only
  the row tiles each group owns;
- (K, M) x (M, N) -> (G, K, N), the experts' weight gradients (groups along the contracted
  dimension): `tgmm`. jax 0.10.2's `ragged_dot_general` has no TPU lowering for this form and
  computes it masked and dense (num_groups times the routed work).

Both kernels declare their cost to XLA, so the dry run's cost model counts them: the work of the
row tiles their grid visits (`_visited_cost`), not megablox's own 2 M K N FLOPs. A row tile that
holds rows of two experts runs once for each, so a dropless layer's G experts cost up to G - 1
tiles more than its rows (Qwen3 30B-A3B's 128 experts over 256-row tiles: 12% more than 2 M K N);
under expert parallelism a chip's buffer is sized for every rank's rows and the kernels run only the
rows routed to it, declared for balanced routing (`routed_share`).
Both accumulate in float32 and write the result dtype (bfloat16 for bfloat16 operands), rounding
once; the weight gradient's per-shard partial sums are the exception (float32, see below). Both
read the experts' weights, and write their gradients, in the layout torchtitan stores them,
(G, N, K) for the experts' (M, K) x (G, K, N): `gmm` reads them transposed, `tgmm` computes the
transposed product, and the transposes PyTorch's views put around them cancel in XLA. The tiles
(`tiling`) are chosen per shape to fit the kernels' blocks in the TPU's scoped VMEM.

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
import contextvars
import functools
import logging
import math
import sys

import jax
import jax.experimental.pallas.ops.tpu.megablox.gmm  # noqa: F401  (the module, for costable_kernels)
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm as _gmm
from jax.experimental.pallas.ops.tpu.megablox.gmm import tgmm as _tgmm
from jax.sharding import PartitionSpec as P

from ...costing import roofline_seconds
from ...hardware import CHIPS, TP_AXIS
from ..pallas_mode import interpreting, mesh_of

__all__ = [
    "ROW_TILES",
    "costable_kernels",
    "routed_share",
    "forward_gmm",
    "stored_gmm",
    "tiling",
    "unsupported_reason",
    "weight_grad_tgmm",
]

log = logging.getLogger("torchtpu")

ROW_TILES = (512, 256, 128)  # row tiles tried, largest first (see tiling)
_MAX_COL_TILE = 2048
_LANES = 128
# Mosaic's scoped VMEM on v5p is 16 MiB; a kernel's blocks (double-buffered) and its float32
# accumulator stay under this, the rest left to the kernel's own temporaries
VMEM_BUDGET = 12 * 2**20
_TILE_CHIP = CHIPS["v5p"]  # the chip whose peak and bandwidth rank the tilings (for choosing tiles only)
_STEP_SECONDS = 0.35e-6  # a Pallas grid step's own overhead


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
    return tuple(a for a in mesh.axis_names if a != TP_AXIS and sizes[a] > 1 and a not in manual)


def _col_tiles(n: int) -> list[int]:
    """The tiles of a contracted or output dimension of `n`: multiples of 128 dividing it, at most
    _MAX_COL_TILE, largest first."""
    return [t for t in range(min(n, _MAX_COL_TILE), 0, -_LANES) if n % t == 0]


def vmem_bytes(kind: str, tile: tuple[int, int, int], in_bytes: int = 2, out_bytes: int = 4) -> int:
    """VMEM a megablox kernel's blocks take at `tile` = (tm, tk, tn): each input and output block
    twice (Pallas double-buffers them) and the float32 accumulator, (tm, tn) for `gmm`, (tk, tn)
    for `tgmm`."""
    tm, tk, tn = tile
    if kind == "gmm":  # lhs (tm, tk), rhs (tk, tn), out (tm, tn)
        return 2 * (tm * tk + tk * tn) * in_bytes + 2 * tm * tn * out_bytes + 4 * tm * tn
    # tgmm: lhs (tm, tk), rhs (tm, tn), out (tk, tn)
    return 2 * (tm * tk + tm * tn) * in_bytes + 2 * tk * tn * out_bytes + 4 * tk * tn


def _tile_visits(rows: int, tm: int, groups: int) -> int:
    """The row tiles megablox's grid runs for `rows` routed rows in `groups` groups whose
    boundaries all fall inside tiles (the dropless case): a tile per tm rows, and a tile that
    straddles two groups once for each, groups - 1 more."""
    return -(-rows // tm) + groups - 1


def _seconds(kind, m, k, n, groups, tile, in_bytes, out_bytes):
    """A roofline time of one kernel at `tile`, to rank tilings: its row tiles (`_tile_visits`),
    the bytes its grid reads (an operand block is read again for each block of the dimension it
    does not span) and writes, and each grid step's overhead."""
    tm, tk, tn = tile
    row_tiles = _tile_visits(m, tm, groups)
    flops = 2 * row_tiles * tm * k * n
    if kind == "gmm":  # grid (n / tn, row tiles, k / tk); the weights' block per row tile
        moved = m * k * in_bytes * (n // tn) + row_tiles * k * n * in_bytes + m * n * out_bytes
    else:  # grid (n / tn, k / tk, row tiles); one output block per group
        moved = m * k * in_bytes * (n // tn) + m * n * in_bytes * (k // tk) + groups * k * n * out_bytes
    steps = (n // tn) * (k // tk) * row_tiles
    return roofline_seconds(flops, moved, _TILE_CHIP.peak_bf16_flops, _TILE_CHIP.hbm_bandwidth) + steps * _STEP_SECONDS


def tiling(
    m: int, k: int, n: int, groups: int, kind: str = "gmm", in_bytes: int = 2, out_bytes: int = 4
) -> tuple[int, int, int] | None:
    """(row tile, contracted tile, output tile) of megablox's `kind` ("gmm" or "tgmm") for `m`
    routed rows per shard, (k, n) the other two dimensions and `groups` groups; None when a
    dimension is off the 128 lanes. Of the tilings whose blocks fit VMEM_BUDGET (`vmem_bytes`), the
    one with the least roofline time (`_seconds`: the straddling row tiles weigh against a large
    row tile, the blocks read again against small column tiles)."""
    if m % _LANES or k % _LANES or n % _LANES:
        return None
    options = [
        (tm, tk, tn)
        for tm in (t for t in ROW_TILES if m % t == 0)
        for tk in _col_tiles(k)
        for tn in _col_tiles(n)
        if vmem_bytes(kind, (tm, tk, tn), in_bytes, out_bytes) <= VMEM_BUDGET
    ]
    # the smallest tiles always fit: (128, 128, 128) takes well under 1 MiB
    return min(options, key=lambda t: (_seconds(kind, m, k, n, groups, t, in_bytes, out_bytes), -t[0], -t[1] * t[2]))


def unsupported_reason(lhs_shape, rhs_shape, lhs_dtype, rhs_dtype, shards: int = 1) -> str | None:
    """Why the megablox kernel cannot compute this `_grouped_mm` form (None: it can). The forms
    are (M, K) x (G, K, N) and (K, M) x (M, N); `shards` is the number of row shards."""
    if jnp.dtype(lhs_dtype) != jnp.bfloat16 or jnp.dtype(rhs_dtype) != jnp.bfloat16:
        return f"operands {jnp.dtype(lhs_dtype)} x {jnp.dtype(rhs_dtype)} (the kernels take bfloat16 x bfloat16)"
    if len(lhs_shape) == 2 and len(rhs_shape) == 3:
        (m, k), (_, _, n) = lhs_shape, rhs_shape
    elif len(lhs_shape) == 2 and len(rhs_shape) == 2:
        (k, m), (_, n) = lhs_shape, rhs_shape
    else:
        return f"a {len(lhs_shape)}-D x {len(rhs_shape)}-D form (the kernels take 2-D x 3-D and 2-D x 2-D)"
    if m % shards:
        return f"{m} routed rows do not split evenly over {shards} shards"
    if m // shards % _LANES or k % _LANES or n % _LANES:
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


_ROUTED_SHARE = contextvars.ContextVar("torchtpu_routed_share", default=1.0)


@contextlib.contextmanager
def routed_share(share: float):
    """While tracing inside this block, the grouped matmuls traced declare the work of `share` of
    their rows (`_visited_cost`): expert parallelism sizes each chip's buffer of received rows for
    the worst case, every rank's rows routed to it (`share` 1 / ranks: the rows it receives when
    routing is balanced); elsewhere every row is routed (1)."""
    token = _ROUTED_SHARE.set(float(share))
    try:
        yield
    finally:
        _ROUTED_SHARE.reset(token)


def _visited_cost(cost, group_metadata, m: int, out_shape, share: float):
    """What a megablox kernel of `m` rows does, for XLA's cost model, from the cost megablox declares
    (`cost`: 2 m k n FLOPs, as if each row tile ran once). The kernel runs one (tm, k) x (k, n)
    product per visit of a row tile, and visits a tile once per group it holds rows of
    (`_tile_visits` of `share` of the rows), at most the grid's m / tm + groups - 1 (`group_ids`'
    length; in a dropless MoE layer a boundary falls on a tile's edge about once in tm). FLOPs and bytes scale with the
    visits, but for tgmm's per-group (k, n) output, written once whatever the rows."""
    group_offsets, group_ids, _ = group_metadata
    groups = group_offsets.shape[0] - 1
    most = group_ids.shape[0]
    tm = m // (most - groups + 1)
    visits = min(most, _tile_visits(round(share * m), tm, groups))
    fixed = math.prod(out_shape.shape) * jnp.dtype(out_shape.dtype).itemsize if len(out_shape.shape) == 3 else 0
    moved = fixed + (cost.bytes_accessed - fixed) * visits // most
    return pl.CostEstimate(
        flops=2 * (cost.flops // (2 * m)) * visits * tm, transcendentals=cost.transcendentals, bytes_accessed=moved
    )


class _CostedPallas:
    """jax.experimental.pallas as megablox's kernels see it while traced here: the same, except
    that `pallas_call` declares the work its grid does (`_visited_cost`, with the routed share of
    `routed_share`) instead of 2 m k n FLOPs."""

    def __getattr__(self, name):
        return getattr(pl, name)

    @staticmethod
    def pallas_call(kernel, *args, cost_estimate=None, **kwargs):
        if cost_estimate is None:
            return pl.pallas_call(kernel, *args, **kwargs)
        share = _ROUTED_SHARE.get()

        def call(group_metadata, group_offset, lhs, *rest):
            cost = _visited_cost(cost_estimate, group_metadata, lhs.shape[0], kwargs["out_shape"], share)
            run = pl.pallas_call(kernel, *args, cost_estimate=cost, **kwargs)
            return run(group_metadata, group_offset, lhs, *rest)

        return call


@contextlib.contextmanager
def costable_kernels():
    """megablox's kernels as XLA's TPU cost model should see them while traced inside this block:
    tile bookkeeping counted with compares (`_CostableNumpy`) and the work of the tiles the grid
    visits declared (`_CostedPallas`)."""
    module = sys.modules["jax.experimental.pallas.ops.tpu.megablox.gmm"]
    saved = module.jnp, module.pl
    module.jnp, module.pl = _CostableNumpy(), _CostedPallas()
    try:
        yield
    finally:
        module.jnp, module.pl = saved


_STATIC = {
    "gmm": ("preferred_element_type", "tiling", "transpose_rhs", "interpret"),
    "tgmm": ("preferred_element_type", "tiling", "num_actual_groups", "interpret"),
}


@functools.cache
def _jitted(kind: str, share: float):
    """megablox's `kind` jitted once per routed share: the share is read while the kernel is traced,
    so one jit cache holding both shares would reuse the first one's declared cost."""
    return jax.jit((_gmm if kind == "gmm" else _tgmm).__wrapped__, static_argnames=_STATIC[kind])


def _megablox(kind: str):
    """megablox's `kind` ("gmm" or "tgmm") for the routed share in force."""
    return _jitted(kind, _ROUTED_SHARE.get())


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


def _out_bytes(dtype) -> int:
    return jnp.dtype(dtype).itemsize


_EVERY_ROW_GROUPED = contextvars.ContextVar("torchtpu_every_row_grouped", default=False)


@contextlib.contextmanager
def every_row_grouped():
    """While tracing inside this block, every `gmm` traced has all its rows in groups (the group
    ends reach M, as when each chip runs all the experts on its own rows: expert_parallel's dispatch
    without expert parallelism), so its output and input gradient need no pass zeroing the rows past
    the last group."""
    token = _EVERY_ROW_GROUPED.set(True)
    try:
        yield
    finally:
        _EVERY_ROW_GROUPED.reset(token)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _differentiable_gmm(x, w_t, sizes, out_dtype, interpret, masked, share):
    """megablox's `gmm` of x (M, K) and the weights w_t (G, N, K) in the layout torchtitan stores
    them (the kernel reads them transposed), rounded once to `out_dtype`, for JAX's own autodiff (a
    step that differentiates a program holding the experts with `jax.vjp`, as expert_parallel's
    dispatch does; PyTorch's autograd never reaches this rule). The gradients are the ones
    PyTorch's `_grouped_mm` backward computes: the input's by `gmm` against the stored weights, the
    weights' by `tgmm` in their stored layout, from the output gradient rounded to the operands'
    dtype; with `masked`, rows past the last group get zero. `share`: `routed_share`'s, for the
    kernels' declared costs (the backward is traced outside the forward's context)."""
    (m, k), (groups, n, _) = x.shape, w_t.shape
    tile = tiling(m, k, n, groups, "gmm", x.dtype.itemsize, _out_bytes(out_dtype))
    with jax.enable_x64(False), costable_kernels(), routed_share(share):
        return _megablox("gmm")(x, w_t, sizes, out_dtype, tile, transpose_rhs=True, interpret=interpret)


def _differentiable_gmm_fwd(x, w_t, sizes, out_dtype, interpret, masked, share):
    return _differentiable_gmm(x, w_t, sizes, out_dtype, interpret, masked, share), (x, w_t, sizes)


def _differentiable_gmm_bwd(out_dtype, interpret, masked, share, res, g):
    x, w_t, sizes = res
    g = g.astype(x.dtype)
    (m, k), (groups, n, _) = x.shape, w_t.shape
    b = x.dtype.itemsize
    with jax.enable_x64(False), costable_kernels(), routed_share(share):
        dx = _megablox("gmm")(g, w_t, sizes, x.dtype, tiling(m, n, k, groups, "gmm", b, b), interpret=interpret)
        # (N, M) x (M, K) -> (G, N, K): the weights' gradient in their own layout (tgmm takes its
        # first operand transposed, so g.T costs no copy)
        dw_t = _megablox("tgmm")(
            g.T,
            x,
            sizes,
            w_t.dtype,
            tiling(m, n, k, groups, "tgmm", b, _out_bytes(w_t.dtype)),
            num_actual_groups=groups,
            interpret=interpret,
        )
    if masked:
        dx = jnp.where(jnp.arange(m, dtype=jnp.int32)[:, None] < jnp.sum(sizes), dx, 0)
    return dx.astype(x.dtype), dw_t, None


_differentiable_gmm.defvjp(_differentiable_gmm_fwd, _differentiable_gmm_bwd)


def forward_gmm(x, w, ends, out_dtype):
    """(M, K) x (G, K, N) -> (M, N) in `out_dtype`: rows ends[g-1]:ends[g] times w[g]; rows past
    the last end are zero. `ends` int32 (G,). The kernel reads w transposed, (G, N, K): the layout
    of torchtitan's weights, whose transpose (what `w` is) XLA then cancels."""
    mesh = mesh_of(x, w)
    axes = _row_axes(mesh)
    shards = math.prod(dict(mesh.shape)[a] for a in axes) if axes else 1
    m_local = x.shape[0] // shards
    interpret = interpreting()
    rows = P(axes if len(axes) > 1 else axes[0]) if axes else P()
    masked = not _EVERY_ROW_GROUPED.get()
    share = _ROUTED_SHARE.get()

    def kernel(x, w_t, ends):
        start = _shard_start(axes, m_local)
        sizes = _local_sizes(ends, start, m_local)
        out = _differentiable_gmm(x, w_t, sizes, jnp.dtype(out_dtype), interpret, masked, share)  # Mosaic: 32-bit
        if masked:  # rows past the last group belong to no group: the kernel leaves them unwritten
            out = jnp.where(jnp.arange(m_local, dtype=jnp.int32)[:, None] < jnp.sum(sizes), out, 0)
        return out.astype(out_dtype)

    return _per_shard(kernel, mesh, axes, (rows, P(), P()), rows)(x, jnp.swapaxes(w, 1, 2), ends)


def stored_gmm(x, w, ends, out_dtype):
    """(M, K) x (G, K, N) -> (M, N) in `out_dtype` with `w` read as laid out, (G, K, N): megablox's
    `gmm` without transposing the weights, the product a backward takes with weights stored the way
    `forward_gmm` reads them transposed (an input's gradient through the experts). No gradient of its
    own (it runs inside backward rules). Rows past the last end are zero."""
    mesh = mesh_of(x, w)
    axes = _row_axes(mesh)
    shards = math.prod(dict(mesh.shape)[a] for a in axes) if axes else 1
    m_local = x.shape[0] // shards
    interpret = interpreting()
    rows = P(axes if len(axes) > 1 else axes[0]) if axes else P()
    masked = not _EVERY_ROW_GROUPED.get()
    (_, k), (groups, _, n) = x.shape, w.shape

    def kernel(x, w, ends):
        sizes = _local_sizes(ends, _shard_start(axes, m_local), m_local)
        tile = tiling(m_local, k, n, groups, "gmm", x.dtype.itemsize, _out_bytes(out_dtype))
        with jax.enable_x64(False), costable_kernels():
            out = _megablox("gmm")(x, w, sizes, jnp.dtype(out_dtype), tile, interpret=interpret)
        if masked:
            out = jnp.where(jnp.arange(m_local, dtype=jnp.int32)[:, None] < jnp.sum(sizes), out, 0)
        return out.astype(out_dtype)

    return _per_shard(kernel, mesh, axes, (rows, P(), P()), rows)(x, w, ends)


def weight_grad_tgmm(a, b, ends, out_dtype):
    """(K, M) x (M, N) -> (G, K, N) in `out_dtype`: the g-th product over columns/rows
    ends[g-1]:ends[g] of M only (the experts' weight gradients). `ends` int32 (G,). The kernel
    computes the transpose, (N, M) x (M, K) -> (G, N, K): the layout of torchtitan's weights, to
    which PyTorch's backward transposes this (XLA cancels the two)."""
    mesh = mesh_of(a, b)
    axes = _row_axes(mesh)
    shards = math.prod(dict(mesh.shape)[ax] for ax in axes) if axes else 1
    m = a.shape[1]
    m_local = m // shards
    groups = ends.shape[0]
    # per-shard partial sums are added in float32; one shard rounds once to out_dtype itself
    kernel_dtype = jnp.float32 if axes else jnp.dtype(out_dtype)
    tile = tiling(m_local, b.shape[1], a.shape[0], groups, "tgmm", a.dtype.itemsize, _out_bytes(kernel_dtype))
    interpret = interpreting()
    row_axis = (axes if len(axes) > 1 else axes[0]) if axes else None

    def kernel(bt, at, ends):
        start = _shard_start(axes, m_local)
        sizes = _local_sizes(ends, start, m_local)
        with jax.enable_x64(False), costable_kernels():
            out = _megablox("tgmm")(bt, at, sizes, kernel_dtype, tile, num_actual_groups=groups, interpret=interpret)
        if axes:
            out = jax.lax.psum(out, axes)
        return out.astype(out_dtype)

    out_t = _per_shard(kernel, mesh, axes, (P(None, row_axis), P(row_axis), P()), P())(b.T, a.T, ends)
    return jnp.swapaxes(out_t, 1, 2)


@functools.cache
def note_fallback(form: str, reason: str) -> None:
    """Log once per (form, reason) that a grouped matmul on TPU keeps jax.lax.ragged_dot."""
    log.warning("torchtpu _grouped_mm %s on TPU: no megablox kernel (%s); it runs as jax.lax.ragged_dot", form, reason)
