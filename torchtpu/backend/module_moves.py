"""Module moves to, from and within tpu keep their Parameter objects, as CUDA moves do.

On CUDA, `module.to("cuda")` changes each parameter in place (`param.data = moved`), so
`m.weight is p` stays true: tied weights stay one tensor, and an optimizer built before the
move keeps updating the model. PyTorch takes that path only when the old and the new tensor
have "compatible shallow-copy types": both plain dense TensorImpls. A tpu tensor's values
live on its Python object (`TpuTensor._st`, a jax.Array holder), which a TensorImpl-level
shallow copy cannot carry over, so `param.data = tpu_tensor` cannot work for a CPU parameter,
and PyTorch would fall back to a new Parameter object.

What can carry a Python object's state is `torch.utils.swap_tensors`: it swaps the class,
the `__dict__` and the TensorImpl of two tensor objects, and `nn.Module._apply` uses it when
`torch.__future__.get_swap_module_params_on_conversion()` is set. We turn that flag on only
for the duration of a move that involves tpu (a parameter already on tpu, or `fn` producing a
tpu tensor), and restore what a swap loses but `.data =` keeps:

- the tensor hooks (`register_hook`, `register_post_accumulate_grad_hook`), which PyTorch
  registers on the TensorImpl that the swap sends away;
- the user's attributes on the Parameter (for example `_is_hf_initialized`), which live in
  the `__dict__` that the swap sends away.

Buffers are reassigned (`module._buffers[name] = fn(buf)`), as PyTorch does on every device.

Parameter subclasses. Libraries give their weights behaviour through subclasses of
`nn.Parameter` (vLLM's `ModelWeightParameter` carries its weight loader and which dim is split).
For any tensor subclass PyTorch's `Parameter.__new__` returns the data itself flagged as a
parameter, so `ModelWeightParameter(torch.empty(..., device="tpu"))` would be a plain tpu tensor
whose subclass `__init__` never runs. Here a strict subclass of `nn.Parameter` given tpu data is
an instance of that subclass mixed with TpuTensor (`tpu_parameter_class`): the subclass's
methods and `__init__` come first, TpuTensor's storage and dispatch after them. Plain
`nn.Parameter(tpu_tensor)` keeps PyTorch's behaviour.
"""

from __future__ import annotations

import torch
from torch import nn

from .tensor import TpuTensor

_torch_module_apply = nn.Module._apply

# What a TpuTensor keeps in its __dict__ (see tensor.py); never carried over from a CPU
# parameter's old self, and never restored onto a parameter that left tpu.
_TENSOR_STATE = frozenset(("_st", "_vw", "_vc", "_vv"))


def _moves_tpu(module: nn.Module, fn) -> bool:
    sample = None
    for p in module.parameters():
        if type(p) is TpuTensor:
            return True
        if sample is None:
            sample = p
    if sample is None:
        return False  # no parameters: nothing whose identity could be kept
    try:
        with torch.no_grad():
            probe = fn(torch.empty(0, dtype=sample.dtype))
    except Exception:
        return False  # fn only knows how to treat real parameters: not a device move we own
    return type(probe) is TpuTensor


def _held_elsewhere(t: torch.Tensor) -> bool:
    """Whether `torch.utils.swap_tensors` would refuse `t`: something besides its own Python object
    (and its gradient accumulator) holds its TensorImpl, such as a live autograd graph that saved it."""
    count = t._use_count()
    if count <= 1:
        return False
    if count > 2 or not t.is_leaf or not t.requires_grad:
        return True
    torch.autograd.graph.get_gradient_edge(t)  # the accumulator: made now if it was not there
    return t._use_count() > 2


def _check_swappable(module: nn.Module, recurse: bool) -> None:
    """Refuse a move before it starts, rather than after some parameters have moved and others not
    (PyTorch's `_apply` swaps them one by one, each with its .grad set aside, as here)."""
    for name, p in module.named_parameters(recurse=recurse):
        grad = p.grad
        p.grad = None
        try:
            held = _held_elsewhere(p)
        finally:
            p.grad = grad
        if held:
            raise RuntimeError(
                f"torchtpu: cannot move parameter {name} of {type(module).__name__} to or from tpu while other "
                "tensors hold it (an autograd graph that saved it: an output computed with gradients and not yet "
                "backpropagated, or a torch.func transform in progress). Run backward or drop those outputs "
                "(del loss), then move the module; nothing has been moved"
            )


def _apply(self: nn.Module, fn, recurse: bool = True):
    if torch.__future__.get_swap_module_params_on_conversion() or not _moves_tpu(self, fn):
        return _torch_module_apply(self, fn, recurse)
    _check_swappable(self, recurse)
    kept = []
    for p in self.parameters():
        hooks = (p._backward_hooks, p._post_accumulate_grad_hooks)
        attrs = {k: v for k, v in p.__dict__.items() if k not in _TENSOR_STATE}
        if hooks != (None, None) or attrs:
            kept.append((p, hooks, attrs))
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return _torch_module_apply(self, fn, recurse)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
        for p, (backward, post_accumulate), attrs in kept:
            p.__dict__.update(attrs)
            # re-assigning registers the hook dicts on the TensorImpl the parameter now has
            if backward is not None:
                p._backward_hooks = backward
            if post_accumulate is not None:
                p._post_accumulate_grad_hooks = post_accumulate


_torch_parameter_new = nn.Parameter.__new__
_PARAMETER_CLASSES: dict = {}


def tpu_parameter_class(cls: type) -> type:
    """`cls` (a subclass of nn.Parameter) mixed with TpuTensor, made once per class."""
    mixed = _PARAMETER_CLASSES.get(cls)
    if mixed is None:
        mixed = _PARAMETER_CLASSES[cls] = type(f"Tpu{cls.__name__}", (cls, TpuTensor), {"__module__": cls.__module__})
    return mixed


def _parameter_new(cls, data=None, requires_grad=True):
    if cls is nn.Parameter or not isinstance(data, TpuTensor):
        return _torch_parameter_new(cls, data, requires_grad)
    d = data.detach()
    t = TpuTensor.__new__(
        tpu_parameter_class(cls),
        d._st,
        d._vw,
        tuple(d.shape),
        d.dtype,
        strides=d.stride(),
        offset=d.storage_offset(),
        requires_grad=requires_grad,
    )
    t._is_param = True
    return t


def install() -> None:
    nn.Module._apply = _apply
    nn.Parameter.__new__ = _parameter_new
