"""Activation checkpointing (rematerialisation) for tpu programs.

PyTorch's own non-reentrant `torch.utils.checkpoint` drops a block's activations after the
forward and recomputes them during backward. Inside a compiled torchtpu step, forward and
recomputation end up in one XLA program, where XLA would merge the recomputation with the
original forward (common subexpression elimination) and keep the activations alive after
all. The recomputation therefore starts from its inputs passed through an XLA optimization
barrier, as jax.checkpoint does, which keeps the two computations apart.

The recomputation also runs under the torch function modes the forward ran under (PyTorch's
checkpoint restores the RNG and autocast state, not those, and the autograd engine runs backward
without the caller's modes even when backward() is called inside them): without that, a mode
such as `loss_parallel` around the loss is gone when backward recomputes, and the recomputation
would compute something else (see _forward_function_modes).
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint
from jax import lax

from .optable import lower

_lib = torch.library.Library("torchtpu", "DEF")
_lib.define("optimization_barrier(Tensor[] xs) -> Tensor[]")


def _barrier_cpu(xs):
    return [x.clone() for x in xs]


_lib.impl("optimization_barrier", _barrier_cpu, "CompositeExplicitAutograd")


@torch.library.register_fake("torchtpu::optimization_barrier")
def _barrier_fake(xs):
    return [torch.empty_like(x) for x in xs]


def _barrier_backward(ctx, grads):
    return list(grads)


torch.library.register_autograd("torchtpu::optimization_barrier", _barrier_backward)


@lower(torch.ops.torchtpu.optimization_barrier.default)
def optimization_barrier(xs):
    return list(lax.optimization_barrier(tuple(xs)))


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _barrier_tensors(args):
    # Only inputs that require grad (the activations) pass the barrier: constants such as a
    # rotary table need none (the recomputation already starts from barriered activations),
    # and a barrier output that needs no grad aborts PyTorch's autograd engine during
    # recomputation (seen with complex and with float32 rotary tables).
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.device.type == "tpu" and a.requires_grad]
    if not idx:
        return args
    out = torch.ops.torchtpu.optimization_barrier([args[i] for i in idx])
    args = list(args)
    for i, t in zip(idx, out):
        args[i] = t
    return tuple(args)


def _strip_wrapper(module, state_dict, prefix, local_metadata):
    # state_dict() names stay the wrapped module's own (checkpoints do not depend on whether
    # activation checkpointing, or the layer scan that replaces it, was on); order is kept
    inner = prefix + "module."
    items = [(prefix + k[len(inner) :] if k.startswith(inner) else k, v) for k, v in state_dict.items()]
    state_dict.clear()
    state_dict.update(items)
    return state_dict


def _add_wrapper(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    inner = prefix + "module."
    for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + k[len(prefix) :]] = state_dict.pop(k)


def _function_modes() -> tuple:
    return tuple(torch.overrides._get_current_function_mode_stack())


@contextlib.contextmanager
def _forward_function_modes(modes: tuple):
    """Context of a recomputation: enters the torch function modes that were active when the
    forward ran and are not active now, innermost last, as they were.

    Without it, F.cross_entropy under `loss_parallel` (a TorchFunctionMode) computes the
    vocab-parallel loss in forward but the plain one when backward recomputes it: other saved
    tensors, so torch.utils.checkpoint raises a CheckpointError from inside the autograd engine.
    On tpu that error cannot even be reported: it unwinds through the engine's stream guard,
    whose destructor calls back into the Python-registered PrivateUse1 device guard, and the
    process aborts ("terminate called without an active exception")."""
    active = {id(m) for m in _function_modes()}
    with contextlib.ExitStack() as stack:
        for mode in modes:
            if id(mode) not in active:
                stack.enter_context(mode)
        yield


class _Checkpointed(torch.nn.Module):
    """Wraps a module so its activations are recomputed in backward. Its state_dict() has the
    wrapped module's names (no wrapper prefix)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self._register_state_dict_hook(_strip_wrapper)
        self._register_load_state_dict_pre_hook(_add_wrapper)

    def __getattr__(self, name):
        # the wrapped block's own methods and attributes (torchtitan's init_weights) stay reachable
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)

    def forward(self, *args, **kwargs):
        def run(*a):
            if _in_backward():
                a = _barrier_tensors(a)
            return self.module(*a, **kwargs)

        modes = _function_modes()

        def contexts():
            return contextlib.nullcontext(), _forward_function_modes(modes)

        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, context_fn=contexts)


def is_checkpointed(module: torch.nn.Module) -> bool:
    """Whether `module` is wrapped by checkpoint_module: its forward runs again in backward."""
    return isinstance(module, _Checkpointed)


def checkpoint_module(module: torch.nn.Module) -> torch.nn.Module:
    """Return `module` wrapped so that its activations are recomputed during backward."""
    return _Checkpointed(module)


def apply_activation_checkpointing(blocks: torch.nn.Module, mode: str = "full", every: int = 1) -> None:
    """Checkpoint the children of `blocks` (a ModuleDict/ModuleList/Sequential of layers).

    mode="full": every block; mode="selective": every `every`-th block (torchtitan's
    layer-selective policy); mode="none": nothing.
    """
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of 'none', 'full', 'selective'")
    if mode == "selective" and every < 1:
        raise ValueError(f"selective activation checkpointing needs every >= 1, got {every}")
    if mode == "none":
        return
    step = 1 if mode == "full" else every
    for i, (name, child) in enumerate(list(blocks.named_children())):
        if i % step == step - 1 if mode == "selective" else True:
            setattr(blocks, name, checkpoint_module(child))
