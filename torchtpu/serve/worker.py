"""vLLM's worker for the tpu device: one process driving every tpu device of its mesh.

vLLM's GPU worker with what differs on tpu:
- the device: a one-axis mesh of `tensor_parallel_size` tpu devices (one process; platform.py),
  and vLLM's distributed state as a world of one (gloo);
- memory: the KV cache gets `kv_cache_memory_bytes` when given, else `gpu_memory_utilization` of
  the devices' memory less what is in use (on TPU, XLA's per-device `bytes_limit`; on a host
  whose tpu device is backed by XLA's CPU devices, of the host's available memory);
- warm-up: every padding bucket's step compiled before the first request (runner.py);
- `torchtpu_cache_stats()`: torchtpu's compile counters in the worker's process, for
  `LLM.collective_rpc("torchtpu_cache_stats")` (recompiles are visible from the front end).
"""

from __future__ import annotations

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
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            return int(explicit)
        util = self.cache_config.gpu_memory_utilization
        stats = [torch.tpu.memory_stats(i) for i in range(self.tp_size)]
        if all(s.get("bytes_limit") for s in stats):
            free = sum(s["bytes_limit"] * util - s.get("bytes_in_use", 0) for s in stats)
            where = f"{self.tp_size} tpu device(s)"
        else:
            import psutil

            free = psutil.virtual_memory().available * util
            where = "host memory (the tpu device runs on XLA's CPU devices)"
        if free <= 0:
            raise ValueError(
                f"torchtpu: no memory left for the KV cache on {where} at gpu_memory_utilization={util}; "
                "raise gpu_memory_utilization or set kv_cache_memory_bytes"
            )
        logger.info("torchtpu: %.2f GiB for the KV cache (%s x %.2f)", free / (1 << 30), where, util)
        return int(free)

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
