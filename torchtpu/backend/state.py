"""The dispatcher's process state: configuration, counters, and whether ops are being traced.

Everything that changes how an op runs without being one of its arguments lives here, so
that the dispatcher, torchtpu.compile, AOT compilation and the torch.compile backend read and
set it in one way:

- `CONFIG`: debug mode, CPU fallback, synchronous dispatch (see `note_mesh`);
- `STATS`: the eager executable cache counters;
- `tracing()`: the context in which ops call their lowerings directly on tracers (inside a
  compiled program or a traced decomposition) instead of launching one executable each;
- `observing()`: observers of storage reads and creations and of CPU tensors read by tpu ops,
  which torchtpu.compile installs to find a step's state (None when unused, which keeps the
  eager hot path free of them).
"""

from __future__ import annotations

import contextlib
import os
import threading


class _State(threading.local):
    def __init__(self):
        self.trace_depth = 0


STATE = _State()


class CacheStats:
    """Eager executable cache counters. A miss is a trace + compile of a new signature."""

    def __init__(self):
        self.misses = 0
        self.calls = 0

    def snapshot(self) -> dict:
        return {"hits": self.calls - self.misses, "misses": self.misses, "calls": self.calls}

    def reset(self):
        self.misses = self.calls = 0


STATS = CacheStats()
LOG_RECOMPILES = bool(os.environ.get("TORCHTPU_LOG_RECOMPILES"))


EAGER_MODES = ("strict", "fused", "debug")


def _mode_from_environment() -> str:
    mode = os.environ.get("TORCHTPU_EAGER_MODE") or ("debug" if os.environ.get("TORCHTPU_DEBUG") else "strict")
    if mode not in EAGER_MODES:
        raise ValueError(f"TORCHTPU_EAGER_MODE={mode!r}: choose one of {', '.join(EAGER_MODES)}")
    return mode


class Config:
    # the eager mode (backend.fused.set_eager_mode): `debug` checks every op's result, `fused`
    # records ops for backend.fused
    eager_mode = _mode_from_environment()
    debug = eager_mode == "debug"
    fused = eager_mode == "fused"
    cpu_fallback = bool(os.environ.get("TORCHTPU_CPU_FALLBACK"))
    # XLA:CPU runs the collectives of programs over several host devices with a rendezvous
    # that can deadlock when many such programs are in flight at once (async dispatch). Once
    # a device mesh exists on the CPU platform, eager ops therefore wait for their results.
    sync_dispatch = False
    mesh_active = False  # a device mesh exists: in-place writes keep mesh layouts

    # whether an eager op needs more than the strict hot path (handlers.dispatch): the debug or
    # fused mode, synchronous dispatch, or an observer (Hooks); kept current on every setting
    eager_extras = debug or fused

    def set_mode(self, mode: str) -> None:
        self.eager_mode = mode
        self.debug = mode == "debug"
        self.fused = mode == "fused"

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name != "eager_extras":
            _note_extras()


CONFIG = Config()


def note_mesh(jax_mesh) -> None:
    """Arrays laid out over `jax_mesh` exist after this call (see Config)."""
    if jax_mesh.size > 1:
        CONFIG.mesh_active = True
        if jax_mesh.devices.flat[0].platform == "cpu":
            CONFIG.sync_dispatch = True


class Hooks:
    """Observers used by torchtpu.compile; set them with `observing()`."""

    read = None  # callable(storage, array) -> array: a storage read by an op
    host = None  # callable(cpu tensor) -> array: a CPU tensor read by a tpu op
    create = None  # callable(storage): a storage was made

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        _note_extras()


HOOKS = Hooks()


def _note_extras() -> None:
    hooks = globals().get("HOOKS")
    observed = hooks is not None and (hooks.read is not None or hooks.host is not None or hooks.create is not None)
    CONFIG.eager_extras = bool(CONFIG.debug or CONFIG.fused or CONFIG.sync_dispatch or observed)


def is_tracing() -> bool:
    """Whether ops run on tracers now (inside a compiled program or a traced decomposition)."""
    return STATE.trace_depth > 0


@contextlib.contextmanager
def observing(read=None, host=None, create=None):
    """Install storage observers (see Hooks) for the duration of the block."""
    prev = HOOKS.read, HOOKS.host, HOOKS.create
    HOOKS.read, HOOKS.host, HOOKS.create = read, host, create
    try:
        yield
    finally:
        HOOKS.read, HOOKS.host, HOOKS.create = prev


class _TraceDepth:
    # a class, not a generator: entered by every traced decomposition
    def __enter__(self):
        STATE.trace_depth += 1

    def __exit__(self, *exc):
        STATE.trace_depth -= 1


_TRACE_DEPTH = _TraceDepth()


def tracing():
    """A context in which ops call their lowerings directly: their array arguments are
    tracers of an enclosing JAX trace."""
    return _TRACE_DEPTH
