"""What a call of a compiled step (torchtpu.compile, compile.py) reads besides its tensors: the
optimizers' hyperparameters, each lifted (a program input, its current value sent with the call) or
guarded (part of the executable's cache key), and the CPU tensors its tpu ops read (program inputs).
"""

from __future__ import annotations

import torch

from .compile_capture import optimizer_device_index
from .tensor import TpuTensor

# Optimizer hyperparameters that LR schedulers change every step: program inputs, never guarded.
LIFTED_HYPERPARAMETERS = ("lr",)


def _is_host_number(v) -> bool:
    if type(v) is float or type(v) is int:
        return True
    return isinstance(v, torch.Tensor) and not isinstance(v, TpuTensor) and v.numel() == 1


def _guard_value(v):
    """What a param_group entry contributes to a compiled step's cache key."""
    if isinstance(v, TpuTensor):
        return "tpu tensor"  # program state: an input, never a constant
    if isinstance(v, torch.Tensor):
        return ("cpu tensor", tuple(v.shape), v.tolist())
    if isinstance(v, (list, tuple)):
        return tuple(_guard_value(x) for x in v)
    try:
        hash(v)
    except TypeError:
        return (type(v).__name__, id(v))
    return v


class CallInputs:
    """What a call reads besides tensors: the lifted optimizer hyperparameters (their values
    are program inputs), the guarded ones (part of the cache key), the CPU tensors read by tpu
    ops (program inputs)."""

    __slots__ = ("guard", "slots", "values", "host")

    def __init__(self, guard, slots, values, host):
        self.guard = guard
        self.slots = slots  # [(param_group, key, device_index)]
        self.values = values  # their current values, floats
        self.host = host  # [cpu tensor]


def call_inputs(optimizers: list, host_refs: list) -> CallInputs:
    """What a call of a compiled step reads besides tensors, now: `optimizers` (weak references to
    the optimizers its warm-up saw step) and `host_refs` (to the CPU tensors it read)."""
    guard, slots, values = [], [], []
    for ref in optimizers:
        opt = ref()
        if opt is None:
            guard.append(None)
            continue
        device_index = optimizer_device_index(opt)
        for group in opt.param_groups:
            g = []
            for k, v in group.items():
                if k == "params":
                    continue
                if k in LIFTED_HYPERPARAMETERS and _is_host_number(v):
                    slots.append((group, k, device_index))
                    values.append(float(v))
                    g.append((k, "lifted"))
                else:
                    g.append((k, _guard_value(v)))
            guard.append(tuple(g))
    host = []
    for ref in host_refs:
        t = ref()
        if t is None:
            raise RuntimeError(
                "torchtpu.compile: a CPU tensor the step read during its first call no longer exists; "
                "make it a long-lived tensor (or move it to tpu and pass it as an argument)"
            )
        host.append(t)
    return CallInputs(tuple(guard), slots, values, host)
