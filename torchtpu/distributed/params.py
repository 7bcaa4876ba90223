"""Parameter layouts: what tensor parallelism and FSDP decide for each parameter.

A layout is, per tensor dim, the list of global mesh axes that dim is split over. Tensor
parallelism writes it first (e.g. a colwise weight: dim 0 over "tp"), FSDP then adds its
data-parallel axes (dim 0 over "tp" then "dp_shard"). The layout lives on the module that owns
the parameter (`module_record(module).layouts[name]`), so it survives `to_empty()`, and is applied:

- to a tpu parameter: its array is resharded in place (same Parameter object);
- to a CPU parameter: it becomes a tpu Parameter sharded straight from host memory;
- to a `meta` parameter: nothing yet. `materialize(model)` later makes every parameter and
  buffer a tpu tensor whose storage is created directly in its sharded layout, so no device
  (and no host) ever holds a whole model; `init_weights()` then writes in place, keeping the
  layout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..backend import Layout, Storage, TpuTensor, array_of, reshard, row_index, storage_of
from . import placements as pl
from .mesh import DeviceMesh


@dataclasses.dataclass
class ParamLayout:
    """How one parameter is laid out: per tensor dim, the global mesh axes it is split over."""

    mesh: DeviceMesh | None  # the job's root mesh; None while no split has been decided
    dims: list[list[str]]

    @property
    def spec(self) -> P:
        return spec_of(self.dims)


@dataclasses.dataclass(eq=False)
class ModuleRecord:
    """What the sharding layer keeps on one module, attached once as `module.__dict__["_torchtpu"]`
    (so it survives `to_empty()` and travels with a deepcopy)."""

    layouts: dict[str, ParamLayout] = dataclasses.field(default_factory=dict)  # its own parameters'
    fsdp: Any = None  # the FSDPState of a fully_shard call on this module
    layout_hooks: bool = False  # tensor parallelism's use-through-layout hooks are installed
    in_use: list[str] = dataclasses.field(default_factory=list)  # put in use by those hooks, this forward
    scan_base: type | None = None  # the class scan_layers replaced
    scan_start: int = 0  # the blocks before this one run as they are; the scan runs the rest
    scan_saves_ops: bool = False  # the scan keeps the outputs of OpPolicy's ops (per-op selective checkpointing)
    # materialize() of scanned blocks: per parameter slot (its path in a block), the one storage
    # all blocks' parameters of that slot are views of, [n_blocks, *shape] (see _materialize_stacked)
    stacked: dict[str, TpuTensor] = dataclasses.field(default_factory=dict)
    # FSDP leaves this linear layer's weight split when it puts it in use, instead of asking for it
    # gathered: its consumer computes in the split (the chunked loss's vocabulary-split logits)
    keep_split: bool = False


def module_record(module: torch.nn.Module, create: bool = False) -> ModuleRecord | None:
    rec = module.__dict__.get("_torchtpu")
    if rec is None and create:
        rec = module.__dict__["_torchtpu"] = ModuleRecord()
    return rec


def layout_of(module: torch.nn.Module, name: str, ndim: int) -> list[list[str]]:
    """The per-dim axes recorded for parameter `name` (a fresh unsplit record if none); the
    caller extends them and stores them with `set_layout`."""
    layouts = module_record(module, create=True).layouts
    entry = layouts.get(name)
    if entry is None:
        entry = layouts[name] = ParamLayout(None, [[] for _ in range(ndim)])
    return entry.dims


def set_layout(module: torch.nn.Module, name: str, mesh: DeviceMesh, entries: list[list[str]]) -> None:
    module_record(module, create=True).layouts[name] = ParamLayout(mesh.root(), entries)


def get_layout(module, name) -> ParamLayout | None:
    rec = module_record(module)
    return rec.layouts.get(name) if rec is not None else None


def spec_of(entries) -> P:
    return P(*[(e[0] if len(e) == 1 else tuple(e)) if e else None for e in entries])


# Using a parameter through its layout. While a module runs forward, the sharding layer puts in
# use, for a parameter, a tensor computed from it (constrained to its layout, cast for mixed
# precision): an instance attribute of the owner module of the same name, which nn.Module's
# attribute lookup finds before the registered parameter. The forward hook that put it in use
# releases it. FSDP, tensor parallelism and the model's parameter cast all go through these.


def through_layout(v: torch.Tensor, layout: ParamLayout | None) -> torch.Tensor:
    """`v` (a parameter, or a cast of it) constrained to `layout` inside programs, so that its
    gradient is laid out (reduced) the same way; unchanged when not laid out or not on tpu."""
    if layout is None or layout.mesh is None or v.device.type != "tpu":
        return v
    spec = pl.encode(layout.mesh, layout.spec)
    return torch.ops.torchtpu.shard(v, spec, spec)


def use_parameter(owner: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner.__dict__[name] = value


def release_parameter(owner: torch.nn.Module, name: str) -> None:
    owner.__dict__.pop(name, None)


def parameter_in_use(owner: torch.nn.Module, name: str) -> bool:
    return name in owner.__dict__


def _root_placements(root: DeviceMesh, sharding, ndim):
    return pl.placements_for(sharding, ndim, root)


def apply_layout(module: torch.nn.Module, name: str) -> None:
    """Put parameter `name` of `module` into its recorded layout (see module docstring)."""
    rec = get_layout(module, name)
    p = module._parameters.get(name)
    if rec is None or p is None:
        return
    root, entries = rec.mesh, rec.dims
    if root is None:
        return
    sharding = NamedSharding(root.jax_mesh, spec_of(entries))
    placements = _root_placements(root, sharding, p.dim())
    if p.device.type == "meta":
        return
    if isinstance(p, TpuTensor):
        if p._vw:
            raise RuntimeError(f"parameter {name!r} is a view of another tensor; it cannot be resharded in place")
        st = storage_of(p)
        st.dist = Layout(root, placements, sharding)
        if st.array is not None and st.array.sharding != sharding:
            st.array = reshard(st.array, sharding)
            st.version += 1
        return
    from .dtensor import distribute_tensor

    new = distribute_tensor(p.detach(), root, placements)
    module._parameters[name] = torch.nn.Parameter(new, requires_grad=p.requires_grad)


def materialize(model: torch.nn.Module) -> torch.nn.Module:
    """Replace `meta` parameters and buffers by tpu tensors created in their layouts.

    Values are zeros until written (e.g. by `model.init_weights()`), and each storage is
    created directly sharded, so the whole model never exists on one device.

    The blocks of a layer scan (`scan_layers`) get stacked storage: each parameter slot of the
    blocks is one [n_blocks, *shape] tensor and every block's Parameter is a view of its row (see
    `_materialize_stacked`).
    """
    for mod in model.modules():
        rec = module_record(mod)
        if rec is not None and rec.scan_base is not None:
            _materialize_stacked(mod, rec)
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            t = _lazy(tuple(p.shape), p.dtype, get_layout(mod, name))
            mod._parameters[name] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is None or b.device.type != "meta":
                continue
            mod._buffers[name] = _lazy(tuple(b.shape), b.dtype, None)
    return model


def _materialize_stacked(blocks: torch.nn.Module, rec: ModuleRecord) -> None:
    """Give the scanned `blocks` (all parameters still `meta`) one storage per parameter slot,
    [n_blocks, *shape], laid out like the slot with the block dim unsplit; block i's Parameter is
    the view of row i. Nothing visible changes: each block keeps its own Parameter objects
    (leaves of autograd, same names, shapes and layouts in `state_dict()`), and writing one (an
    init, a checkpoint restore) writes its row. What the stacking buys is inside programs: the
    layer scan reads each slot's rows straight from one array, and the trainer's optimizer
    updates a slot's rows as one tensor (`scan.optimizer_parameters`), so the compiled step holds
    a few large updates instead of one per block and parameter."""
    children = scanned_children(blocks, rec)
    slots = [
        (path, name) for path, m in children[0].named_modules() for name, p in m._parameters.items() if p is not None
    ]
    owners = {slot: [c.get_submodule(slot[0]) for c in children] for slot in slots}
    if any(
        o._parameters[n] is None or o._parameters[n].device.type != "meta"
        for (_, n), os_ in owners.items()
        for o in os_
    ):
        return  # only a model built on meta is stacked; a materialized one keeps its storages
    for (path, name), os_ in owners.items():
        p0 = os_[0]._parameters[name]
        lay = get_layout(os_[0], name)
        srec = None if lay is None or lay.mesh is None else ParamLayout(lay.mesh, [[]] + [list(d) for d in lay.dims])
        base = _lazy((len(children), *p0.shape), p0.dtype, srec)
        storage_of(base).rows = True
        for i, o in enumerate(os_):
            o._parameters[name] = torch.nn.Parameter(base.select(0, i), requires_grad=o._parameters[name].requires_grad)
        rec.stacked[f"{path}.{name}" if path else name] = base


def scanned_children(blocks: torch.nn.Module, rec: ModuleRecord) -> list:
    """The blocks of `blocks` that its layer scan runs (those from `rec.scan_start` on)."""
    return [m for m in blocks._modules.values() if m is not None][rec.scan_start :]


def _lazy(shape, dtype, rec) -> TpuTensor:
    from ..backend import new_empty

    t = new_empty(shape, dtype, 0)
    if rec is not None and rec.mesh is not None:
        root, entries = rec.mesh, rec.dims
        sharding = NamedSharding(root.jax_mesh, spec_of(entries))
        storage_of(t).dist = Layout(root, _root_placements(root, sharding, len(shape)), sharding)
    return t


def partition_spec(t: TpuTensor) -> P:
    """The PartitionSpec `t` is laid out by, without creating its values: its storage's layout,
    less the leading block dim for a row of a layer scan's stacked storage (_materialize_stacked)."""
    st = storage_of(t)
    if st.dist is None:
        return P(*array_of(t).sharding.spec)
    spec = tuple(st.dist.sharding.spec) + (None,) * (len(st.shape) - len(st.dist.sharding.spec))
    if not t._vw:
        return P(*spec)
    if row_index(t) is not None:
        return P(*spec[1:])
    return P(*array_of(t).sharding.spec)


def empty(shape, dtype=torch.float32, *, mesh: DeviceMesh, placements) -> TpuTensor:
    """A tpu tensor laid out over `mesh` whose storage is not created until it is read:
    an input for `CompiledFunction.compile_for` (ahead-of-time compilation)."""
    from ..backend import new_empty

    shape = tuple(shape)
    t = new_empty(shape, dtype, 0)
    sharding = pl.sharding_for(mesh, placements, len(shape))
    storage_of(t).dist = Layout(mesh, tuple(placements), sharding)
    return t


def local_bytes(tensors) -> dict:
    """Bytes each device holds for `tensors` (from the arrays' addressable shards)."""
    out: dict = {}
    for t in tensors:
        a = array_of(t)
        for s in a.addressable_shards:
            out[s.device] = out.get(s.device, 0) + math.prod(s.data.shape) * a.dtype.itemsize
    return out


__all__ = [
    "materialize",
    "partition_spec",
    "local_bytes",
    "apply_layout",
    "set_layout",
    "layout_of",
    "get_layout",
    "ParamLayout",
    "ModuleRecord",
    "module_record",
    "scanned_children",
    "through_layout",
    "use_parameter",
    "release_parameter",
    "Storage",
]
