"""Distributed tpu tensors: `distribute_tensor` and the DTensor-style methods of tpu tensors.

A distributed tensor here is an ordinary tpu tensor whose `jax.Array` is laid out over the
mesh by a `NamedSharding`. It has the *global* shape, and every op on it is an op on the
global value: XLA partitions each program and inserts the collectives. So there is no
separate DTensor type to convert to and from, and model code written for one device runs
unchanged. The DTensor API is still there on tpu tensors:

- `t.placements`, `t.device_mesh`: read from the array's sharding (the mesh and placements
  given to `distribute_tensor`/`redistribute` when the sharding still matches them).
- `t.redistribute(mesh, placements)`: a new tensor laid out the new way (differentiable).
- `t.full_tensor()`: the same values replicated on every device (differentiable).
- `t.to_local()`: in single-program SPMD the program is written against the global tensor,
  so `to_local()` returns the tensor itself. The per-device pieces are available as CPU
  tensors through `torchtpu.distributed.local_shards(t)`.

The sharding constraint op `torchtpu::shard(x, spec, grad_spec)` is how a layout is requested
inside a program: in eager mode it moves the array, under `torchtpu.compile` and
`torch.compile` it becomes `jax.lax.with_sharding_constraint`. Its backward constrains the
gradient to `grad_spec` (the layout the input had), as DTensor's redistribute does.
"""

from __future__ import annotations

import jax
import torch
from jax import lax
from jax.sharding import PartitionSpec as P
from torch.distributed.tensor import Partial, Replicate, Shard

from ..backend import Layout, TpuTensor, array_of, lower, new_base, post, register_dtensor_methods, reshard, storage_of
from . import placements as pl
from .mesh import DeviceMesh, current_mesh

__all__ = ["distribute_tensor", "local_shards", "shard_as"]

_lib = torch.library.Library("torchtpu", "FRAGMENT")
_lib.define("shard(Tensor x, str spec, str grad_spec) -> Tensor")
_lib.impl("shard", lambda x, spec, grad_spec: x.clone(), "CompositeExplicitAutograd")


@torch.library.register_fake("torchtpu::shard")
def _shard_fake(x, spec, grad_spec):
    return torch.empty_like(x)


def _shard_backward(ctx, g):
    if ctx.grad_spec and g is not None:
        return torch.ops.torchtpu.shard(g, ctx.grad_spec, ""), None, None
    return g, None, None


def _shard_setup(ctx, inputs, output):
    ctx.grad_spec = inputs[2]


torch.library.register_autograd("torchtpu::shard", _shard_backward, setup_context=_shard_setup)


@lower(torch.ops.torchtpu.shard.default)
def _shard_lowering(x, spec, grad_spec):
    return lax.with_sharding_constraint(x, pl.decode(spec))


@post(torch.ops.torchtpu.shard.default)
def _shard_post(args, out):
    # The result records its layout (also while tracing), so state made from it, such as a
    # gradient accumulated into .grad, keeps the layout in ahead-of-time programs.
    if isinstance(out, TpuTensor) and storage_of(out).dist is None:
        sharding = pl.decode(args[1])
        if all(e is not P.UNCONSTRAINED for e in sharding.spec):
            storage_of(out).dist = Layout(None, None, sharding)
    return out


def shard_as(
    t: torch.Tensor, mesh: DeviceMesh, placements, *, grad_placements=None, unconstrained=(), batch_axes=()
) -> torch.Tensor:
    """`t` laid out on `mesh` by `placements` (a sharding constraint inside programs).

    The gradient is laid out by `grad_placements` (default: no constraint). `batch_axes`: global
    mesh axes that split dim 0 when no placement does and it divides evenly (the batch of an
    activation, over the data-parallel axes)."""
    ndim = t.dim()

    def make(pls):
        spec = pl.spec_for(mesh, pls, ndim, unconstrained=unconstrained)
        entry = pl.batch_entry(mesh.jax_mesh, batch_axes, t.shape[0]) if ndim else None
        if entry is not None and spec[0] in (None, P.UNCONSTRAINED):
            spec = P(entry, *tuple(spec)[1:])
        return pl.encode(mesh, spec)

    spec = make(placements)
    gspec = ""
    if grad_placements is not None:
        gspec = make(_grad_placements(grad_placements))
    out = torch.ops.torchtpu.shard(t, spec, gspec)
    _remember(out, mesh, placements)
    return out


def _grad_placements(placements):
    # A Partial forward value has a replicated gradient (as in DTensor).
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _remember(t, mesh, placements):
    if isinstance(t, TpuTensor) and not t._vw:
        storage_of(t).dist = Layout(mesh, tuple(placements), pl.sharding_for(mesh, placements, t.dim()))


# ----------------------------------------------------------------------------- distribute_tensor


def distribute_tensor(
    tensor: torch.Tensor, device_mesh: DeviceMesh | None = None, placements=None, *, src_data_rank: int | None = 0
) -> torch.Tensor:
    """Lay `tensor` out over `device_mesh` (torch's `distribute_tensor`).

    A CPU tensor goes straight from host memory to its shards; a tpu tensor is resharded.
    Returns a leaf tpu tensor (requires_grad as the input) whose array has the sharding.
    """
    mesh = device_mesh or current_mesh()
    if mesh is None:
        raise RuntimeError("distribute_tensor needs a device mesh: call torchtpu.distributed.init_device_mesh first")
    if placements is None:
        placements = (Replicate(),) * mesh.ndim
    placements = tuple(placements)
    sharding = pl.sharding_for(mesh, placements, tensor.dim())
    _check_divisible(tensor.shape, mesh, placements)
    if isinstance(tensor, TpuTensor):
        src = array_of(tensor.detach())
    else:
        from ..backend import dtypes

        src = dtypes.torch_to_numpy(tensor.detach().contiguous()).copy()
    arr = reshard(src, sharding)
    out = new_base(arr, 0, tensor.dtype)
    _remember(out, mesh, placements)
    if tensor.requires_grad:
        out.requires_grad_(True)
    return out


def _check_divisible(shape, mesh, placements):
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim % len(shape) if shape else 0
            n = mesh.size(i)
            if shape and shape[d] % n:
                raise ValueError(
                    f"cannot Shard({p.dim}) a tensor of shape {tuple(shape)} over mesh dim "
                    f"{mesh.mesh_dim_names[i]!r} of size {n}: {shape[d]} is not divisible by {n}; "
                    "pad the dimension or choose another degree"
                )


def local_shards(t: torch.Tensor) -> list[tuple[jax.Device, torch.Tensor]]:
    """The pieces of `t` held by this process's devices, as (device, CPU tensor) pairs."""
    import numpy as np

    a = array_of(t)
    return [(s.device, torch.from_numpy(np.asarray(s.data).copy())) for s in a.addressable_shards]


# ----------------------------------------------------------------------------- DTensor methods


def _dist_info(t):
    a = array_of(t)
    sharding = getattr(a, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise AttributeError("this tpu tensor is not distributed over a device mesh (use distribute_tensor)")
    info = getattr(storage_of(t), "dist", None)
    if info is not None and info.mesh is not None and not t._vw:
        mesh, placements = info.mesh, info.placements
        spec = pl.spec_for(mesh, placements, t.dim())
        if _same_layout(sharding, pl.NamedSharding(mesh.jax_mesh, spec), t.dim()):
            return mesh, placements
    mesh = _mesh_view(sharding.mesh)
    return mesh, pl.placements_for(sharding, t.dim(), mesh)


def _same_layout(a, b, ndim) -> bool:
    try:
        return a.is_equivalent_to(b, ndim)
    except Exception:
        return False


_VIEWS: dict = {}


def _mesh_view(jax_mesh) -> DeviceMesh:
    cur = current_mesh()
    if cur is not None and cur.jax_mesh == jax_mesh:
        return cur
    m = _VIEWS.get(id(jax_mesh))
    if m is None or m.jax_mesh is not jax_mesh:
        names = tuple(jax_mesh.axis_names)
        m = _VIEWS[id(jax_mesh)] = DeviceMesh(jax_mesh, [(n,) for n in names], names)
    return m


def _placements(self):
    return _dist_info(self)[1]


def _device_mesh(self):
    return _dist_info(self)[0]


def _redistribute(self, device_mesh=None, placements=None, *, async_op=False, forward_dtype=None, backward_dtype=None):
    mesh, cur = _dist_info(self)
    target = device_mesh or mesh
    if placements is None:
        placements = cur
    placements = tuple(placements)
    for i, p in enumerate(placements):
        if isinstance(p, Partial) and not (target == mesh and isinstance(cur[i], Partial)):
            raise RuntimeError(
                "redistributing to Partial is not supported (as in DTensor): Partial comes from computation"
            )
    x = self if forward_dtype is None else self.to(forward_dtype)
    _check_divisible(self.shape, target, placements)
    return shard_as(x, target, placements, grad_placements=cur if target == mesh else None)


def _full_tensor(self, *, grad_placements=None):
    mesh, cur = _dist_info(self)
    return shard_as(self, mesh, (Replicate(),) * mesh.ndim, grad_placements=grad_placements or cur)


def _to_local(self, *, grad_placements=None):
    return self


register_dtensor_methods(
    placements=_placements,
    device_mesh=_device_mesh,
    redistribute=_redistribute,
    full_tensor=_full_tensor,
    to_local=_to_local,
)
