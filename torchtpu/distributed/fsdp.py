"""FSDP2's `fully_shard` as parameter layouts.

`fully_shard(module, mesh=...)` splits each parameter the call manages on dim 0 over the
data-parallel mesh axes (on a 2-D mesh, HSDP: replicated over the first dim, sharded over the
second). Parameters already split on dim 0 by tensor parallelism are split further, TP axes
first, so gathering the FSDP axes yields exactly the TP shard. No collective is written by
hand: each use of a parameter inside a program goes through a sharding constraint to the
parameter's own layout (whose backward lays the gradient out the same way: the reduce-scatter),
then, for linear weights, after the mixed-precision cast, through one to the gathered layout (the
FSDP axes dropped: the all-gather, in `param_dtype`). XLA emits both collectives on the interconnect and
schedules them itself. `reshard_after_forward` is accepted for compatibility; XLA decides
whether a gathered parameter stays live between forward and backward. An `nn.Embedding` whose
table's rows are split looks up without gathering the table (embedding.py: the token ids move
instead, and each chip adds the gradient into its own rows).

Mixed precision (`MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype,
cast_forward_inputs)`): the module computes with parameters cast to `param_dtype`; their
gradients are cast to `reduce_dtype` before the reduction and to the parameter's own dtype
(the fp32 master copy) after it.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard

from . import embedding
from .batch import batch_pinner
from .mesh import DeviceMesh, current_mesh
from .params import (
    ParamLayout,
    apply_layout,
    get_layout,
    layout_of,
    module_record,
    release_parameter,
    set_layout,
    through_layout,
    use_parameter,
)

__all__ = ["fully_shard", "MixedPrecisionPolicy", "FSDPState"]


class FSDPState:
    def __init__(self, mesh, params, mp_policy, reshard_after_forward):
        self.mesh = mesh
        self.params = params  # [(owner module, name)]
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward


def _managed(module: nn.Module, ignored) -> list[tuple[nn.Module, str]]:
    out = []

    def walk(m, top):
        rec = module_record(m)
        if not top and rec is not None and rec.fsdp is not None:
            return  # an inner fully_shard manages this subtree
        for name, p in m._parameters.items():
            if p is not None and p not in ignored:
                out.append((m, name))
        for child in m.children():
            walk(child, False)

    walk(module, True)
    return out


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = True,
    shard_placement_fn=None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy=None,
    ignored_params=None,
) -> nn.Module:
    """Shard `module`'s parameters over the data-parallel mesh (FSDP2's API)."""
    mesh = mesh or current_mesh()
    if mesh is None:
        raise RuntimeError("fully_shard needs a device mesh: call torchtpu.distributed.init_device_mesh first")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard takes a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP), got {mesh}")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise NotImplementedError("fully_shard: CPU offload is not supported on tpu")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    shard_axes = mesh.dims[-1]
    n = mesh.size(mesh.ndim - 1)
    ignored = set(ignored_params or ())
    params = _managed(module, ignored)
    for owner, name in params:
        p = owner._parameters[name]
        entries = layout_of(owner, name, p.dim())
        rec = get_layout(owner, name)
        if rec is not None and rec.mesh is not None and rec.mesh.jax_mesh != mesh.jax_mesh:
            raise ValueError(f"parameter {name!r} is laid out on another mesh than {mesh}")
        if any(a in e for e in entries for a in shard_axes):
            continue  # already sharded over these axes
        dim = 0
        if shard_placement_fn is not None:
            placement = shard_placement_fn(p)
            if placement is not None:
                if not isinstance(placement, Shard):
                    raise TypeError(f"shard_placement_fn must return Shard(dim) or None, got {placement!r}")
                dim = placement.dim % max(p.dim(), 1)
        if p.dim() == 0:
            continue
        dim = _divisible_dim(p.shape, entries, dim, n, mesh)
        if dim is None:
            warnings.warn(
                f"fully_shard: {type(owner).__name__}.{name} of shape {tuple(p.shape)} has no dim divisible by "
                f"the {n} data-parallel shards; it stays replicated",
                stacklevel=2,
            )
            continue
        entries[dim].extend(shard_axes)
        set_layout(owner, name, mesh, entries)
        apply_layout(owner, name)
    state = FSDPState(mesh, params, mp_policy, reshard_after_forward)
    module_record(module, create=True).fsdp = state
    module.register_forward_pre_hook(_pre_forward(state), with_kwargs=True)
    # always_call: activation checkpointing's recomputation stops early by raising out of the
    # module's forward; the cast parameters must not outlive it (they would be kept alive, and
    # become state of a compiled step: a full bf16 copy of every weight).
    module.register_forward_hook(_post_forward(state), always_call=True)
    pin = _pin_linear_outputs(state)
    for owner in {id(o): o for o, _ in params}.values():
        if isinstance(owner, nn.Linear):
            owner.register_forward_hook(pin)
        elif isinstance(owner, nn.Embedding):
            embedding.install(owner, tuple(a for d in mesh.dims for a in d))
    return module


def _divisible_dim(shape, entries, preferred, n, mesh):
    from math import prod

    def ok(d):
        split = prod(mesh.jax_mesh.shape[a] for a in entries[d]) * n
        return shape[d] % split == 0

    if ok(preferred):
        return preferred
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if ok(d):
            return d
    return None


def _use(p: torch.Tensor, owner, name, state: FSDPState) -> torch.Tensor:
    """The parameter as the forward uses it: constrained to its own layout (so its gradient
    is reduced into that layout), cast for mixed precision, then, for a linear layer's weight,
    gathered over the FSDP axes (see _gathered)."""
    rec = get_layout(owner, name)
    mp = state.mp_policy
    v = p
    pd, rd = mp.param_dtype, mp.reduce_dtype
    floating = p.is_floating_point()
    if floating and rd is not None and rd != p.dtype:
        v = v.to(rd)
    v = through_layout(v, rec)
    if floating and pd is not None and pd != v.dtype:
        v = v.to(pd)
    keep_split = getattr(module_record(owner), "keep_split", False)
    if isinstance(owner, nn.Linear) and name == "weight" and not keep_split:
        v = through_layout(v, _gathered(rec, state.mesh))
    return v


def _gathered(rec: ParamLayout | None, mesh: DeviceMesh) -> ParamLayout | None:
    """`rec` without the FSDP axes of `mesh`: the layout FSDP computes with (each rank holds the
    whole parameter, or its tensor-parallel shard). Requested explicitly for linear weights, so
    that the all-gather is of the weight, in `param_dtype`, as FSDP's is: left to itself, XLA may
    keep the weight split and gather the activations of the whole global batch instead (it does
    for the row-parallel projections with one sequence per rank under tensor parallelism).
    Embedding tables and norm weights are not gathered: a lookup in a vocabulary-split table
    needs no gathered table (embedding.py), and measured on the 2-layer 8B step for v5p:2x2x1 an explicit gather
    of them cost 3.4 GiB more temporaries per chip and reduced the norm weights' gradients in
    bfloat16."""
    if rec is None or rec.mesh is None:
        return None
    fsdp_axes = set(mesh.dims[-1])
    return ParamLayout(rec.mesh, [[a for a in e if a not in fsdp_axes] for e in rec.dims])


def _pin_linear_outputs(state: FSDPState):
    """Forward hook for the linear layers a fully_shard manages: their outputs stay split over the
    batch, as FSDP's activations are (each rank computes its own samples with gathered weights).
    Without it XLA may keep a weight sharded and split the activations on the hidden dim instead,
    paying all-to-alls and full-batch gathers around the layer."""
    pin_batch = batch_pinner(state.mesh)

    def hook(module, args, out):
        return pin_batch(out)

    return hook


def _pre_forward(state: FSDPState):
    mp = state.mp_policy
    # the module's main input keeps its batch dim split over the data-parallel axes, so XLA
    # does not trade it for a split of the hidden dims (all-to-alls around the module)
    pin_batch = batch_pinner(state.mesh)

    def hook(module, args, kwargs):
        if args:
            args = (pin_batch(args[0]),) + tuple(args[1:])
        for owner, name in state.params:
            p = owner._parameters.get(name)
            if p is not None:
                use_parameter(owner, name, _use(p, owner, name, state))
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            cast = lambda x: x.to(mp.param_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return args, kwargs

    return hook


def _post_forward(state: FSDPState):
    mp = state.mp_policy

    def hook(module, args, out):
        for owner, name in state.params:
            release_parameter(owner, name)
        if mp.output_dtype is not None:
            cast = lambda x: x.to(mp.output_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
            out = torch.utils._pytree.tree_map(cast, out)
        return out

    return hook
