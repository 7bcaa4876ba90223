"""Serving with vLLM on the tpu device: a vLLM platform plugin.

vLLM finds the plugin through the `vllm.platform_plugins` entry point (pyproject.toml), which
names `platform_plugin` below. vLLM's engine, scheduler, OpenAI server and model code run
unchanged; the model's tensors live on `tpu`, and each forward step is one compiled XLA program.

- platform.py   the Platform: device, dtypes, config (worker, block size, one process for TP)
- worker.py     the Worker: device mesh, KV-cache memory, warm-up
- runner.py     the ModelRunner: vLLM's own runner on the host, the model step compiled on tpu
- attention.py  the attention backend: metadata, paged KV-cache writes, ragged paged attention
- steps.py      padding buckets and the packed host -> tpu inputs of one step
- sharding.py   tensor parallelism: vLLM's parallel layers laid out over the "tp" mesh axis

See docs/serving.md.
"""

from __future__ import annotations

import os

PLATFORM = "torchtpu.serve.platform.TpuPlatform"


def platform_plugin() -> str | None:
    """vLLM's platform-plugin hook: torchtpu's platform wherever torchtpu imports (this module's
    package did), unless TORCHTPU_VLLM=0 turns it off. `VLLM_TARGET_DEVICE=cpu` makes vLLM skip
    plugins and use its own CPU platform."""
    if os.environ.get("TORCHTPU_VLLM", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    return PLATFORM


def general_plugin() -> None:
    """vLLM's general-plugin hook, run in every vLLM process before the model's config is read. On
    torchtpu's platform, vLLM inspects a model's class (which of its interfaces the class implements)
    in this process rather than in a fresh Python process. vLLM does it apart so that a GPU parent
    process never initializes CUDA; the tpu device has nothing to keep uninitialized there, and the
    fresh process costs 10-16 s of imports the first time each architecture is served on a machine
    (vLLM caches the answer on disk after that)."""
    from vllm.platforms import current_platform

    if f"{type(current_platform).__module__}.{type(current_platform).__qualname__}" != PLATFORM:
        return
    from vllm.model_executor.models import registry

    if hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = _in_this_process


def _in_this_process(fn):
    return fn()
