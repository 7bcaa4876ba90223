"""vLLM's model runner for the tpu device.

`TpuModelRunner` is vLLM's CPU model runner (itself vLLM's GPU runner with host buffers): the
persistent batch, the scheduler bookkeeping, the attention metadata and the sampler all stay
vLLM's own and run on the host, as on vLLM's CPU backend. What moves to tpu is the model:

- `load_model` builds vLLM's model with its parameters on tpu, still unallocated, lays them out
  over the tensor-parallel mesh (sharding.py) and lets vLLM's weight loaders write each tensor
  from the checkpoint straight into its shards;
- `initialize_kv_cache_tensors` allocates one typed cache tensor per attention layer on tpu
  (vLLM's one int8 byte buffer viewed as each layer's dtype is not how tpu memory works), laid
  out over the kv-head axis under tensor parallelism;
- `_model_forward` runs the whole forward step, from token ids to the logits of the sampled
  positions, as one `torchtpu.compile` program per padding bucket (steps.py), with the caches and
  parameters as its state (donated: the cache writes are in place). The logits come back to the
  host, where vLLM's sampler runs unchanged (temperature, top-p/top-k, seeds, logprobs).

Under draft-model speculative decoding the draft model is loaded, cached and stepped the same way
(draft.py): `load_tpu_model`, `pack_step` and `step_logits` serve both models.

vLLM's runner computes `model.compute_logits(hidden_states[logits_indices])` after the forward;
here that product already came out of the step, so `_model_forward` returns it wrapped
(`StepLogits`) and the model's `compute_logits` hands it through (`_LogitsPassThrough`).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.utils import bind_kv_cache

import torchtpu

from . import moe, quant, sharding, steps  # noqa: F401  (quant: vLLM's w8a16 kernel for tpu, registered on import)
from .attention import DeviceAttentionMetadata, host_metadata
from .draft import TpuDraftModelProposer

logger = init_logger(__name__)


class StepLogits:
    """The logits of the sampled positions, computed by the step; vLLM's runner indexes its
    'hidden states' with the logits indices, which here is already done."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def __getitem__(self, index):
        return self


class _LogitsPassThrough:
    """`model.compute_logits` for vLLM's runner: the step's logits as they are; anything else
    (the step's own call, inside the program) goes to the model's own method."""

    def __init__(self, compute_logits):
        self.compute_logits = compute_logits

    def __call__(self, hidden_states, *args, **kwargs):
        if isinstance(hidden_states, StepLogits):
            return hidden_states.logits
        return self.compute_logits(hidden_states, *args, **kwargs)


class TpuModelRunner(CPUModelRunner):
    def __init__(self, vllm_config, mesh=None):
        super().__init__(vllm_config, torch.device("cpu"))
        self.tpu_device = torch.device("tpu", 0)
        self.mesh = mesh
        self.block_size = self.cache_config.block_size  # the KV cache's, once allocated
        self.buckets = self._buckets()
        self.step = torchtpu.compile(self._step, warmup="abstract")  # compiled from the first call
        self.compiled_buckets: set = set()
        self.layer_names: list[str] = []
        self._logits_indices = None
        self._restored_generators: list[int] = []
        if isinstance(getattr(self, "drafter", None), DraftModelProposer):
            self.drafter = TpuDraftModelProposer(vllm_config, self)

    def _buckets(self) -> steps.Buckets:
        return steps.Buckets(
            self.scheduler_config.max_num_batched_tokens,
            self.scheduler_config.max_num_seqs,
            -(-self.model_config.max_model_len // self.block_size),
            self.num_spec_tokens,
        )

    # -- the model
    def load_model(self, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("torchtpu: loading dummy weights (elastic expert-parallel scale-up) is not supported")
        model_config = self.model_config
        if model_config.is_multimodal_model:
            raise NotImplementedError(f"torchtpu serves text-only models; {model_config.architecture} is multimodal")
        model = self.load_tpu_model(self.vllm_config, model_config)
        model.compute_logits = _LogitsPassThrough(model.compute_logits)
        self.model = model.eval()
        if isinstance(getattr(self, "drafter", None), TpuDraftModelProposer):
            self.drafter.load_model(self.model)

    def load_tpu_model(self, vllm_config, model_config, prefix: str = "") -> torch.nn.Module:
        """Build vLLM's model of `model_config` on tpu, laid out over the mesh, with its weights
        loaded (the target model, and a draft model under speculative decoding: draft.py)."""
        logger.info("torchtpu: loading %s onto tpu", model_config.model)
        loader = get_model_loader(vllm_config.load_config)
        # vLLM's BaseModelLoader.load_model, with the parameters laid out over the mesh between
        # creating the model (tpu storage is allocated on first write) and loading its weights.
        with set_default_torch_dtype(model_config.dtype):
            with self.tpu_device:
                model = loader.create_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            if self.mesh is not None:
                sharding.shard_model(model, self.mesh)
                moe.shard_experts(model, self.mesh)
            loader.load_weights(model, model_config)
            if self.mesh is not None:
                sharding.reorder_loaded_weights(model)
                moe.reorder_loaded_experts(model)
            process_weights_after_loading(model, model_config, self.tpu_device)
        return model.eval()

    # -- the KV cache
    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context=None):
        kv_caches: dict[str, torch.Tensor] = {}
        block_sizes = set()
        for group in kv_cache_config.kv_cache_groups:
            for name in group.layer_names:
                spec = group.kv_cache_spec
                spec = getattr(spec, "kv_cache_specs", {}).get(name, spec)
                if not isinstance(spec, AttentionSpec):
                    raise NotImplementedError(
                        f"torchtpu: layer {name} needs a {type(spec).__name__} cache; only attention caches are supported"
                    )
                block_sizes.add(spec.block_size)
                shape = (kv_cache_config.num_blocks, spec.block_size, 2 * spec.num_kv_heads, spec.head_size)
                kv_caches[name] = sharding.kv_cache(shape, spec.dtype, self.mesh)
        for layer_name, target in self.shared_kv_cache_layers.items():
            kv_caches[layer_name] = kv_caches[target]
        bind_kv_cache(
            kv_caches,
            self.compilation_config.static_forward_context,
            self.kv_caches,
            kv_cache_groups=kv_cache_config.kv_cache_groups,
        )
        self.layer_names = list(kv_caches)
        if len(block_sizes) > 1:
            raise NotImplementedError(f"torchtpu: KV cache groups of different block sizes {sorted(block_sizes)}")
        if block_sizes:
            # vLLM settles the block size after the runner is built (the attention backend's
            # preference): the block tables' width in the step's buckets follows the cache's.
            self.block_size = block_sizes.pop()
            self.buckets = self._buckets()
        return kv_caches

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        # A reused block's stale values are finite and lie past its sequence's context length,
        # which attention masks; nothing to clear.
        pass

    # -- one step
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._logits_indices = out[0]
        return out

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is not None or intermediate_tensors is not None:
            raise NotImplementedError(
                "torchtpu: the step takes token ids only (no input embeddings, no pipeline stages)"
            )
        logits_indices = self._logits_indices.numpy()
        bucket, packed = self.pack_step(input_ids, positions, logits_indices)
        logits = self.run_step(bucket, packed)
        return StepLogits(logits[: len(logits_indices)])

    def pack_step(self, input_ids, positions, logits_indices, *, one_row_per_request: bool = False):
        """A model call's inputs, made under vLLM's forward context with this backend's host
        metadata, padded to their bucket and packed in one host array: (bucket, packed).
        `logits_indices` are the rows whose logits the step returns; `one_row_per_request` gives
        the bucket room for one row a request (a draft step)."""
        host = host_metadata()
        n = host.num_actual_tokens
        longest = int(host.seq_lens.max()) if host.num_reqs else 0
        blocks = -(-longest // self.block_size)
        if blocks > self.buckets.max_blocks_per_seq:
            raise RuntimeError(
                f"torchtpu: a sequence of {longest} tokens needs {blocks} cache blocks of "
                f"{self.block_size}, more than the step's block tables hold ({self.buckets.max_blocks_per_seq})"
            )
        bucket = self.buckets.for_batch(n, host.num_reqs)
        if one_row_per_request:
            bucket = bucket.one_row_per_request()
        packed = steps.pack(
            bucket,
            self.buckets.max_blocks_per_seq,
            input_ids=input_ids[:n].numpy(),
            positions=positions[:n].numpy(),
            slot_mapping=host.slot_mapping.numpy(),
            seq_lens=host.seq_lens.numpy(),
            query_start_loc=host.query_start_loc.numpy(),
            block_table=host.block_table.numpy(),
            logits_indices=logits_indices,
        )
        return bucket, packed

    def run_step(self, bucket: steps.Bucket, packed: np.ndarray) -> torch.Tensor:
        """Run the compiled step of `bucket` on packed inputs; the logits rows, on the host."""
        with torch.inference_mode(False), torch.no_grad():
            logits = self.step(torch.from_numpy(packed).to(self.tpu_device), bucket)
            self.compiled_buckets.add(bucket)
            return logits.cpu()

    def _step(self, packed: torch.Tensor, bucket: steps.Bucket) -> torch.Tensor:
        return self.step_logits(self.model, packed, bucket)

    def step_logits(self, model, packed: torch.Tensor, bucket: steps.Bucket) -> torch.Tensor:
        """Inside a compiled step: `model`'s forward over the packed inputs (on tpu), with the
        attention metadata every cache layer reads, and the logits of the step's logits rows."""
        x = steps.unpack(packed, bucket, self.buckets.max_blocks_per_seq)
        metadata = DeviceAttentionMetadata(
            slot_mapping=x["slot_mapping"],
            kv_lens=x["kv_lens"],
            block_tables=x["block_tables"],
            cu_q_lens=x["cu_q_lens"],
            num_seqs=x["num_seqs"],
        )
        with set_forward_context(
            dict.fromkeys(self.layer_names, metadata), self.vllm_config, num_tokens=bucket.tokens, slot_mapping={}
        ):
            hidden = model(input_ids=x["input_ids"], positions=x["positions"])
            return model.compute_logits(hidden[x["logits_indices"]])

    # -- sampling (vLLM's sampler, on the host)
    def _sample(self, logits, spec_decode_metadata):
        # The token sampled for a partial prefill chunk is discarded, and vLLM then rewinds the
        # request's seeded generator by an offset, which CUDA generators have and the host's CPU
        # generators do not (they raise). The generator's state is put back here instead, and
        # vLLM's rewind passes over it (_bookkeeping_sync): a seeded request draws the same
        # tokens however its prompt was chunked.
        generators = self.input_batch.generators
        discarded = np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]
        states = {int(i): generators[int(i)].get_state() for i in discarded if int(i) in generators}
        out = super()._sample(logits, spec_decode_metadata)
        for i, state in states.items():
            generators[i].set_state(state)
        self._restored_generators = list(states)
        return out

    def _bookkeeping_sync(self, *args, **kwargs):
        generators = self.input_batch.generators
        restored = {i: generators.pop(i) for i in self._restored_generators if i in generators}
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            generators.update(restored)
            self._restored_generators = []

    def _copy_draft_token_ids_to_cpu(self, scheduler_output, zeros_only: bool = False) -> None:
        # vLLM copies a draft model's proposals from the GPU on a CUDA side stream; here the
        # proposer hands them over on the host (draft.py), so they are copied in place.
        drafts = self._draft_token_ids
        self._draft_token_req_ids = self.input_batch.req_ids.copy()
        if not torch.is_tensor(drafts):
            return
        num_reqs, num_drafts = drafts.shape
        self.prev_num_spec_tokens = num_drafts
        self.draft_token_ids_cpu[:num_reqs, :num_drafts] = 0 if zeros_only else drafts

    # -- warm-up
    def warming_up_model(self) -> None:
        """Compile the step of every padding bucket (or load it from the persistent cache)."""
        start = time.perf_counter()
        before = torchtpu.cache_stats()["xla_compiles"]
        for bucket in self.buckets.all():
            self.run_step(bucket, steps.empty(bucket, self.buckets.max_blocks_per_seq))
        drafts = 0
        if isinstance(getattr(self, "drafter", None), TpuDraftModelProposer):
            drafts = self.drafter.model.warm_up()
        logger.info(
            "torchtpu: %d step programs ready in %.1f s (%d XLA compiles)",
            len(self.compiled_buckets) + drafts,
            time.perf_counter() - start,
            torchtpu.cache_stats()["xla_compiles"] - before,
        )
