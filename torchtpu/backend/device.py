"""`tpu` as a PyTorch device: PrivateUse1 registration and the `torch.tpu` module."""

from __future__ import annotations

import contextlib
import functools
import os
import time
import types
import weakref

import jax
import torch

import torchtpu_autoload as autoload

from .. import _platform
from . import fused
from . import random as tpu_random
from . import tensor as tpu_tensor
from .tensor import new_empty

_registered = False


@functools.lru_cache(maxsize=1)
def _devices():
    return jax.devices()


def device_count() -> int:
    """The number of tpu devices: every device of the job once JAX runs. Before that, in a process
    that is to join a multi-process job (WORLD_SIZE > 1: torchrun, torchtpu-launch), this host's
    own devices, counted without starting JAX, so that `torch.accelerator.device_count()` or
    `set_device_index(local_rank)` before `init_process_group` leave the join possible. Under
    torchrun's one-chip-per-process rule (see `_platform.own_chip_rank`), the host's ranks: as
    `torch.cuda.device_count()` counts a host's GPUs for every rank."""
    from jax._src import xla_bridge

    if _OWN is not None:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if not xla_bridge.backends_are_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _platform.host_device_count()
    return len(_devices())


# LOCAL_RANK under torchrun's one-chip-per-process rule, else None: the user's tpu:LOCAL_RANK is
# this process's device, internal index 0 (tensor.set_own_index).
_OWN = _platform.own_chip_rank()
tpu_tensor.set_own_index(_OWN)


_current = [0]  # the current device's internal index (tensor.internal_index)


def _index(device) -> int:
    """The internal index of a device argument (None: the current device)."""
    if device is None:
        return _current[0]
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.index is None:
            return _current[0]
        device = device.index
    return tpu_tensor.internal_index(device)


def _indices() -> range:
    """The internal indices of this process's devices."""
    return range(1) if _OWN is not None else range(device_count())


def _check_index(i: int) -> int:
    if i == 0:  # the process's first device, which exists wherever JAX runs
        return 0
    n = len(_indices())
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


def mark_pinned(t: torch.Tensor) -> None:
    """Make `t.is_pinned()` true: `t` is a CPU tensor staged for tpu transfers."""
    _pinned.add(t)


def _pin_memory_cpu(self, device=None):
    out = self.clone(memory_format=torch.contiguous_format)
    mark_pinned(out)
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


def _jax_device(device=None):
    return tpu_tensor.jax_device(_check_index(_index(device)))


# Peak tracking for reset_peak_memory_stats: per internal index, XLA's own peak counter when the
# peak was reset (None: never reset) and the largest reading taken since.
_PEAKS: dict[int, list] = {}


def _memory_stats(device=None) -> dict:
    """torch.cuda.memory_stats' keys for one tpu device, from XLA's allocator statistics.

    `allocated_bytes.all.current` / `active_bytes.all.current` / `reserved_bytes.all.current`: the
    bytes in use (XLA's `bytes_in_use`; on XLA's CPU devices, which keep no statistics, the bytes of
    the live arrays' shards there). `*.peak`: XLA's `peak_bytes_in_use` where the runtime keeps one
    and it has grown since the last reset_peak_memory_stats; otherwise the largest `current` read
    by these calls since that reset, a lower bound of the true peak. `allocation.all.current`: XLA's
    `num_allocs` where kept. XLA counts no allocation retries or out-of-memory errors, so
    `num_alloc_retries` and `num_ooms` are absent. XLA's own keys (`bytes_in_use`, `bytes_limit`,
    ...) are kept beside them. In fused eager mode the ops recorded so far run first: their outputs
    are allocated when they are launched, as a CUDA kernel's outputs are."""
    fused.flush()
    i = _index(device)
    raw = device_memory_stats(_jax_device(device))
    current = int(raw.get("bytes_in_use", 0))
    base_peak, seen = _PEAKS.setdefault(i, [None, 0])
    seen = max(seen, current)
    _PEAKS[i][1] = seen
    xla_peak = raw.get("peak_bytes_in_use")
    if xla_peak is not None and (base_peak is None or xla_peak > base_peak):
        peak = int(xla_peak)
    else:
        peak = seen
    out = dict(raw)
    for kind in ("allocated_bytes", "active_bytes", "reserved_bytes"):
        out[f"{kind}.all.current"] = current
        out[f"{kind}.all.peak"] = peak
    if "num_allocs" in raw:
        out["allocation.all.current"] = int(raw["num_allocs"])
    return out


def _reset_peak(device=None) -> None:
    fused.flush()  # what was recorded before the reset counts before it
    i = _index(device)
    raw = device_memory_stats(_jax_device(device))
    current = int(raw.get("bytes_in_use", 0))
    _PEAKS[i] = [raw.get("peak_bytes_in_use", -1), current]


def _total_memory(device=None) -> int:
    """XLA's `bytes_limit` for the device; on XLA's CPU devices, which report none, the host's
    physical memory, which all of them share."""
    limit = device_memory_stats(_jax_device(device)).get("bytes_limit")
    if limit:
        return int(limit)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class DeviceProperties:
    """What `torch.tpu.get_device_properties` answers (the fields torch.cuda's reader use that a
    TPU has): `name` (XLA's device kind, e.g. "TPU v5p"; "cpu" for XLA's CPU devices), `type`,
    `total_memory` (bytes, see _total_memory), `index`, `platform`, `core_count` (TensorCores per
    chip where JAX reports it)."""

    def __init__(self, device=None):
        d = _jax_device(device)
        self.name = d.device_kind
        self.type = "tpu"
        self.index = tpu_tensor.torch_device(_index(device)).index
        self.platform = d.platform
        self.total_memory = _total_memory(device)
        self.core_count = int(getattr(d, "num_cores", 0) or 1)

    def __repr__(self) -> str:
        return (
            f"_TpuDeviceProperties(name={self.name!r}, platform={self.platform!r}, "
            f"total_memory={self.total_memory // 2**20}MB, core_count={self.core_count})"
        )


def _synchronize(device=None) -> None:
    """Wait for every array computed or in flight on the device (XLA runs a device's programs in
    order, so this is CUDA's synchronize). Ops recorded in fused mode run first."""
    fused.flush()
    target = _jax_device(device)
    for a in jax.live_arrays():
        try:
            if target in a.devices():
                a.block_until_ready()
        except Exception:  # noqa: BLE001 - a deleted (donated) array has nothing to wait for
            continue


class Event(torch.Event):
    """torch.tpu.Event: a point in the device's work. XLA orders a device's programs itself (one
    stream per device); `record()` notes the arrays in flight on the device and `synchronize()`
    waits for them. With `enable_timing=True`, the time of a record is when that work finished
    (measured at `synchronize`, or at record when nothing is pending), so `elapsed_time` is the
    device time between two records plus the host's wait latency, in milliseconds."""

    def __new__(cls, enable_timing: bool = False, *args, **kwargs):  # torch.cuda.Event's arguments
        return super().__new__(cls, device="tpu", enable_timing=enable_timing)

    def __init__(self, enable_timing: bool = False, *args, **kwargs):
        self._timing = enable_timing
        self._pending: list = []
        self._time: float | None = None
        self._recorded = False

    def record(self, stream=None) -> None:
        fused.flush()  # the ops recorded in fused mode are work before this point
        target = tpu_tensor.jax_device(_current[0])
        pending = []
        for a in jax.live_arrays():
            try:
                if not a.is_ready() and target in a.devices():
                    pending.append(a)
            except Exception:  # noqa: BLE001 - deleted arrays
                continue
        self._pending = pending
        self._time = None if pending else time.perf_counter()
        self._recorded = True

    def query(self) -> bool:
        return all(a.is_ready() for a in self._pending if not a.is_deleted())

    def synchronize(self) -> None:
        for a in self._pending:
            if not a.is_deleted():
                a.block_until_ready()
        self._pending = []
        if self._time is None:
            self._time = time.perf_counter()

    def wait(self, stream=None) -> None:
        return None  # one stream per device: later work already follows this event's

    def elapsed_time(self, end_event: Event) -> float:
        if not (self._timing and end_event._timing):
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True")
        if not (self._recorded and end_event._recorded):
            raise RuntimeError("elapsed_time needs both events recorded")
        self.synchronize()
        end_event.synchronize()
        return (end_event._time - self._time) * 1000.0


def _fill_module(m: types.ModuleType) -> None:
    """Give `m` (torch.tpu: the autoload's stand-in, or a new module) torch.cuda's functions."""

    def is_available() -> bool:
        return device_count() > 0

    def is_initialized() -> bool:
        return True

    def current_device() -> int:
        return tpu_tensor.torch_device(_current[0]).index

    def set_device(device) -> None:
        _current[0] = _check_index(_index(device))

    def synchronize(device=None) -> None:
        _synchronize(device)

    def manual_seed(seed: int) -> None:
        tpu_random.generator(_current[0]).manual_seed(seed)

    def manual_seed_all(seed: int) -> None:
        for i in _indices():
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
        return [tpu_random.generator(i).get_state() for i in _indices()]

    def set_rng_state_all(states) -> None:
        for i, s in zip(_indices(), states):
            tpu_random.generator(i).set_state(s)

    def get_amp_supported_dtype():
        return [torch.bfloat16, torch.float16]

    def memory_stats(device=None) -> dict:
        return _memory_stats(device)

    def memory_allocated(device=None) -> int:
        return int(_memory_stats(device)["allocated_bytes.all.current"])

    def max_memory_allocated(device=None) -> int:
        return int(_memory_stats(device)["allocated_bytes.all.peak"])

    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated

    def mem_get_info(device=None):
        total = _total_memory(device)
        return (max(total - memory_allocated(device), 0), total)

    def get_device_name(device=None) -> str:
        return _jax_device(device).device_kind

    def get_device_properties(device=None) -> DeviceProperties:
        return DeviceProperties(device)

    def get_device_capability(device=None) -> tuple[int, int]:
        # CUDA's compute capability has no TPU meaning; (0, 0) fails every `>= (8, 0)`-style check
        # that would pick a CUDA-only kernel.
        return (0, 0)

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return True

    def init() -> None:
        return None

    _lazy_init = init

    # XLA orders a device's work itself: one stream per device. The generic torch.Stream answers
    # through the device guard (FSDP, DataLoader and torch.distributed ask the device module).
    Stream = torch.Stream

    def current_stream(device=None) -> torch.Stream:
        return torch.accelerator.current_stream(_index(device))

    default_stream = current_stream

    def set_stream(stream) -> None:
        torch.accelerator.set_stream(stream)

    def stream(stream):
        return contextlib.nullcontext() if stream is None else stream

    def empty_cache() -> None:
        return None  # XLA frees a buffer when its last array goes: no allocator cache to empty

    def reset_peak_memory_stats(device=None) -> None:
        _reset_peak(device)

    def reset_max_memory_allocated(device=None) -> None:
        _reset_peak(device)

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
    m.Event = Event
    # torch.utils.checkpoint saves and restores a device's RNG state around recomputation only
    # when its module says it is initialised: without this, recomputed dropout draws new masks.
    m._initialized = True


def _route_accelerator_api(m: types.ModuleType) -> None:
    """Make `torch.accelerator`'s memory and synchronisation calls answer for tpu.

    Once tpu is the accelerator, PyTorch's `torch.accelerator.synchronize/empty_cache/memory_*`
    and its current-device calls go to C++ that expects a caching device allocator, which a Python backend has none of: they
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
        "reset_peak_memory_stats": lambda device_index=None: m.reset_peak_memory_stats(device_index),
        "reset_accumulated_memory_stats": nothing,
        "memory_stats": lambda device_index=None: m.memory_stats(device_index),
        "memory_allocated": lambda device_index=None: m.memory_allocated(device_index),
        "memory_reserved": lambda device_index=None: m.memory_allocated(device_index),
        "max_memory_allocated": peak,
        "max_memory_reserved": peak,
        "get_memory_info": lambda device_index=None: m.mem_get_info(device_index),
        # a Python backend's C++ device guard keeps no current device: torch.tpu's is the one
        "current_device_index": lambda: m.current_device(),
        "current_device_idx": lambda: m.current_device(),
        "set_device_index": lambda device: m.set_device(device),
        "set_device_idx": lambda device: m.set_device(device),
    }
    for name, fn in routes.items():
        if hasattr(acc, name):
            setattr(acc, name, fn)


def register() -> None:
    """Make `tpu` a PyTorch device. What PyTorch's autoload (torchtpu_autoload) registered already,
    its name, hooks, `torch.tpu` module object and kernels, is completed, not registered again."""
    global _registered
    if _registered:
        return
    _registered = True
    autoload.register_name()
    module = autoload.DONE.get("module")
    if module is None:
        module = types.ModuleType("torch.tpu", "The tpu device (torchtpu): mirrors torch.cuda.")
        torch._register_device_module("tpu", module)
    _fill_module(module)
    _route_accelerator_api(module)
    if "kernels" not in autoload.DONE:
        # empty.*: every tpu tensor is born here; _copy_from: torch.tensor(data, device="tpu") and
        # x[[1, 2]] copy with the Python key excluded; _pin_memory / is_pinned: Tensor.pin_memory()
        # (DataLoader(pin_memory=True)) asks the accelerator's hooks for a pinned allocator, which a
        # Python backend cannot provide, so the CPU kernels answer instead.
        lib = torch.library.Library("aten", "IMPL")
        for op, key, kernel in autoload.KERNELS:
            lib.impl(op, globals()[kernel], key)
        register._lib = lib  # keep the registrations alive
    from . import autocast, module_moves

    module_moves.install()
    from . import rng_prims, serialization

    rng_prims.install()
    serialization.install()
    autocast.register()
    _optimizers_default_to_foreach()


def _optimizers_default_to_foreach() -> None:
    """torch.optim picks its foreach implementation by default for tensors of a type it lists (plain
    tensors; a Parameter on tpu is a TpuTensor) on a foreach device (PrivateUse1 is one): listed, the
    optimizers of a plain loop on tpu run one program per foreach op over every parameter, as on
    CUDA, instead of one per parameter and op."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    from .tensor import TpuTensor

    for types_ in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if TpuTensor not in types_:
            types_.append(TpuTensor)
