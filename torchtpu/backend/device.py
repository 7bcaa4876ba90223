"""`tpu` as a PyTorch device: PrivateUse1 registration and the `torch.tpu` module."""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
import types
import weakref

import jax
import torch

from . import random as tpu_random
from .tensor import new_empty

_registered = False


@functools.lru_cache(maxsize=1)
def _devices():
    return jax.devices()


def device_count() -> int:
    """The number of tpu devices: every device of the job once JAX runs. Before that, in a process
    that is to join a multi-process job (WORLD_SIZE > 1: torchrun, torchtpu-launch), this host's
    own devices, counted without starting JAX, so that `torch.accelerator.device_count()` or
    `set_device_index(local_rank)` before `init_process_group` leave the join possible."""
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _host_device_count()
    return len(_devices())


def _host_device_count() -> int:
    from .._platform import has_tpu_chips

    if has_tpu_chips() and os.environ.get("JAX_PLATFORMS", "tpu") != "cpu":
        return len(glob.glob("/dev/accel*")) or len(glob.glob("/dev/vfio/[0-9]*")) or 1
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else 1


class _DeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


_current = [0]


def _index(device) -> int:
    if device is None:
        return _current[0]
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    return _current[0] if device.index is None else device.index


def _check_index(i: int) -> int:
    n = device_count()
    if not 0 <= i < n:
        raise RuntimeError(f"tpu:{i} does not exist: this process has {n} tpu device(s) (tpu:0..tpu:{n - 1})")
    return i


def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    i = _check_index(_index(device))
    return new_empty(tuple(size), dtype or torch.get_default_dtype(), i)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    i = _check_index(_index(device))
    return new_empty(tuple(size), dtype or torch.get_default_dtype(), i, strides=tuple(stride))


def _copy_from(self, dst, non_blocking=False):
    from .transfer import copy_tensor

    copy_tensor((dst, self), {})
    return dst


# CPU tensors made by pin_memory(): host buffers staged for tpu transfers. XLA copies from any
# host buffer, so pinning is a contiguous copy; is_pinned() answers for the copies it made.
_pinned: weakref.WeakSet = weakref.WeakSet()


def _pin_memory_cpu(self, device=None):
    out = self.clone(memory_format=torch.contiguous_format)
    _pinned.add(out)
    return out


def _is_pinned_cpu(self, device=None) -> bool:
    return any(t.untyped_storage().data_ptr() == self.untyped_storage().data_ptr() for t in list(_pinned))


def device_memory_stats(device: jax.Device) -> dict:
    """The memory counters of one jax device: its allocator's own statistics where the runtime
    keeps them (TPU, GPU), else {"bytes_in_use": bytes of the live arrays' shards on it} (XLA's
    CPU client reports nothing). The one per-device counter: torch.tpu and the trainer read it."""
    try:
        stats = device.memory_stats()
    except Exception:
        stats = None
    if stats:
        return dict(stats)
    live = 0
    for a in jax.live_arrays():
        try:
            for shard in a.addressable_shards:
                if shard.device == device:
                    live += shard.data.nbytes
        except Exception:
            continue
    return {"bytes_in_use": live}


def _memory_stats(device=None) -> dict:
    return device_memory_stats(_devices()[_index(device)])


def _build_module() -> types.ModuleType:
    m = types.ModuleType("torch.tpu", "The tpu device (torchtpu): mirrors torch.cuda.")

    def is_available() -> bool:
        return device_count() > 0

    def is_initialized() -> bool:
        return True

    def current_device() -> int:
        return _current[0]

    def set_device(device) -> None:
        _current[0] = _check_index(_index(device))

    def synchronize(device=None) -> None:
        for a in jax.live_arrays():
            a.block_until_ready()

    def manual_seed(seed: int) -> None:
        tpu_random.generator(_current[0]).manual_seed(seed)

    def manual_seed_all(seed: int) -> None:
        for i in range(device_count()):
            tpu_random.generator(i).manual_seed(seed)

    def seed() -> None:
        import random

        manual_seed(random.getrandbits(63))

    def seed_all() -> None:
        import random

        manual_seed_all(random.getrandbits(63))

    def initial_seed() -> int:
        return tpu_random.generator(_current[0]).seed

    def get_rng_state(device="tpu") -> torch.Tensor:
        return tpu_random.generator(_index(device)).get_state()

    def set_rng_state(new_state, device="tpu") -> None:
        tpu_random.generator(_index(device)).set_state(new_state)

    def get_rng_state_all():
        return [get_rng_state(i) for i in range(device_count())]

    def set_rng_state_all(states) -> None:
        for i, s in enumerate(states):
            set_rng_state(s, i)

    def get_amp_supported_dtype():
        return [torch.bfloat16, torch.float16]

    def memory_stats(device=None) -> dict:
        return _memory_stats(device)

    def memory_allocated(device=None) -> int:
        return int(_memory_stats(device).get("bytes_in_use", 0))

    def max_memory_allocated(device=None) -> int:
        s = _memory_stats(device)
        return int(s.get("peak_bytes_in_use", s.get("bytes_in_use", 0)))

    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated

    def mem_get_info(device=None):
        s = _memory_stats(device)
        total = int(s.get("bytes_limit", 0))
        return (total - int(s.get("bytes_in_use", 0)), total)

    def get_device_name(device=None) -> str:
        return _devices()[_index(device)].device_kind

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return True

    def init() -> None:
        return None

    _lazy_init = init

    # XLA orders a device's work itself: one stream per device, events complete at once. The
    # generic torch.Stream/torch.Event answer through the device guard (FSDP, DataLoader and
    # torch.distributed ask the device module for these).
    Stream = torch.Stream
    Event = torch.Event

    def current_stream(device=None) -> torch.Stream:
        return torch.accelerator.current_stream(_index(device))

    default_stream = current_stream

    def set_stream(stream) -> None:
        torch.accelerator.set_stream(stream)

    def stream(stream):
        return contextlib.nullcontext() if stream is None else stream

    def empty_cache() -> None:
        return None

    def reset_peak_memory_stats(device=None) -> None:
        return None

    def _is_in_bad_fork() -> bool:
        return False

    class device:
        """Context manager that changes the current tpu device."""

        def __init__(self, dev):
            self.idx = _index(dev)

        def __enter__(self):
            self.prev = _current[0]
            _current[0] = self.idx

        def __exit__(self, *exc):
            _current[0] = self.prev

    for name, fn in list(locals().items()):
        if name not in ("m",) and not name.startswith("__"):
            setattr(m, name, fn)
    m.device_count = device_count
    # torch.utils.checkpoint saves and restores a device's RNG state around recomputation only
    # when its module says it is initialised: without this, recomputed dropout draws new masks.
    m._initialized = True
    return m


def _route_accelerator_api(m: types.ModuleType) -> None:
    """Make `torch.accelerator`'s memory and synchronisation calls answer for tpu.

    Once tpu is the accelerator, PyTorch's `torch.accelerator.synchronize/empty_cache/memory_*`
    go to C++ that expects a caching device allocator, which a Python backend has none of: they
    raise internal asserts, and `empty_host_cache()` can crash the process at shutdown (vLLM
    calls it there). They answer from torch.tpu instead. The device holds no allocator cache to
    empty (XLA frees a buffer when its last array goes), so the empty_* calls do nothing."""
    acc = torch.accelerator

    def nothing(*args, **kwargs) -> None:
        return None

    def peak(device_index=None) -> int:
        return m.max_memory_allocated(device_index)

    routes = {
        "synchronize": lambda device_index=None: m.synchronize(device_index),
        "empty_cache": nothing,
        "empty_host_cache": nothing,
        "reset_peak_memory_stats": nothing,
        "reset_accumulated_memory_stats": nothing,
        "memory_stats": lambda device_index=None: m.memory_stats(device_index),
        "memory_allocated": lambda device_index=None: m.memory_allocated(device_index),
        "memory_reserved": lambda device_index=None: m.memory_allocated(device_index),
        "max_memory_allocated": peak,
        "max_memory_reserved": peak,
        "get_memory_info": lambda device_index=None: m.mem_get_info(device_index),
    }
    for name, fn in routes.items():
        if hasattr(acc, name):
            setattr(acc, name, fn)


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    torch.utils.rename_privateuse1_backend("tpu")
    torch.utils.generate_methods_for_privateuse1_backend()
    module = _build_module()
    torch._register_device_module("tpu", module)
    _route_accelerator_api(module)
    torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_DeviceGuard())
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    # torch.tensor(data, device="tpu") and x[[1, 2]] copy with the Python key excluded
    lib.impl("_copy_from", _copy_from, "PrivateUse1")
    # Tensor.pin_memory() (DataLoader(pin_memory=True)) asks the accelerator's hooks for a pinned
    # allocator, which a Python backend cannot provide: answer at the CPU kernels instead.
    lib.impl("_pin_memory", _pin_memory_cpu, "CPU")
    lib.impl("is_pinned", _is_pinned_cpu, "CPU")
    register._lib = lib  # keep the registrations alive
    from . import autocast, module_moves

    module_moves.install()
    autocast.register()
