"""A lookup in an embedding table whose rows FSDP splits, without gathering the table.

Left to itself, XLA computes `table[ids]` for a table split by rows over the data-parallel axes
by gathering the whole table on every chip, and its gradient as a whole-table scatter on every
chip followed by a reduce-scatter: per chip a full [vocab, dim] copy in bf16 and its gradient in
fp32 (2 GiB each for Llama 3 8B's 128256 x 4096 table).

The split lookup moves the token ids instead, which are far fewer when a data-parallel group's
tokens number fewer than the table's rows:

    forward   all-gather the ids over the axes that split both the batch and the rows; each chip
              looks up the rows it holds (zeros elsewhere); a reduce-scatter over the same axes
              returns each chip its own tokens' rows (a sum with one nonzero term: exact)
    backward  all-gather the ids and the output gradient; each chip adds the gradients of the
              tokens whose rows it holds into its own [rows / n, dim] block, in float32

Row axes that do not split the batch (tensor parallelism's, with the ids replicated over them)
are summed over instead of gathered.

When a gather group's tokens outnumber the table's rows, the table is the smaller transfer, but
XLA left to itself gathers it over every row axis, TP's too: the whole [vocab, dim] table on each
chip and its whole gradient in fp32 (4 and 8 GiB per chip for Llama 3.1 405B's table). So where
some row axes do not split the batch, the op's table mode gathers the table over the axes that do
split it only (whether they split its rows or its columns: FSDP splits the columns when the rows
left by TP do not divide), looks up the rows the chip then holds and sums over the others; its
backward adds the chip's own tokens' gradients into that gathered block and reduce-scatters it
back.

`fully_shard` installs it on the `nn.Embedding` modules it manages (`install`); anything it does
not cover (max_norm, scale_grad_by_freq, sparse, layouts it cannot map, more gathered tokens than
rows with every row axis splitting the batch) runs `nn.Embedding`'s own forward.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from jax import lax
from jax.sharding import PartitionSpec as P
from torch import nn
from torch.nn import functional as F

from ..backend import lower
from . import placements as pl
from .params import get_layout

__all__ = ["install"]

_lib = torch.library.Library("torchtpu", "FRAGMENT")
_lib.define(
    "split_embedding(Tensor weight, Tensor ids, str weight_spec, str ids_spec, int padding_idx, bool gather_table) "
    "-> Tensor"
)
_lib.define(
    "split_embedding_backward(Tensor grad, Tensor ids, str weight_spec, str ids_spec, int padding_idx, "
    "bool gather_table, SymInt rows) -> Tensor"
)
# Off tpu (CPU, meta) the ops are the plain lookup and PyTorch's own gradient of it.
_lib.impl(
    "split_embedding",
    lambda weight, ids, weight_spec, ids_spec, padding_idx, gather_table: F.embedding(ids, weight),
    "CompositeExplicitAutograd",
)
_lib.impl(
    "split_embedding_backward",
    lambda grad, ids, weight_spec, ids_spec, padding_idx, gather_table, rows: torch.ops.aten.embedding_dense_backward(
        grad, ids, rows, padding_idx, False
    ),
    "CompositeExplicitAutograd",
)


@torch.library.register_fake("torchtpu::split_embedding")
def _lookup_fake(weight, ids, weight_spec, ids_spec, padding_idx, gather_table):
    return weight.new_empty((*ids.shape, weight.shape[1]))


@torch.library.register_fake("torchtpu::split_embedding_backward")
def _grad_fake(grad, ids, weight_spec, ids_spec, padding_idx, gather_table, rows):
    return grad.new_empty((rows, grad.shape[-1]))


def _setup(ctx, inputs, output):
    weight, ids, weight_spec, ids_spec, padding_idx, gather_table = inputs
    ctx.save_for_backward(ids)
    ctx.args = (weight_spec, ids_spec, padding_idx, gather_table, weight.shape[0])


def _backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    return torch.ops.torchtpu.split_embedding_backward(grad, ids, *ctx.args), None, None, None, None, None


torch.library.register_autograd("torchtpu::split_embedding", _backward, setup_context=_setup)


# ----------------------------------------------------------------------------- lowerings


def _plan(weight_spec: str, ids_spec: str):
    """(mesh, weight spec, ids spec, output spec, row axes, gathered axes, summed axes, batch-only
    axes): the row axes that also split the batch are gathered over, the other row axes summed
    over in the forward; the gradient is summed over the batch axes that do not split the rows
    (HSDP's replicas: each holds the whole table's gradient for its own tokens)."""
    w, i = pl.decode(weight_spec), pl.decode(ids_spec)
    rows = pl.entry_axes(w.spec[0])
    id_axes = [a for e in i.spec for a in pl.entry_axes(e)]
    gathered = tuple(a for a in id_axes if a in rows)
    summed = tuple(a for a in rows if a not in id_axes)
    batch_only = tuple(a for a in id_axes if a not in rows)
    out = P(*i.spec, w.spec[1] if len(w.spec) > 1 else None)
    return w.mesh, w.spec, i.spec, out, rows, gathered, summed, batch_only


def _held_rows(ids, total: int, block: int, row_axes, gathered, summed):
    """(position of each id in the rows this chip holds, whether it holds that id's row), inside
    shard_map. The table's rows are split into blocks of `block` over `row_axes` (the first axis
    major); the chip holds its own block gathered over the `gathered` axes (in row_axes order,
    none in the ids mode), that is the blocks whose indices along the `summed` axes are its own."""
    ids = jnp.clip(ids, 0, total - 1)  # out-of-range ids: as torchtpu's plain lookup (clamped)
    b, r = ids // block, ids % block
    index = {}
    for a in reversed(row_axes):
        index[a] = b % lax.axis_size(a)
        b = b // lax.axis_size(a)
    mine = jnp.ones(ids.shape, bool)
    for a in summed:
        mine = mine & (index[a] == lax.axis_index(a))
    g = jnp.zeros_like(ids)
    for a in gathered:
        g = g * lax.axis_size(a) + index[a]
    return g * block + r, mine


def _table_plan(w_spec, i_spec, rows, gathered, batch_only):
    """For the table mode, from `_plan`'s axes: (row axes the table is gathered over, in row order;
    column axes it is gathered over; the lookup's output spec; batch axes that split neither rows
    nor columns)."""
    cols = pl.entry_axes(w_spec[1]) if len(w_spec) > 1 else ()
    by_rows = tuple(a for a in rows if a in gathered)
    by_cols = tuple(a for a in cols if a in batch_only)
    kept = tuple(a for a in cols if a not in by_cols)
    out = P(*i_spec, (kept[0] if len(kept) == 1 else kept) if kept else None)
    return by_rows, by_cols, out, tuple(a for a in batch_only if a not in cols)


@lower(torch.ops.torchtpu.split_embedding.default)
def _lookup(weight, ids, weight_spec, ids_spec, padding_idx, gather_table):
    mesh, w_spec, i_spec, out_spec, rows, gathered, summed, batch_only = _plan(weight_spec, ids_spec)
    total = weight.shape[0]
    if gather_table:
        by_rows, by_cols, out_spec, _ = _table_plan(w_spec, i_spec, rows, gathered, batch_only)

    def local(w, i):
        block = w.shape[0]
        if gather_table:
            if by_rows:
                w = lax.all_gather(w, by_rows, axis=0, tiled=True)
            if by_cols:
                w = lax.all_gather(w, by_cols, axis=1, tiled=True)
            at, mine = _held_rows(i, total, block, rows, by_rows, summed)
        else:
            if gathered:
                i = lax.all_gather(i, gathered, axis=0, tiled=True)
            at, mine = _held_rows(i, total, block, rows, (), rows)
        out = jnp.take(w, jnp.where(mine, at, 0), axis=0)
        out = jnp.where(mine[..., None], out, jnp.zeros((), out.dtype))
        if gathered and not gather_table:
            out = lax.psum_scatter(out, gathered, scatter_dimension=0, tiled=True)
        if summed:
            out = lax.psum(out, summed)
        return out

    return jax.shard_map(local, mesh=mesh, in_specs=(w_spec, i_spec), out_specs=out_spec, check_vma=False)(weight, ids)


@lower(torch.ops.torchtpu.split_embedding_backward.default)
def _lookup_backward(grad, ids, weight_spec, ids_spec, padding_idx, gather_table, rows):
    mesh, w_spec, i_spec, out_spec, row_axes, gathered, summed, batch_only = _plan(weight_spec, ids_spec)
    block = rows // math.prod(mesh.shape[a] for a in row_axes)
    compute = jnp.float32 if grad.dtype in (jnp.bfloat16, jnp.float16) else grad.dtype
    if gather_table:
        by_rows, by_cols, out_spec, batch_only = _table_plan(w_spec, i_spec, row_axes, gathered, batch_only)

    def local(g, i):
        if gather_table:
            # this chip's tokens into the table as the forward gathered it (over the axes that
            # split the batch), then each chip keeps the sum of its own block: the transpose of
            # the forward's gathers
            span = block * math.prod(lax.axis_size(a) for a in by_rows)
            at, mine = _held_rows(i, rows, block, row_axes, by_rows, summed)
        else:
            if gathered:
                i = lax.all_gather(i, gathered, axis=0, tiled=True)
                g = lax.all_gather(g, gathered, axis=0, tiled=True)
            span = block
            at, mine = _held_rows(i, rows, block, row_axes, (), row_axes)
        if padding_idx >= 0:
            mine = mine & (i != padding_idx)
        at = jnp.where(mine, at, span).reshape(-1)  # not this chip's rows: dropped
        g = g.reshape(at.shape[0], g.shape[-1]).astype(compute)
        out = jnp.zeros((span, g.shape[-1]), compute).at[at].add(g, mode="drop")
        if gather_table and by_rows:
            out = lax.psum_scatter(out, by_rows, scatter_dimension=0, tiled=True)
        if gather_table and by_cols:
            out = lax.psum_scatter(out, by_cols, scatter_dimension=1, tiled=True)
        if batch_only:
            out = lax.psum(out, batch_only)
        return out.astype(grad.dtype)

    return jax.shard_map(local, mesh=mesh, in_specs=(out_spec, i_spec), out_specs=w_spec, check_vma=False)(grad, ids)


# ----------------------------------------------------------------------------- the module


class _SplitLookup:
    """`module.forward`: the split lookup where it applies, nn.Embedding's own elsewhere. A
    class, not a closure, so that a deepcopy of the module looks up in the copy's table."""

    def __init__(self, module: nn.Embedding, data_axes: tuple[str, ...]):
        self.module = module
        self.data_axes = data_axes

    def __call__(self, ids):
        module = self.module
        weight = module.weight
        rec = get_layout(module, "weight")
        if (
            module.max_norm is not None
            or module.scale_grad_by_freq
            or module.sparse
            or not isinstance(ids, torch.Tensor)
            or ids.device.type != "tpu"
            or ids.dim() < 1
            or weight.dim() != 2
            or rec is None
            or rec.mesh is None
        ):
            return nn.Embedding.forward(module, ids)
        jax_mesh = rec.mesh.jax_mesh
        rows = tuple(rec.dims[0])
        entry = pl.batch_entry(jax_mesh, self.data_axes, ids.shape[0])
        batch = pl.entry_axes(entry)
        gathered = [a for a in batch if a in rows]
        summed = [a for a in rows if a not in batch]
        # Moving the ids is worth it when a gather group's ids are fewer than the table's rows
        # (and mappable when no axis splits both the batch and the embedding dim); otherwise the
        # table is gathered, but only over the axes that split the batch, rows or columns: over
        # the others (TP's rowwise vocabulary split) each chip keeps its own rows and the lookups
        # are summed, where XLA left to itself gathers the whole table (and adds its whole
        # gradient in fp32).
        tokens = ids.numel() // math.prod(jax_mesh.shape[a] for a in batch if a not in gathered)
        if gathered and tokens < weight.shape[0] and not set(batch) & set(rec.dims[1]):
            gather_table = False
        elif summed:
            gather_table = True
        else:
            return nn.Embedding.forward(module, ids)
        w_spec = pl.encode(rec.mesh, rec.spec)
        i_spec = pl.encode(rec.mesh, P(entry, *([None] * (ids.dim() - 1))))
        pad = -1 if module.padding_idx is None else module.padding_idx
        return torch.ops.torchtpu.split_embedding(weight, ids, w_spec, i_spec, pad, gather_table)


def install(module: nn.Embedding, data_axes: tuple[str, ...]) -> None:
    """Make `module` (an nn.Embedding whose weight FSDP manages) look up rows with the split
    lookup when its table's rows are split over some of `data_axes` (the axes that split the
    batch). An instance attribute, so `state_dict`, hooks and the class are unchanged. Subclasses
    with a forward of their own (a scaled embedding, say) keep it."""
    if type(module).forward is not nn.Embedding.forward or isinstance(module.__dict__.get("forward"), _SplitLookup):
        return
    module.forward = _SplitLookup(module, tuple(data_axes))
