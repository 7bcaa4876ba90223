"""torchtpu: Google TPUs as a first-class PyTorch device.

import torch, torchtpu
x = torch.randn(4, 4, device="tpu")
"""

import contextlib as _contextlib
import sys as _sys

from ._platform import launch_process as _launch_process

__version__ = "0.1.0"

if _launch_process(_sys.orig_argv):
    # The torchtpu-launch command and its host agents only start and watch the training processes:
    # there `import torchtpu` (by torchtpu.launch and the modules it reads) starts neither JAX nor the
    # backend, which would cost each such process about 2 CPU seconds.

    def __getattr__(name: str):
        raise AttributeError(
            f"torchtpu.{name}: this process runs torchtpu-launch, which starts no tpu device; "
            "use torchtpu in the training command it launches"
        )

else:
    import gc as _gc

    # Importing torch, JAX and the op table allocates about half a million long-lived objects: with the
    # cyclic collector on, allocation triggers full collections that walk them all, and every later
    # full collection (during training, and at interpreter exit) walks them again. Collect nothing
    # while importing, then move what exists into the collector's permanent generation (gc.freeze):
    # objects freed by reference counting are still freed; only cycles among them are left alone.
    _gc_was_enabled = _gc.isenabled()
    _gc.disable()
    try:
        from ._platform import configure_jax as _configure_jax

        _configure_jax()

        import torch

        from . import backend as _backend
        from .backend import transfer as _transfer  # noqa: F401  (registers the copy and transfer ops)
        from .backend.ops import load_all as _load_ops

        _backend.register_device()
        _load_ops()

        # Run backward on the calling thread rather than on autograd's per-device worker threads:
        # JAX tracing is thread-local (a compiled step traces backward too), and an exception raised
        # by a lowering on a worker thread could abort the process instead of reaching the caller.
        torch.autograd.set_multithreading_enabled(False)

        from . import distributed  # noqa: F401  (the sharding layer; registers torchtpu::shard)
        from .integrations import dcp as _dcp
        from .integrations import torchtitan as _torchtitan

        _torchtitan.install()  # torchtitan's own trainer: its Triton MoE permutation and peak FLOPs on tpu
        _dcp.install()  # torch.distributed.checkpoint's async saves stage tpu tensors by their values
        from ._platform import cache_root, persistent_cache_stats, platform  # noqa: F401
        from .backend import dynamo as _dynamo  # registers torch.compile backend "tpu"
        from .backend import flex_attention as _flex_attention

        _flex_attention.install()  # FlexAttention's higher-order operators on tpu tensors
        from .backend import TpuTensor  # noqa: F401
        from .backend.activation_checkpoint import apply_activation_checkpointing, checkpoint_module  # noqa: F401
        from .backend.compile import compile  # noqa: F401
        from .backend.jax_op import jax_op  # noqa: F401
        from .backend.module_jax import module_from_jax, module_to_jax  # noqa: F401
        from .backend.transfer import from_jax, to_jax  # noqa: F401
    finally:
        _gc.freeze()
        if _gc_was_enabled:
            _gc.enable()

    def cache_stats() -> dict:
        """Executable cache counters.

        hits/misses/calls: eager op executables (a miss traces and compiles a new signature);
        xla_compiles: every XLA compilation in this process, eager or compiled programs (a program loaded
        from the persistent cache counts too: JAX times the lookup and the compile as one event);
        dynamo_*: torch.compile(backend="tpu") graphs compiled, recompiled, traced to XLA, launched;
        compiled_step_*: torchtpu.compile steps traced, and of those, traced again because a guarded
        value (argument shapes, an optimizer hyperparameter that is not lifted) changed.
        """
        from ._platform import XLA_COMPILES
        from .backend import compile as _compile
        from .backend import fused as _fused

        return dict(
            _backend.STATS.snapshot(),
            xla_compiles=XLA_COMPILES[0],
            **_dynamo.STATS.snapshot(),
            **_compile.STATS.snapshot(),
            **_fused.FUSED_STATS.snapshot(),
        )

    def reset_cache_stats() -> None:
        from .backend import compile as _compile
        from .backend import fused as _fused

        _backend.STATS.reset()
        _fused.FUSED_STATS.reset()
        _dynamo.STATS.reset()
        _compile.STATS.reset()

    def set_debug(enabled: bool = True) -> None:
        """Debug mode: run each op synchronously and raise on NaN/Inf, naming the op and line
        (the eager mode "debug"; set_debug(False) returns to "strict")."""
        set_eager_mode("debug" if enabled else "strict")

    from .backend.fused import set_eager_mode  # noqa: E402

    def get_eager_mode() -> str:
        """The eager mode ops run in now: "strict", "fused" or "debug" (see set_eager_mode)."""
        return _backend.CONFIG.eager_mode

    @_contextlib.contextmanager
    def eager_mode(mode: str):
        """Run the block in eager mode `mode` ("strict", "fused" or "debug"), then return to the
        mode before it (leaving fused mode runs the ops recorded in the block)."""
        previous = _backend.CONFIG.eager_mode
        set_eager_mode(mode)
        try:
            yield
        finally:
            set_eager_mode(previous)

    def set_cpu_fallback(enabled: bool = True) -> None:
        """Run ops that have no XLA lowering on the CPU (warning once per op)."""
        _backend.CONFIG.cpu_fallback = bool(enabled)
