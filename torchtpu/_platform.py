"""Choose what backs the `tpu` device and configure JAX before any backend starts.

TPU chips are detected from device nodes so that libtpu is never initialised on a host
without them (it prints warnings about TPU_WORKER_HOSTNAMES there).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re

_VALID = ("tpu", "gpu", "cpu")


def launch_process(argv: list[str]) -> bool:
    """Whether the interpreter's command line `argv` (sys.orig_argv) runs torchtpu-launch: the
    `torchtpu-launch` command, `python -m torchtpu.launch` or a host's agent (`python -m
    torchtpu.launch.agent`). Such a process only starts and watches other processes; `import torchtpu`
    there starts neither JAX nor the backend (torchtpu/__init__.py)."""
    args = iter(argv[1:])
    for arg in args:
        if arg == "--check-hash-based-pycs":  # the one long option of Python's that takes a value
            next(args, None)
        elif arg == "-" or not arg.startswith("-"):  # a script (a console script such as torchtpu-launch)
            return os.path.basename(arg) == "torchtpu-launch"
        elif not arg.startswith("--"):
            for i, option in enumerate(arg[1:], 2):  # short options may share one argument: -um MODULE
                if option in "cmWX":  # these take a value: the rest of the argument, else the next one
                    value = arg[i:] or next(args, "")
                    if option == "c":
                        return False
                    if option == "m":
                        return value == "torchtpu.launch" or value.startswith("torchtpu.launch.")
                    break
    return False


def has_tpu_chips() -> bool:
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def host_device_count() -> int:
    """This process's devices, counted without starting JAX: the TPU chips it may use (all of the
    host's, or those TPU_VISIBLE_CHIPS names), else XLA's CPU devices (1 unless XLA_FLAGS forces
    more)."""
    if has_tpu_chips() and os.environ.get("JAX_PLATFORMS", "tpu") != "cpu":
        visible = os.environ.get("TPU_VISIBLE_CHIPS", "").strip()
        if visible:
            return len(visible.split(","))
        return len(glob.glob("/dev/accel[0-9]*")) or len(glob.glob("/dev/vfio/[0-9]*")) or 1
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else 1


def own_chip_rank() -> int | None:
    """LOCAL_RANK when this process follows torchrun's convention for CUDA scripts with one chip per
    process, else None.

    torchrun (torchelastic) starts LOCAL_WORLD_SIZE processes on a host and sets LOCAL_RANK; a
    script written for CUDA puts its tensors on `cuda:{LOCAL_RANK}` and calls `set_device`. When
    such a process owns one device (one TPU chip, see `torchrun_tpu_env`, or one XLA CPU device),
    `tpu:{LOCAL_RANK}` names that device, the current device starts there, and the other indices
    of the host are its siblings' chips, which the process cannot reach.
    """
    rank, ranks = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if rank is None or ranks is None or int(ranks) <= 1:
        return None
    return int(rank) if host_device_count() == 1 else None


def torchrun_tpu_env(env=os.environ) -> None:
    """On a TPU VM under torchrun with one process per chip (LOCAL_WORLD_SIZE equal to the host's
    chips), give each process its own chip before libtpu starts: libtpu's per-process chip
    variables, unless the user set TPU_VISIBLE_CHIPS. A single-host slice only: a pod's hosts are
    joined by JAX's own multi-host setup, one process per host (torchtpu-launch)."""
    rank, ranks = env.get("LOCAL_RANK"), env.get("LOCAL_WORLD_SIZE")
    if rank is None or ranks is None or "TPU_VISIBLE_CHIPS" in env or not has_tpu_chips():
        return
    chips = len(glob.glob("/dev/accel[0-9]*")) or len(glob.glob("/dev/vfio/[0-9]*"))
    bounds = {4: "2,2,1", 8: "2,4,1"}.get(chips)
    if int(ranks) != chips or bounds is None or int(env.get("WORLD_SIZE", ranks)) != chips:
        return
    port = 8476
    env["TPU_VISIBLE_CHIPS"] = rank
    env["TPU_CHIPS_PER_PROCESS_BOUNDS"] = "1,1,1"
    env["TPU_PROCESS_BOUNDS"] = bounds
    env["TPU_PROCESS_ADDRESSES"] = ",".join(f"localhost:{port + i}" for i in range(chips))
    env["TPU_PROCESS_PORT"] = str(port + int(rank))
    env["CLOUD_TPU_TASK_ID"] = rank


def _has_gpu_plugin() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


def requested_platform() -> str | None:
    value = os.environ.get("TORCHTPU_PLATFORM", "").strip().lower()
    if not value:
        return None
    if value == "cuda":
        value = "gpu"
    if value not in _VALID:
        raise ValueError(
            f"TORCHTPU_PLATFORM={value!r} is not a platform torchtpu knows; use one of {', '.join(_VALID)}"
        )
    return value


def configure_jax() -> None:
    """Pick the JAX platform (unless the user already pinned one) and enable 64-bit types.

    64-bit types are on so that float64/int64 tensors mean what they mean in PyTorch.
    """
    import jax

    jax.config.update("jax_enable_x64", True)
    torchrun_tpu_env()
    _count_compiles()
    _share_mlir_contexts()
    configure_persistent_cache()
    if os.environ.get("JAX_PLATFORMS"):
        return
    want = requested_platform()
    if want is None:
        if has_tpu_chips():
            want = "tpu"
        elif _has_gpu_plugin():
            want = "gpu"
        else:
            want = "cpu"
    jax_name = {"tpu": "tpu", "gpu": "cuda", "cpu": "cpu"}[want]
    try:
        jax.config.update("jax_platforms", jax_name if want == "cpu" else f"{jax_name},cpu")
    except RuntimeError:
        # Backends already initialised by the user's own jax code; keep what they chose.
        pass


# How many programs one MLIR context lowers before a new one takes its place (_share_mlir_contexts).
MLIR_CONTEXT_PROGRAMS = 256


def _share_mlir_contexts() -> None:
    """Lower JAX programs into one MLIR context, renewed every MLIR_CONTEXT_PROGRAMS programs,
    instead of a new context per program.

    JAX makes a context for each program it lowers and loads every dialect into it: about 3.5 ms
    of CPU per program, more than the rest of lowering a small one (2.2 ms). Eager mode lowers a
    program per op signature, so a model's first steps and PyTorch's OpInfo tests pay it thousands
    of times. A context keeps every type and attribute its programs used for as long as it lives;
    renewing it bounds that. Only the contexts of whole programs (JAX's ModuleContext) are shared;
    a Pallas kernel is lowered into its program's. If JAX's internals change shape, this does
    nothing and every program gets its own context again."""
    try:
        from jax._src.interpreters import mlir
    except ImportError:
        return
    import inspect
    import threading

    init = getattr(getattr(mlir, "ModuleContext", None), "__init__", None)
    make = getattr(mlir, "make_ir_context", None)
    if init is None or make is None or getattr(init, "_torchtpu", False):
        return
    if "context" not in inspect.signature(init).parameters:
        return
    lock = threading.Lock()
    current = [None, 0]  # the shared context, and the programs lowered into it

    def shared_context():
        with lock:
            if current[0] is None or current[1] >= MLIR_CONTEXT_PROGRAMS:
                current[0], current[1] = make(), 0
            current[1] += 1
            return current[0]

    def module_context_init(self, *args, context=None, **kwargs):
        init(self, *args, context=shared_context() if context is None else context, **kwargs)

    module_context_init._torchtpu = True
    mlir.ModuleContext.__init__ = module_context_init


_CACHE_STATS = {"hits": 0, "misses": 0}
XLA_COMPILES = [0]  # programs this process compiled or loaded from the persistent cache (JAX times both as one event)


def _count_compiles():
    import jax

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            XLA_COMPILES[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)


def cache_dir() -> str | None:
    """Where compiled XLA executables persist across processes (None when disabled).

    Default: $XDG_CACHE_HOME/torchtpu/xla (~/.cache/torchtpu/xla). TORCHTPU_CACHE_DIR sets
    another folder; TORCHTPU_CACHE_DIR=off (or 0, none) disables the cache.
    """
    value = os.environ.get("TORCHTPU_CACHE_DIR")
    if value is not None and value.strip().lower() in ("", "0", "off", "none", "false"):
        return None
    if value:
        return os.path.abspath(os.path.expanduser(value))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchtpu", "xla")


def cache_root() -> str | None:
    """The folder of torchtpu's caches (None when TORCHTPU_CACHE_DIR turns them off): the folder
    TORCHTPU_CACHE_DIR names, else $XDG_CACHE_HOME/torchtpu (~/.cache/torchtpu)."""
    xla_dir = cache_dir()
    if xla_dir is None:
        return None
    return xla_dir if os.environ.get("TORCHTPU_CACHE_DIR") else os.path.dirname(xla_dir)


def configure_persistent_cache() -> None:
    import jax

    path = cache_dir()
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return  # read-only home: run without a persistent cache
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    def listen(event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            _CACHE_STATS["hits"] += 1
        elif event == "/jax/compilation_cache/cache_misses":
            _CACHE_STATS["misses"] += 1

    jax.monitoring.register_event_listener(listen)
    _cache_from_every_cpu_process()


_CACHE_WRITE_ARGS = ("cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks")


def _cache_from_every_cpu_process() -> None:
    """Let every process of a multi-process job on the CPU backend write its compiled programs.

    JAX writes persistent-cache entries from process 0 only: on a TPU pod every process compiles
    the same key, and one writer is enough. On the CPU backend the key also hashes each process's
    own topology, so the keys of processes 1.. differ from process 0's; never written, their
    programs were compiled again by every run, resume and restart (in a 2-host `torchtpu-launch
    local` job of the debug model, ~50 s of compiling on host 1 while host 0 waited at its first
    collective). Their keys are distinct, so the writers do not contend. If JAX's internals change
    shape, this does nothing and those processes compile their programs on every run.
    """
    try:
        from jax._src import compilation_cache, compiler, distributed
    except ImportError:
        return
    import inspect

    jax_write = getattr(compiler, "_cache_write", None)
    if jax_write is None or getattr(jax_write, "_torchtpu", False):
        return
    if list(inspect.signature(jax_write).parameters) != list(_CACHE_WRITE_ARGS) or not hasattr(
        compilation_cache, "put_executable_and_time"
    ):
        return

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        import jax

        if distributed.global_state.process_id == 0 or getattr(backend, "platform", None) != "cpu":
            return jax_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        if host_callbacks or compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
            return None
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        except Exception as ex:  # noqa: BLE001 - a cache that cannot be written costs time, not results
            import warnings

            warnings.warn(
                f"torchtpu: could not write the compilation cache entry of {module_name!r}: {ex}", stacklevel=2
            )
        return None

    cache_write._torchtpu = True
    compiler._cache_write = cache_write


def persistent_cache_stats() -> dict:
    """Persistent compilation cache: hits and misses in this process, and files/bytes on disk.
    JAX records a miss when it writes an entry, so `misses` counts the programs this process wrote
    (a compile too small or too fast to be written is not counted)."""
    path = cache_dir()
    files = size = 0
    if path and os.path.isdir(path):
        for entry in os.scandir(path):
            if entry.is_file():
                files += 1
                size += entry.stat().st_size
    return {"dir": path, "hits": _CACHE_STATS["hits"], "misses": _CACHE_STATS["misses"], "files": files, "bytes": size}


def platform() -> str:
    """The platform backing the `tpu` device: 'tpu', 'gpu' or 'cpu'."""
    import jax

    return jax.devices()[0].platform
