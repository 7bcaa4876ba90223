"""Tensor parallelism: torch's `parallelize_module` plans, as parameter layouts plus
activation sharding constraints.

PyTorch's parallel styles (`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`,
`PrepareModuleInput`, `PrepareModuleOutput`, `PrepareModuleInputOutput`) are accepted as
they are, and read for what they say:

- parameters: a colwise `nn.Linear` splits its weight's output dim (and bias) over the
  tensor-parallel mesh dim, a rowwise one its input dim; for `nn.Embedding` colwise splits
  the embedding dim and rowwise the vocabulary;
- activations: `input_layouts` is how an input is laid out, `desired_input_layouts` how the
  module wants it, `output_layouts` how the output should leave. Each becomes a sharding
  constraint (`torchtpu::shard`) on the global activation, whose backward lays the gradient
  out as the input was, so XLA emits the same collectives DTensor would: all-gather before a
  colwise layer in sequence parallelism, reduce-scatter or all-reduce after a rowwise one. A
  `Partial` output layout (a rowwise layer whose sum a later layout settles, as in torchtitan's
  MoE shared experts) gets no constraint: the value is the sum already, and its reader's layout
  decides how XLA reduces it.

Tensors stay global: `use_local_output` has nothing to convert (see dtensor.py), and model
code that reshapes with -1 for the head count works unchanged. The batch dim (dim 0) of
activations is left to XLA, so data parallelism on the other mesh axes composes.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import style as styles

from .batch import activation_batch_axes
from .dtensor import shard_as
from .mesh import DeviceMesh, current_mesh
from .params import (
    apply_layout,
    layout_of,
    module_record,
    parameter_in_use,
    release_parameter,
    set_layout,
    through_layout,
    use_parameter,
)

__all__ = ["parallelize_module", "split_parameter"]

_ACT = (0,)  # activation dims left to XLA: the batch dim


def parallelize_module(
    module: nn.Module, device_mesh: DeviceMesh | None = None, parallelize_plan=None, *, src_data_rank=0
) -> nn.Module:
    """Apply a tensor-parallel plan (a style, or {submodule path: style}) to `module`."""
    mesh = device_mesh or current_mesh()
    if mesh is None:
        raise RuntimeError("parallelize_module needs a device mesh: call torchtpu.distributed.init_device_mesh first")
    if parallelize_plan is None:
        return module
    if isinstance(parallelize_plan, styles.ParallelStyle):
        _apply(module, mesh, parallelize_plan, type(module).__name__)
        return module
    if not isinstance(parallelize_plan, dict):
        raise TypeError(
            f"parallelize_plan must be a ParallelStyle or a dict of them, got {type(parallelize_plan).__name__}"
        )
    for path, style in parallelize_plan.items():
        targets = _match(module, path)
        if not targets:
            names = [n for n, _ in module.named_modules() if n][:12]
            raise ValueError(
                f"parallelize plan key {path!r} matches no submodule of {type(module).__name__}; submodules include {names}"
            )
        for name, m in targets:
            if isinstance(style, dict):
                parallelize_module(m, mesh, style)
            else:
                _apply(m, mesh, style, name)
    return module


def _match(module, path: str):
    atoms = path.split(".")
    found = [("", module)]
    for atom in atoms:
        nxt = []
        for prefix, m in found:
            for name, child in m.named_children():
                if fnmatch.fnmatchcase(name, atom):
                    nxt.append((f"{prefix}.{name}" if prefix else name, child))
        found = nxt
    return found


def _tp_axes(mesh: DeviceMesh, style) -> tuple[str, ...]:
    if mesh.ndim != 1:
        raise ValueError(
            f"{type(style).__name__ if style is not None else 'split_parameter'} needs a 1-D tensor-parallel mesh, "
            f"got {mesh} (select it with mesh['tp'])"
        )
    return mesh.dims[0]


def split_parameter(module: nn.Module, name: str, mesh: DeviceMesh, dim: int) -> None:
    """Split parameter `name` of `module` on `dim` over the 1-D tensor-parallel mesh `mesh` (on top of
    any layout it has), for a parameter no parallel style knows (e.g. the routed experts' (E, ...)
    weights); each forward of `module` then uses it through a constraint to that layout."""
    _tp_axes(mesh, None)
    _split_param(module, name, mesh, dim)


def _split_param(module, name, mesh, dim):
    """Split parameter `name` on `dim` over the tensor-parallel axes (dim None: replicate it
    over the mesh, so every parameter of a parallelized module lives on the mesh)."""
    p = module._parameters.get(name)
    if p is None:
        return
    entries = layout_of(module, name, p.dim())
    if dim is None:
        set_layout(module, name, mesh, entries)
        apply_layout(module, name)
        return
    d = dim % p.dim()
    if p.shape[d] % mesh.size() != 0:
        raise ValueError(
            f"cannot split {type(module).__name__}.{name} of shape {tuple(p.shape)} on dim {d} over "
            f"{mesh.size()} tensor-parallel devices: {p.shape[d]} is not divisible by {mesh.size()}"
        )
    for a in mesh.dims[0]:
        if a not in entries[d]:
            entries[d].append(a)
    set_layout(module, name, mesh, entries)
    apply_layout(module, name)
    _constrain_uses(module)


def _constrain_uses(module):
    """Each forward uses the module's laid-out parameters through a sharding constraint to
    their own layout, so their gradients come back in that layout too (and XLA never gathers
    a tensor-parallel weight whole to update it). A constraint already put in place by
    fully_shard (which also casts for mixed precision) is left alone."""
    record = module_record(module, create=True)
    if record.layout_hooks:
        return
    record.layout_hooks = True

    def pre(mod, args):
        record = module_record(mod)
        placed = []
        for name, layout in record.layouts.items():
            p = mod._parameters.get(name)
            if p is not None and not parameter_in_use(mod, name) and p.device.type == "tpu":
                use_parameter(mod, name, through_layout(p, layout))
                placed.append(name)
        record.in_use = placed

    def post(mod, args, out):
        record = module_record(mod)
        for name in record.in_use:
            release_parameter(mod, name)
        record.in_use = []
        return out

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _layout(t, mesh, placement, grad_placement):
    if not isinstance(t, torch.Tensor) or placement is None:
        return t
    grad = None
    if grad_placement is not None:
        grad = (Replicate() if isinstance(grad_placement, Partial) else grad_placement,)
    # the batch dim (0) goes over the data-parallel axes, so XLA keeps activations batch-split
    return shard_as(
        t, mesh, (placement,), grad_placements=grad, unconstrained=_ACT, batch_axes=activation_batch_axes(mesh)
    )


def _apply(module: nn.Module, mesh: DeviceMesh, style, name: str) -> None:
    if isinstance(style, styles.ColwiseParallel):
        _tp_axes(mesh, style)
        if isinstance(module, nn.Linear):
            _split_param(module, "weight", mesh, 0)
            _split_param(module, "bias", mesh, 0)
            desired = Replicate()
        elif isinstance(module, nn.Embedding):
            _split_param(module, "weight", mesh, 1)
            desired = None
        else:
            raise TypeError(f"ColwiseParallel supports nn.Linear and nn.Embedding; {name} is {type(module).__name__}")
        _io_hooks(module, mesh, style.input_layouts, (desired,), style.output_layouts, (Shard(-1),))
    elif isinstance(style, styles.RowwiseParallel):
        _tp_axes(mesh, style)
        if isinstance(module, nn.Linear):
            _split_param(module, "weight", mesh, 1)
            _split_param(module, "bias", mesh, None)
            desired = Shard(-1)
        elif isinstance(module, nn.Embedding):
            _split_param(module, "weight", mesh, 0)
            desired = None  # token ids stay replicated; each device looks up its vocab slice
        else:
            raise TypeError(f"RowwiseParallel supports nn.Linear and nn.Embedding; {name} is {type(module).__name__}")
        _io_hooks(module, mesh, style.input_layouts, (desired,), style.output_layouts, (Partial(),))
    elif isinstance(style, styles.SequenceParallel):
        _tp_axes(mesh, style)
        seq = style.sequence_sharding
        for pname in list(module._parameters):
            _split_param(module, pname, mesh, None)
        _io_hooks(module, mesh, seq, seq, seq, seq)
    elif isinstance(style, styles.PrepareModuleInputOutput):
        _apply(module, mesh, style.prepare_module_input, name)
        _apply(module, mesh, style.prepare_module_output, name)
    elif isinstance(style, styles.PrepareModuleInput):
        _tp_axes(mesh, style)
        _input_hook(
            module,
            mesh,
            style.input_layouts,
            style.desired_input_layouts,
            style.input_kwarg_layouts,
            style.desired_input_kwarg_layouts,
        )
    elif isinstance(style, styles.PrepareModuleOutput):
        _tp_axes(mesh, style)
        outs, desired = style.output_layouts, style.desired_output_layouts

        def post(mod, args, out):
            if isinstance(out, tuple):
                return tuple(_layout(o, mesh, d, i) for o, i, d in zip(out, outs, desired))
            return _layout(out, mesh, desired[0], outs[0])

        module.register_forward_hook(post)
    else:
        raise TypeError(
            f"unsupported parallel style {type(style).__name__} for {name}: use ColwiseParallel, RowwiseParallel, "
            "SequenceParallel, PrepareModuleInput, PrepareModuleOutput or PrepareModuleInputOutput"
        )


def _io_hooks(module, mesh, input_layouts, desired_inputs, output_layouts, natural_outputs):
    """Input: from `input_layouts` to `desired_inputs`; output: from its natural layout to `output_layouts`."""
    _input_hook(module, mesh, input_layouts, desired_inputs, None, None)
    out_layout = output_layouts[0] if output_layouts else None
    natural = natural_outputs[0]

    def post(mod, args, out):
        # a Partial output is the reduced value already (tensors are global): its layout is left to
        # what reads it, so XLA may reduce-scatter it into a sequence-split sum rather than all-reduce
        if out_layout is None or isinstance(out_layout, Partial):
            return out
        # the gradient goes back in the output's natural layout (Replicate for a Partial one)
        return _layout(out, mesh, out_layout, natural)

    module.register_forward_hook(post)


def _input_hook(module, mesh, input_layouts, desired, kw_layouts, kw_desired):
    input_layouts = tuple(input_layouts or ())
    desired = tuple(desired or ())
    kw_layouts = dict(kw_layouts or {})
    kw_desired = dict(kw_desired or {})
    if not desired and not kw_desired:
        return

    def pre(mod, args, kwargs):
        args = list(args)
        for i, d in enumerate(desired):
            if i < len(args) and d is not None:
                src = input_layouts[i] if i < len(input_layouts) else None
                args[i] = _layout(args[i], mesh, d, src)
        for k, d in kw_desired.items():
            if k in kwargs and d is not None:
                kwargs[k] = _layout(kwargs[k], mesh, d, kw_layouts.get(k))
        return tuple(args), kwargs

    module.register_forward_pre_hook(pre, with_kwargs=True)
