"""Where a batch lives: dim 0 of the token arrays and of the activations, split over the
data-parallel axes of the mesh. The trainer's input placement, FSDP's pin on a module's input
and its linear outputs, and tensor parallelism's activation constraints all read these rules.

    tokens = place_batch(host_rows, mesh)                     # (batch, seq) over dp_replicate x dp_shard
    pin = batch_pinner(dp_mesh); h = pin(h)                   # a sharding constraint inside programs
    spec = P(placements.batch_entry(mesh.jax_mesh, axes, h.shape[0]), ...)    # (placements.py)
"""

from __future__ import annotations

import torch
from jax.sharding import PartitionSpec as P
from torch.distributed.tensor import Replicate, Shard

from . import placements as pl
from .mesh import JOB_MESH_DIMS, DeviceMesh

__all__ = [
    "DATA_PARALLEL_DIMS",
    "batch_placements",
    "host_rows",
    "place_batch",
    "activation_batch_axes",
    "data_parallel_axes",
    "batch_pinner",
]

# The job mesh's dims that split the batch (HSDP: replicas x shards).
DATA_PARALLEL_DIMS = JOB_MESH_DIMS[:2]


def batch_placements(mesh: DeviceMesh) -> tuple:
    """How a (batch, ...) token array is laid out on `mesh`: Shard(0) over its data-parallel
    dims, replicated over the others."""
    return tuple(Shard(0) if n in DATA_PARALLEL_DIMS else Replicate() for n in mesh.mesh_dim_names)


def host_rows(mesh: DeviceMesh, global_rows: int, seq_len: int) -> tuple[int, ...]:
    """The rows of a (global_rows, seq_len) batch laid out by `batch_placements(mesh)` that this
    process's devices hold, in order (all of them with one process)."""
    import jax

    if jax.process_count() == 1:
        return tuple(range(global_rows))
    sharding = pl.sharding_for(mesh, batch_placements(mesh), 2)
    rows = set()
    for index in sharding.addressable_devices_indices_map((global_rows, seq_len)).values():
        rows.update(range(*index[0].indices(global_rows)))
    return tuple(sorted(rows))


def place_batch(x, mesh: DeviceMesh, global_rows: int | None = None) -> torch.Tensor:
    """A host numpy (rows, ...) batch -> a tpu tensor laid out by `batch_placements(mesh)`.

    With one process `x` is the whole batch. With several, `x` holds this process's rows of a
    batch of `global_rows`, in `host_rows` order; they need not be contiguous, and under tensor
    parallelism two processes may hold the same rows."""
    import jax

    placements = batch_placements(mesh)
    if jax.process_count() == 1:
        from .dtensor import distribute_tensor

        return distribute_tensor(torch.from_numpy(x), mesh, placements)
    from ..backend.transfer import from_jax

    if global_rows is None:
        raise ValueError("place_batch: with several processes, pass global_rows (the batch's size over all of them)")
    sharding = pl.sharding_for(mesh, placements, x.ndim)
    shape = (global_rows, *x.shape[1:])
    where = {r: i for i, r in enumerate(host_rows(mesh, global_rows, x.shape[1]))}
    if len(where) != x.shape[0]:
        raise ValueError(f"place_batch: this process holds {len(where)} rows of the batch, not {x.shape[0]}")

    def block(index):  # a device's slice of the global batch, from the rows this process read
        return x[[where[r] for r in range(*index[0].indices(global_rows))]][(slice(None), *index[1:])]

    return from_jax(jax.make_array_from_callback(shape, sharding, block))


def data_parallel_axes(mesh: DeviceMesh) -> tuple[str, ...]:
    """The JAX axes of the job mesh's data-parallel dims, outermost first (under expert
    parallelism the dp_shard dim spans two axes, efsdp and ep: mesh.split_dim)."""
    root = mesh.root()
    return tuple(a for n, d in zip(root.mesh_dim_names, root.dims) if n in DATA_PARALLEL_DIMS for a in d)


def activation_batch_axes(mesh: DeviceMesh) -> tuple[str, ...]:
    """The data-parallel axes of the job's mesh (its axes named dp*, and those of its data-parallel
    dims) outside `mesh` (a tensor-parallel sub-mesh): they split the batch dim that a layout on
    `mesh` leaves free."""
    mine = {a for d in mesh.dims for a in d}
    dp = set(data_parallel_axes(mesh))
    return tuple(a for a in mesh.root().jax_mesh.axis_names if (a.startswith("dp") or a in dp) and a not in mine)


def batch_pinner(mesh: DeviceMesh):
    """x -> x with its batch dim (0) constrained to all of `mesh`'s axes (a data-parallel mesh),
    its other dims left to XLA. Tensors not on tpu, of fewer than 2 dims, or whose batch does
    not divide evenly pass through."""
    axes = tuple(a for d in mesh.dims for a in d)
    specs: dict[int, str] = {}

    def pin_batch(x):
        if not (isinstance(x, torch.Tensor) and x.device.type == "tpu" and x.dim() >= 2):
            return x
        entry = pl.batch_entry(mesh.jax_mesh, axes, x.shape[0])
        if entry is None:
            return x
        s = specs.get(x.dim())
        if s is None:
            s = specs[x.dim()] = pl.encode(mesh, P(entry, *([P.UNCONSTRAINED] * (x.dim() - 1))))
        return torch.ops.torchtpu.shard(x, s, s)

    return pin_batch
