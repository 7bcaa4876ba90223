"""vLLM's worker for the tpu device: one process driving every tpu device of its mesh.

vLLM's GPU worker with what differs on tpu:
- the device: a one-axis mesh of `tensor_parallel_size` tpu devices (one process; platform.py),
  and vLLM's distributed state as a world of one (gloo);
- memory (`kv_cache_bytes`): the KV cache gets `kv_cache_memory_bytes` when given. Otherwise, on
  TPU, `gpu_memory_utilization` of every chip's memory (XLA's `bytes_limit`) less what the
  instance holds there (its weights). Where the tpu device runs on XLA's CPU devices, the host's
  memory is shared with everything else on it, so the cache gets vLLM-CPU's
  `VLLM_CPU_KVCACHE_SPACE` (GiB) when set, else no more than `max_num_seqs` sequences of
  `max_model_len` tokens can ever use, within `gpu_memory_utilization` of the host's memory less
  what this process holds, and never more than the host has available. A cache that cannot
  hold one `max_model_len` sequence is refused at start-up in one line naming the fixes. Every
  figure is in bytes of vLLM's KV-cache spec, whose pages count the cache's element size (one
  byte for an fp8 cache, kv_cache_dtype="fp8"): a given size holds twice a bfloat16 cache's
  tokens, and the default on XLA's CPU devices holds the same tokens in half the bytes;
- warm-up: every padding bucket's step compiled before the first request (runner.py);
- `torchtpu_cache_stats()`: torchtpu's compile counters in the worker's process, for
  `LLM.collective_rpc("torchtpu_cache_stats")` (recompiles are visible from the front end).
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
from vllm.logger import init_logger
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

import torchtpu

from .platform import ENGINE_PROCESS, TpuPlatform, tensor_parallel_size
from .runner import TpuModelRunner
from .sharding import tensor_parallel_mesh

logger = init_logger(__name__)


class TpuWorker(Worker):
    def init_device(self):
        ENGINE_PROCESS[0] = True
        self.device = torch.device("tpu", 0)
        TpuPlatform.check_if_supports_dtype(self.model_config.dtype)
        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank, TpuPlatform.dist_backend
        )
        set_random_seed(self.model_config.seed)
        self.tp_size = tensor_parallel_size(self.vllm_config)
        self.mesh = tensor_parallel_mesh(self.tp_size)
        self.model_runner = TpuModelRunner(self.vllm_config, self.mesh)

    def _maybe_get_memory_pool_context(self, tag: str):
        return nullcontext()

    def determine_available_memory(self) -> int:
        return kv_cache_bytes(self.vllm_config, self.model_runner.get_kv_cache_spec(), self.tp_size)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        self.model_runner.warming_up_model()
        set_random_seed(self.model_config.seed)
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def sleep(self, level: int = 1) -> None:
        logger.warning("torchtpu: sleep mode is not supported on tpu; ignored")

    def wake_up(self, tags=None) -> None:
        logger.warning("torchtpu: sleep mode is not supported on tpu; ignored")

    def torchtpu_cache_stats(self) -> dict:
        """torchtpu.cache_stats() in this worker's process, with the step buckets compiled."""
        return dict(torchtpu.cache_stats(), step_buckets=len(self.model_runner.compiled_buckets))


GiB = 1 << 30


def _on_tpu_chips(stats: list[dict]) -> bool:
    """Whether the devices report a memory limit of their own (TPU HBM; XLA's CPU devices do not)."""
    return all(st.get("bytes_limit") for st in stats)


def kv_cache_bytes(vllm_config, kv_cache_spec: dict, tp_size: int) -> int:
    """The bytes of KV cache for this instance, over every device of its mesh (module docstring)."""
    import psutil
    from vllm.v1.core.kv_cache_utils import max_memory_usage_bytes

    cache = vllm_config.cache_config
    layers = list(kv_cache_spec.values())
    one_block = sum(spec.page_size_bytes for spec in layers)  # the block pool's null block, every layer
    one_sequence = max_memory_usage_bytes(vllm_config, layers) + one_block
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    util = cache.gpu_memory_utilization
    stats = [torch.tpu.memory_stats(i) for i in range(tp_size)]
    on_chips = _on_tpu_chips(stats)
    host_env = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if cache.kv_cache_memory_bytes is not None:
        size, how = int(cache.kv_cache_memory_bytes), "kv_cache_memory_bytes"
    elif on_chips:
        size = int(sum(st["bytes_limit"] * util - st.get("bytes_in_use", 0) for st in stats))
        how = f"gpu_memory_utilization={util} of {tp_size} tpu device(s) less the weights"
    elif host_env:
        size, how = int(float(host_env) * GiB), f"VLLM_CPU_KVCACHE_SPACE={host_env}"
    else:
        instance = psutil.Process().memory_info().rss
        share = max(0, int(util * psutil.virtual_memory().total - instance))
        every_sequence = max_seqs * (one_sequence - one_block) + one_block
        size = min(every_sequence, share)
        how = (
            f"max_num_seqs={max_seqs} x max_model_len={vllm_config.model_config.max_model_len}"
            if size == every_sequence
            else f"gpu_memory_utilization={util} of the host's memory less this process's {instance / GiB:.2f} GiB"
        )
    if size < one_sequence:
        raise ValueError(
            f"torchtpu: a KV cache of {size / GiB:.3f} GiB ({how}) cannot hold one sequence of max_model_len="
            f"{vllm_config.model_config.max_model_len} tokens, which needs {one_sequence / GiB:.3f} GiB; "
            "lower max_model_len, or give the cache more memory (kv_cache_memory_bytes / --kv-cache-memory-bytes, "
            "or gpu_memory_utilization)"
        )
    if not on_chips:
        available = psutil.virtual_memory().available
        if size > available:
            raise ValueError(
                f"torchtpu: a KV cache of {size / GiB:.2f} GiB ({how}) is more than the host's available memory "
                f"({available / GiB:.2f} GiB; the tpu device runs on XLA's CPU devices); set a smaller "
                "kv_cache_memory_bytes (--kv-cache-memory-bytes), max_num_seqs or max_model_len"
            )
    where = "tpu device memory" if on_chips else "host memory (the tpu device runs on XLA's CPU devices)"
    logger.info("torchtpu: %.3f GiB for the KV cache in %s (%s)", size / GiB, where, how)
    return size
