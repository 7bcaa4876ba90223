"""A torch module's parameters and buffers as a JAX pytree, and back, without copies.

    tree = torchtpu.module_to_jax(model)            # {"0.weight": jax.Array, ...}
    tree = optax_update(tree, grads)                # any JAX code: optax, flax, a jitted function
    torchtpu.module_from_jax(model, tree)           # the module's tensors now hold the new arrays

A tpu tensor holds a `jax.Array`: `to_jax` hands out that array and `from_jax` wraps one, so
neither copies (a tensor that is a view of a larger one is the exception: its values are
gathered into a new array). `module_from_jax` writes each array into the module's tensor in
place, so the `nn.Parameter` objects (and an optimizer holding them) stay the same; an array laid
out differently from the tensor it replaces is moved to the tensor's layout (as any write into a
sharded tensor is).
"""

from __future__ import annotations

import torch

from .tensor import TpuTensor
from .transfer import from_jax, to_jax

__all__ = ["module_to_jax", "module_from_jax"]


def _tensors(module: torch.nn.Module, buffers: bool) -> dict:
    named = dict(module.named_parameters())
    if buffers:
        named.update(dict(module.named_buffers()))
    for name, t in named.items():
        if not isinstance(t, TpuTensor):
            raise TypeError(
                f"torchtpu.module_to_jax: {name} is on {t.device}, not the tpu device; call module.to('tpu') first"
            )
    return named


def module_to_jax(module: torch.nn.Module, *, buffers: bool = True) -> dict:
    """{qualified name: jax.Array} for the module's parameters (and buffers), the arrays they hold."""
    return {name: to_jax(t) for name, t in _tensors(module, buffers).items()}


def module_from_jax(module: torch.nn.Module, tree: dict, *, buffers: bool = True) -> None:
    """Write `tree` ({qualified name: jax.Array}, as module_to_jax makes) into the module's tensors,
    in place. Every name must be the module's and every array shaped and typed like its tensor."""
    named = _tensors(module, buffers)
    unknown = sorted(set(tree) - set(named))
    missing = sorted(set(named) - set(tree))
    if unknown or missing:
        raise KeyError(
            f"torchtpu.module_from_jax: the tree does not match the module's tensors: not in the module {unknown}, "
            f"missing from the tree {missing}"
        )
    with torch.no_grad():
        for name, a in tree.items():
            t = named[name]
            if tuple(a.shape) != tuple(t.shape) or from_jax(a).dtype != t.dtype:
                raise ValueError(
                    f"torchtpu.module_from_jax: {name} is {a.dtype}{list(a.shape)}, the module's tensor is "
                    f"{t.dtype}{list(t.shape)}"
                )
            t.copy_(from_jax(a))
