"""Choose what backs the `tpu` device and configure JAX before any backend starts.

TPU chips are detected from device nodes so that libtpu is never initialised on a host
without them (it prints warnings about TPU_WORKER_HOSTNAMES there).
"""
from __future__ import annotations

import glob
import importlib.util
import os

_VALID = ("tpu", "gpu", "cpu")


def has_tpu_chips() -> bool:
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def _has_gpu_plugin() -> bool:
    return any(
        importlib.util.find_spec(name) is not None
        for name in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda12", "jax_rocm60_plugin")
    ) if importlib.util.find_spec("jax_plugins") or importlib.util.find_spec("jax_cuda12_plugin") or importlib.util.find_spec("jax_cuda13_plugin") else False


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


def platform() -> str:
    """The platform backing the `tpu` device: 'tpu', 'gpu' or 'cpu'."""
    import jax

    return jax.devices()[0].platform
