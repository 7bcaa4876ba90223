"""PyTorch's device-backend autoload for torchtpu: `import torch` finds the `tpu` device.

PyTorch calls `load()` (the `torch.backends` entry point in pyproject.toml) at the end of `import
torch`, unless `TORCH_DEVICE_BACKEND_AUTOLOAD=0`. It costs what `import torch` alone costs plus a
few milliseconds: this module imports torch only, never `torchtpu` (whose import starts JAX and
loads the op table, about 3 s). It names the PrivateUse1 backend `tpu`, tells PyTorch's
accelerator API that the device exists, and registers stand-ins that import torchtpu the first
time the device is used:

- `torch.tpu`: a module whose `is_available()` answers at once and whose every other attribute
  imports torchtpu, which fills the same module object with the real functions;
- the PrivateUse1 kernels every tpu tensor is born from (`empty.memory_format`, `empty_strided`,
  `_copy_from`) and the CPU pinning kernels (`DataLoader(pin_memory=True)` pins through the
  accelerator once one exists): each imports torchtpu, then calls torchtpu's own kernel.

So `torch.tpu.is_available()`, `torch.device("tpu")` and `torch.accelerator.current_accelerator()`
start nothing, and the first tensor, `torch.tpu.set_device`, `torch.autocast("tpu")` or
`torch.compile(backend="tpu")` loads the device. `import torchtpu` does the same registration
itself when autoload is off.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import types

import torch

NAME = "tpu"
# What load() registered, so that torchtpu.backend.device.register() does not register it twice.
DONE: dict[str, object] = {}


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """PyTorch's accelerator hooks for tpu (torch.accelerator, the autograd engine)."""

    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


_PRIVATE_USE_1 = torch._C._autograd.DeviceType.PrivateUse1


class _DeviceGuard(torch._C._acc.DeviceGuard):
    # PyTorch's C++ asks this for every device and stream it looks up (the autograd engine, for
    # each node of a backward pass on tpu: about a thousand calls a step of a small Llama), so it
    # returns a constant
    def type_(self):
        return _PRIVATE_USE_1


class LazyDeviceModule(types.ModuleType):
    """`torch.tpu` before the device is first used: `is_available()` answers, any other name loads
    torchtpu (which sets the real attributes on this same object) and is then read again."""

    def is_available(self) -> bool:
        return True

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        _load_torchtpu()
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(f"module 'torch.tpu' has no attribute {name!r}") from None


def _load_torchtpu():
    return importlib.import_module("torchtpu")


def _forward(kernel: str):
    """A kernel that loads torchtpu, then runs torchtpu.backend.device's `kernel`."""

    target = []  # the kernel, once loaded (every tpu tensor is born through here: no import per call)

    def run(*args, **kwargs):
        if target:
            return target[0](*args, **kwargs)
        if kernel == "_is_pinned_cpu" and "torchtpu.backend.device" not in sys.modules:
            return False  # nothing is pinned before the device is loaded: no need to load it
        _load_torchtpu()
        target.append(getattr(importlib.import_module("torchtpu.backend.device"), kernel))
        return target[0](*args, **kwargs)

    run.__name__ = kernel
    return run


def compile_backend(gm, example_inputs, **kwargs):
    """`torch.compile(backend="tpu")` before torchtpu is loaded (the `torch_dynamo_backends` entry
    point): loads torchtpu and compiles with its backend."""
    _load_torchtpu()
    return importlib.import_module("torchtpu.backend.dynamo").tpu_backend(gm, example_inputs, **kwargs)


# (op, dispatch key, torchtpu.backend.device's kernel)
KERNELS = (
    ("empty.memory_format", "PrivateUse1", "_empty_memory_format"),
    ("empty_strided", "PrivateUse1", "_empty_strided"),
    ("_copy_from", "PrivateUse1", "_copy_from"),
    ("_pin_memory", "CPU", "_pin_memory_cpu"),
    ("is_pinned", "CPU", "_is_pinned_cpu"),
)


def _loaded() -> bool:
    return "torchtpu.backend.device" in sys.modules


def _nothing_yet(answer, name: str):
    """A torch.accelerator call before the device is loaded: no tpu array exists yet, so the
    answer is `answer`; once loaded, torch.tpu's own answer (torchtpu.backend.device replaces
    these routes when it loads, this one covers a reference taken before)."""

    def route(*args, **kwargs):
        if not _loaded():
            return answer() if callable(answer) else answer
        return getattr(torch.accelerator, name)(*args, **kwargs)

    route.__name__ = name
    return route


def _loading(name: str):
    """A torch.accelerator call that needs the device: loads torchtpu, then asks it."""

    def route(*args, **kwargs):
        _load_torchtpu()
        return getattr(torch.accelerator, name)(*args, **kwargs)

    route.__name__ = name
    return route


def _current_index() -> int:
    if "LOCAL_RANK" in os.environ:  # torchrun's rank may own tpu:{LOCAL_RANK}: the device says
        return _loading("current_device_index")()
    return 0


def _route_accelerator() -> None:
    """torch.accelerator's memory and device calls for tpu go to C++ that expects a caching device
    allocator, which a Python backend has none of (an internal assert, or a crash at exit): until
    the device loads they answer that nothing is allocated; torchtpu routes them to torch.tpu."""
    routes = {
        "synchronize": _nothing_yet(None, "synchronize"),
        "empty_cache": _nothing_yet(None, "empty_cache"),
        "empty_host_cache": _nothing_yet(None, "empty_host_cache"),
        "reset_peak_memory_stats": _nothing_yet(None, "reset_peak_memory_stats"),
        "reset_accumulated_memory_stats": _nothing_yet(None, "reset_accumulated_memory_stats"),
        "memory_stats": _nothing_yet(dict, "memory_stats"),
        "memory_allocated": _nothing_yet(0, "memory_allocated"),
        "memory_reserved": _nothing_yet(0, "memory_reserved"),
        "max_memory_allocated": _nothing_yet(0, "max_memory_allocated"),
        "max_memory_reserved": _nothing_yet(0, "max_memory_reserved"),
        "get_memory_info": _loading("get_memory_info"),
        "current_device_index": _nothing_yet(_current_index, "current_device_index"),
        "current_device_idx": _nothing_yet(_current_index, "current_device_idx"),
        "set_device_index": _loading("set_device_index"),
        "set_device_idx": _loading("set_device_idx"),
    }
    for name, fn in routes.items():
        if hasattr(torch.accelerator, name):
            setattr(torch.accelerator, name, fn)


def _names_tpu(map_location) -> bool:
    if isinstance(map_location, str):
        return map_location.startswith(NAME)
    if isinstance(map_location, torch.device):
        return map_location.type == NAME
    if isinstance(map_location, dict):
        return any(_names_tpu(v) for v in map_location.values())
    return False


def _route_load() -> None:
    """`torch.load(f, map_location="tpu")` before the device is loaded: PyTorch would allocate each
    storage with the device's C++ allocator, which a Python backend has none of (a segfault).
    torchtpu's torch.load (backend/serialization.py) reads onto the CPU and moves the tensors."""
    original = torch.load

    @functools.wraps(original)
    def load(f, map_location=None, *args, **kwargs):
        if _names_tpu(map_location):
            _load_torchtpu()
            if torch.load is not load:
                return torch.load(f, map_location, *args, **kwargs)
        return original(f, map_location, *args, **kwargs)

    torch.load = load
    torch.serialization.load = load


def register_name() -> None:
    """Name the PrivateUse1 backend `tpu` and give it hooks, a device guard and `Tensor.tpu()`-style
    methods (torch only; idempotent)."""
    if "name" in DONE:
        return
    torch.utils.rename_privateuse1_backend(NAME)
    torch.utils.generate_methods_for_privateuse1_backend()
    torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_DeviceGuard())
    DONE["name"] = True


def load() -> None:
    """The `torch.backends` entry point."""
    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", NAME):
        return  # another out-of-tree device holds PrivateUse1: leave it (import torchtpu says so)
    register_name()
    if "module" not in DONE:
        module = LazyDeviceModule("torch.tpu", "The tpu device (torchtpu): mirrors torch.cuda.")
        torch._register_device_module(NAME, module)
        DONE["module"] = module
    if "routes" not in DONE:
        _route_accelerator()
        _route_load()
        DONE["routes"] = True
    if "kernels" not in DONE:
        lib = torch.library.Library("aten", "IMPL")
        for op, key, kernel in KERNELS:
            lib.impl(op, _forward(kernel), key)
        DONE["kernels"] = lib  # keeps the registrations alive
