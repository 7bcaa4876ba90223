"""Placements <-> shardings, in one place.

PyTorch describes a distributed tensor by one placement per mesh dimension: `Shard(d)` splits
tensor dim d over that mesh dimension, `Replicate()` copies it, `Partial()` holds addends of a
pending sum. JAX describes it by a `PartitionSpec`: for each tensor dim, the mesh axes it is
split over. The mapping:

    mesh dims (dp, tp), placements (Shard(0), Shard(1))  ->  P("dp", "tp")
    mesh dims (dp, tp), placements (Shard(0), Shard(0))  ->  P(("dp", "tp"), None)
    flattened dim "dp" = (dp_replicate, dp_shard), Shard(0)  ->  P(("dp_replicate", "dp_shard"))
    Replicate() / Partial()                              ->  the axis appears nowhere

Several mesh dims sharding the same tensor dim split it in mesh-dim order (the first one is
the outer split), as DTensor does. In single-program SPMD an array always holds the global
value, so a `Partial` placement is bookkeeping: the value is already the reduced one and XLA
places the reduction inside the program.

Sharding constraints inside programs go through one op, `torchtpu::shard`, whose spec is a
string (so it can be part of a cache key): "<mesh id>:<entry>;<entry>;..." where an entry is
"" (not split), "?" (left to XLA) or axis names joined by "+".
"""

from __future__ import annotations

import math

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from .mesh import DeviceMesh

__all__ = [
    "spec_for",
    "placements_for",
    "sharding_for",
    "encode",
    "decode",
    "batch_entry",
    "Shard",
    "Replicate",
    "Partial",
]


def _norm_dim(d: int, ndim: int, what) -> int:
    if not -max(ndim, 1) <= d < max(ndim, 1):
        raise ValueError(f"{what}: Shard({d}) is out of range for a {ndim}-D tensor")
    return d % ndim if ndim else 0


def spec_for(mesh: DeviceMesh, placements, ndim: int, *, unconstrained=()) -> P:
    """PartitionSpec of a tensor with `ndim` dims placed on `mesh` by `placements`.

    Tensor dims in `unconstrained` that no placement shards are left to XLA (P.UNCONSTRAINED).
    """
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"{len(placements)} placements {placements} for a {mesh.ndim}-D mesh {mesh.mesh_dim_names}: "
            "give one placement per mesh dimension"
        )
    entries: list[list[str]] = [[] for _ in range(ndim)]
    for axes, p in zip(mesh.dims, placements):
        if isinstance(p, Shard):
            entries[_norm_dim(p.dim, ndim, "placements")].extend(axes)
        elif not isinstance(p, (Replicate, Partial)):
            raise TypeError(f"unsupported placement {p!r}: use Shard(dim), Replicate() or Partial()")
    out = []
    for i, e in enumerate(entries):
        if e:
            out.append(e[0] if len(e) == 1 else tuple(e))
        elif i in unconstrained:
            out.append(P.UNCONSTRAINED)
        else:
            out.append(None)
    return P(*out)


def sharding_for(mesh: DeviceMesh, placements, ndim: int) -> NamedSharding:
    return NamedSharding(mesh.jax_mesh, spec_for(mesh, placements, ndim))


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry names (none for None or UNCONSTRAINED)."""
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def placements_for(sharding, ndim: int, mesh: DeviceMesh) -> tuple[Placement, ...]:
    """The placements on `mesh` that describe an array laid out by `sharding`."""
    spec = tuple(getattr(sharding, "spec", ())) if isinstance(sharding, NamedSharding) else ()
    spec = spec + (None,) * (ndim - len(spec))
    out = []
    for axes in mesh.dims:
        found = None
        for d, entry in enumerate(spec):
            e = entry_axes(entry)
            for k in range(len(e) - len(axes) + 1):
                if e[k : k + len(axes)] == axes:
                    found = d
                    break
            if found is not None:
                break
        out.append(Shard(found) if found is not None else Replicate())
    return tuple(out)


# -- spec strings for the torchtpu::shard op

_MESHES: list = []


def _mesh_id(jax_mesh) -> int:
    for i, m in enumerate(_MESHES):
        if m is jax_mesh or m == jax_mesh:
            return i
    _MESHES.append(jax_mesh)
    return len(_MESHES) - 1


def encode(mesh: DeviceMesh, spec: P) -> str:
    entries = []
    for e in spec:
        if e is P.UNCONSTRAINED:
            entries.append("?")
        else:
            entries.append("+".join(entry_axes(e)))
    return f"{_mesh_id(mesh.jax_mesh)}:" + ";".join(entries)


_DECODED: dict = {}


def decode(s: str) -> NamedSharding:
    hit = _DECODED.get(s)
    if hit is not None:
        return hit
    mesh_id, _, body = s.partition(":")
    entries = []
    for e in body.split(";") if body else []:
        if e == "?":
            entries.append(P.UNCONSTRAINED)
        elif not e:
            entries.append(None)
        else:
            axes = tuple(e.split("+"))
            entries.append(axes[0] if len(axes) == 1 else axes)
    out = _DECODED[s] = NamedSharding(_MESHES[int(mesh_id)], P(*entries))
    return out


def batch_entry(jax_mesh, axes: tuple[str, ...], size: int):
    """The PartitionSpec entry that splits a batch dim of `size` over `axes` (one name, or a
    tuple of them); None when there are no axes or `size` does not divide evenly."""
    if not axes or size % math.prod(jax_mesh.shape[a] for a in axes):
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)
