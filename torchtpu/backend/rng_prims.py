"""PyTorch's RNG higher-order operators on tpu tensors.

Activation checkpointing under `torch.compile` (torchtitan's selective AC with a compiled model)
functionalizes each random op of a recomputed region into `run_and_save_rng_state(op, ...)` in the
forward, which returns the generator's state with the op's result, and `run_with_rng_state(state,
op, ...)` in the recomputation, which replays the op from that state. PyTorch implements them per
device (CUDA, CPU, XPU, HPU); for the tpu device they read and set the tpu generator of the op's
device. In eager that is torch.tpu.get_rng_state's seed and offset. Inside a compiled program a
random op's key derives from the program's base key (an input: it changes every call) and the op's
place in the program, so the state saved there is a tpu tensor of both, [base key data, counter],
which the recomputation (another program) draws from again: the recomputed masks equal the
forward's.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

from . import random as tpu_random
from .tensor import TpuTensor, internal_index, new_base
from .views import array_of


def _device(args, kwargs) -> torch.device:
    d = kwargs.get("device")
    if d is not None:
        return torch.device(d)
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type == "tpu":
            return a.device
    return torch.device("tpu", torch.tpu.current_device())


def _run_and_save(op, *args, **kwargs):
    device = _device(args, kwargs)
    traced = tpu_random.TRACED
    if traced is None:
        return torch.tpu.get_rng_state(device), op(*args, **kwargs)
    state = jnp.concatenate([jnp.asarray(traced.base, jnp.uint32), jnp.asarray([traced.count], jnp.uint32)])
    return new_base(state, internal_index(device.index)), op(*args, **kwargs)


def _run_with(rng_state, op, *args, **kwargs):
    if rng_state.device.type == "tpu":  # saved inside a compiled program: replay its keys
        state = array_of(rng_state)
        keys = tpu_random.TracedKeys(state[:2])
        keys.count = state[2]
        prev, tpu_random.TRACED = tpu_random.TRACED, keys
        try:
            return op(*args, **kwargs)
        finally:
            tpu_random.TRACED = prev
    device = _device(args, kwargs)
    current = torch.tpu.get_rng_state(device)
    torch.tpu.set_rng_state(rng_state, device)
    try:
        return op(*args, **kwargs)
    finally:
        torch.tpu.set_rng_state(current, device)


def _pass_through(hop):
    """For AOTAutograd's aliasing check mode, which answers NotImplemented for a tensor type it
    does not know: run the operator without the mode."""

    def run(mode, *args, **kwargs):
        return hop(*args, **kwargs)

    return run


_installed = [False]


def install() -> None:
    if _installed[0]:
        return
    _installed[0] = True
    run_and_save_rng_state.py_impl(TpuTensor)(_run_and_save)
    run_with_rng_state.py_impl(TpuTensor)(_run_with)


def install_compiled() -> None:
    """The aliasing check's pass-through, once torch._dynamo (and so AOTAutograd) is imported."""
    from torch._functorch._aot_autograd.runtime_wrappers import _AnalyzeCustomOpInputOutputMode as check

    for hop in (run_and_save_rng_state, run_with_rng_state):
        if check not in hop.python_key_table:
            hop.py_impl(check)(_pass_through(hop))
