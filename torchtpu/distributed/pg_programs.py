"""The XLA programs of the "tpu" process group (process_group.py) and the `Work` its ops return.

A group's collective is a jitted `jax.shard_map` over a one-axis mesh (axis AXIS) with one device
per member; each device's block is its rank's tensor. One collective program runs at a time in a
process (`one_at_a_time`): XLA:CPU's cross-process collectives share one gloo communicator.
"""

from __future__ import annotations

import functools
from datetime import timedelta

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..backend import TpuTensor, array_of

AXIS = "r"


# ----------------------------------------------------------------------------- work


class Work(dist.Work):
    """The result of one op: its output arrays are already written into the tensors (they are
    futures); `wait()` blocks until they are computed."""

    def __init__(self, arrays=(), tensors=(), before=None):
        super().__init__()
        self._arrays = list(arrays)
        self._tensors = list(tensors)
        self._before = before  # run at wait(): pending point-to-point ops

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._before is not None:
            self._before()
            self._before = None
        jax.block_until_ready(self._arrays)
        return True

    def is_completed(self) -> bool:
        return self._before is None and all(a.is_ready() for a in self._arrays)

    def result(self):
        return self._tensors

    def get_future(self):
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(self._tensors)
        return fut


IN_FLIGHT: list = []  # the arrays of the last collective program of this process


def one_at_a_time():
    if IN_FLIGHT:
        jax.block_until_ready(IN_FLIGHT[:])
        IN_FLIGHT.clear()


# ----------------------------------------------------------------------------- programs


def local_array(t: torch.Tensor, device, flat: bool = False):
    """`t`'s values as an array on `device`, in `t`'s shape (a 0-d tensor as one element), or
    flat. Keeping the shape saves XLA two copies of the tensor (a reshape is one on the way in
    and one on the way out) in the elementwise collectives."""
    a = array_of(t) if isinstance(t, TpuTensor) else jnp.asarray(t.detach().cpu().numpy())
    if flat or a.ndim == 0:
        a = a.reshape(-1)
    return jax.device_put(a, device)


def local_flat_array(t: torch.Tensor, device):
    return local_array(t, device, flat=True)


def global_array(mesh: Mesh, local, n: int):
    """The array of the members' blocks stacked along dim 0 (n * local.shape[0], ...), whose block
    on this process's device is `local`."""
    sharding = NamedSharding(mesh, P(AXIS))
    shape = (n * local.shape[0], *local.shape[1:])
    return jax.make_array_from_single_device_arrays(shape, sharding, [local])


def shaped(out, shape):
    """`out` in `shape` (no copy when it already has it)."""
    return out if out.shape == tuple(shape) else out.reshape(shape)


def own_block(out):
    return out.addressable_shards[0].data


@functools.cache
def collective_program(mesh: Mesh, kind: str, static):
    """A jitted shard_map over `mesh` for one op; each device's block is its rank's tensor (flat,
    or in its shape for the elementwise ops and the all_gathers into a tensor)."""

    def body(x):
        if kind == "all_reduce":
            return _reduce(x, static)
        if kind == "broadcast":
            root = static
            keep = lax.axis_index(AXIS) == root
            if x.dtype == jnp.bool_:
                return lax.psum(jnp.where(keep, x, False).astype(jnp.int32), AXIS) > 0
            return lax.psum(jnp.where(keep, x, jnp.zeros_like(x)), AXIS)
        if kind == "all_gather":  # static: stack (a new dim 0) rather than concatenate
            return lax.all_gather(x, AXIS, tiled=not static)
        if kind == "reduce_scatter":
            op, n = static
            if op in ("sum", "avg"):
                out = lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)
                return out / n if op == "avg" else out
            full = _reduce(x, op)
            k = x.shape[0] // n
            return lax.dynamic_slice_in_dim(full, lax.axis_index(AXIS) * k, k)
        if kind == "all_to_all":
            return _all_to_all(x, *static)
        if kind == "p2p":
            return lax.ppermute(x, AXIS, [(0, 1)])
        raise AssertionError(kind)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))


def _reduce(x, op: str):
    if op == "sum":
        return lax.psum(x, AXIS)
    if op == "avg":
        return lax.psum(x, AXIS) / lax.axis_size(AXIS)
    if op == "max":
        return lax.pmax(x, AXIS)
    if op == "min":
        return lax.pmin(x, AXIS)
    every = lax.all_gather(x, AXIS)  # (n, size): the ops XLA has no collective for
    if op == "product":
        return jnp.prod(every, axis=0, dtype=x.dtype)
    fold = {"band": jnp.bitwise_and, "bor": jnp.bitwise_or, "bxor": jnp.bitwise_xor}[op]
    out = every[0]
    for i in range(1, every.shape[0]):
        out = fold(out, every[i])
    return out


def _all_to_all(x, inner: int, sends: tuple, receives: tuple, pad: int):
    """Uneven all_to_all: every block padded to `pad` rows of `inner` elements, exchanged, unpadded.
    sends[r][j]: rows rank r sends to rank j; receives: this op's table for all ranks."""
    n = len(sends)
    me = lax.axis_index(AXIS)
    # Build this rank's padded (n, pad, inner) send buffer with a gather whose indices depend on
    # the rank (a table indexed by axis_index), so the program is the same on every rank.
    idx = np.zeros((n, n, pad), np.int32)
    valid = np.zeros((n, n, pad), bool)
    for r in range(n):
        start = 0
        for j in range(n):
            k = sends[r][j]
            idx[r, j, :k] = np.arange(start, start + k)
            valid[r, j, :k] = True
            start += k
    rows = x.reshape(-1, inner)
    my_idx = jnp.asarray(idx)[me]
    my_valid = jnp.asarray(valid)[me]
    buf = jnp.where(my_valid[..., None], rows[my_idx], jnp.zeros((), x.dtype))
    got = lax.all_to_all(buf, AXIS, 0, 0, tiled=True)  # (n, pad, inner): block j from rank j
    total = max(sum(row) for row in receives)
    out_idx = np.zeros((n, total), np.int32)
    for r in range(n):
        pos = [j * pad + i for j in range(n) for i in range(receives[r][j])]
        out_idx[r, : len(pos)] = pos
    flat = got.reshape(n * pad, inner)[jnp.asarray(out_idx)[me]]
    return flat.reshape(-1)


@functools.cache
def pair_mesh(a, b) -> Mesh:
    return Mesh(np.array([a, b]), (AXIS,))
