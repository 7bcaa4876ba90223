"""vLLM's attention backend on tpu: paged KV-cache writes and ragged paged attention.

vLLM's attention layers call `TpuAttentionImpl.forward` with the layer's KV cache and the
metadata of the step. The metadata is built twice:

- on the host, by `TpuAttentionMetadataBuilder` from vLLM's `CommonAttentionMetadata` (the
  runner's CPU buffers): the query start offsets, context lengths, block table and slot mapping
  of the scheduled requests (`HostAttentionMetadata`);
- on the device, inside the compiled step: the same arrays padded to the step's bucket and
  moved to tpu in one transfer (`steps.StepInputs`), as `DeviceAttentionMetadata`, which is what
  `forward` reads.

Each layer's cache is one tensor [num_blocks, block_size, 2 * num_kv_heads, head_dim], key and
value interleaved on the head axis (torchtpu.backend.ops.nn_paged).

`kv_cache_dtype="fp8"` (or "fp8_e4m3", both float8_e4m3fn, or "fp8_e5m2") quantizes the cache:
vLLM allocates it as uint8 (one byte per element, which its KV-cache spec and the worker's
sizing count), the write stores key / k_scale and value / v_scale in the fp8 type, saturated,
and attention reads them back times the scales. The scales are the layer's (`_k_scale_float`,
`_v_scale_float`: 1.0, as no checkpoint torchtpu serves carries KV-cache scales), read when the
step is traced, so they are constants of the compiled program.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    MultipleOf,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from torchtpu.backend.ops.nn_paged import FP8_KV_CACHE_DTYPES

BACKEND_NAME = "TORCHTPU_PAGED"
# Tokens per cache block unless the user sets --block-size. vLLM asks the backend after the model
# is built (`get_preferred_block_size`) and would otherwise take its general default (16).
PREFERRED_BLOCK_SIZE = 32


class TpuAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", "float16", "float32", *FP8_KV_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        return TpuAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TpuAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(8)]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return PREFERRED_BLOCK_SIZE

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, block_size, 2 * num_kv_heads, head_size)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


def register_backend() -> None:
    """Give the backend its name in vLLM's backend enum (attention layers look their backend up
    by `get_name()`)."""
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        AttentionBackendEnum.register(BACKEND_NAME, f"{__name__}.{TpuAttentionBackend.__qualname__}")


register_backend()


@dataclasses.dataclass
class HostAttentionMetadata:
    """One step's attention inputs on the host (CPU int32 tensors, unpadded)."""

    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs]: context length including this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # [num_actual_tokens]


@dataclasses.dataclass
class DeviceAttentionMetadata:
    """The same inputs on tpu, padded to the step's bucket (see steps.StepInputs)."""

    slot_mapping: torch.Tensor  # [tokens]; -1 for padding tokens
    kv_lens: torch.Tensor  # [reqs]
    block_tables: torch.Tensor  # [reqs, max_blocks_per_seq]
    cu_q_lens: torch.Tensor  # [reqs + 1]
    num_seqs: torch.Tensor  # [1]


def host_metadata() -> HostAttentionMetadata:
    """The host metadata of the model call under way (from vLLM's forward context)."""
    metadata = get_forward_context().attn_metadata
    host = next(iter(metadata.values())) if isinstance(metadata, dict) and metadata else None
    if not isinstance(host, HostAttentionMetadata):
        raise RuntimeError("torchtpu: a model step without the tpu attention backend's metadata")
    return host


class TpuAttentionMetadataBuilder(AttentionMetadataBuilder[HostAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> HostAttentionMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        return HostAttentionMetadata(
            num_reqs=n,
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc_cpu[: n + 1],
            seq_lens=m.seq_lens[:n].cpu(),
            block_table=m.block_table_tensor[:n].cpu(),
            slot_mapping=m.slot_mapping[: m.num_actual_tokens].cpu(),
        )


class TpuAttentionImpl(AttentionImpl[DeviceAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes=None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **extra,
    ) -> None:
        unsupported = [
            name
            for name, value in (
                ("alibi_slopes", alibi_slopes),
                ("sinks", sinks),
                ("kv_sharing_target_layer_name", kv_sharing_target_layer_name),
            )
            if value is not None
        ]
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attn_type={attn_type}")
        if kv_cache_dtype not in TpuAttentionBackend.supported_kv_cache_dtypes:
            unsupported.append(f"kv_cache_dtype={kv_cache_dtype}")
        if unsupported:
            raise NotImplementedError(
                f"torchtpu's paged attention does not support {', '.join(unsupported)}: it serves decoder "
                "self-attention with an unquantized KV cache (kv_cache_dtype='auto') or an fp8 one "
                "(kv_cache_dtype='fp8', 'fp8_e4m3' or 'fp8_e5m2')"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None
        self.kv_cache_dtype = kv_cache_dtype
        # what the cache ops are told the cache holds: an fp8 type, or its own dtype
        self.cache_format = kv_cache_dtype if kv_cache_dtype in FP8_KV_CACHE_DTYPES else "auto"
        self.kv_sharing_target_layer_name = None
        self.attn_type = attn_type

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("torchtpu's paged attention has no fused output quantization")
        if attn_metadata is None:  # a profiling run without a cache
            return output.zero_()
        if not isinstance(attn_metadata, DeviceAttentionMetadata):
            raise RuntimeError(
                "torchtpu: attention ran outside the compiled tpu step (host metadata); the model must be called "
                "through TpuModelRunner"
            )
        m = attn_metadata
        q = query.view(-1, self.num_heads, self.head_size)
        k = key.view(-1, self.num_kv_heads, self.head_size)
        v = value.view(-1, self.num_kv_heads, self.head_size)
        quantized = {}
        if self.cache_format != "auto":
            quantized = dict(kv_cache_dtype=self.cache_format, **kv_scales(layer))
        torch.ops.torchtpu.paged_kv_write(kv_cache, k, v, m.slot_mapping, **quantized)
        out = torch.ops.torchtpu.ragged_paged_attention(
            q,
            kv_cache,
            m.kv_lens,
            m.block_tables,
            m.cu_q_lens,
            m.num_seqs,
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
            **quantized,
        )
        output.view(out.shape).copy_(out)
        return output


def kv_scales(layer) -> dict:
    """The layer's fp8 KV-cache scales as Python floats (vLLM's attention layer keeps them as
    `_k_scale_float` / `_v_scale_float`; 1.0 where a layer has none)."""
    from torchtpu.backend.ops.paged_attention import check_scales

    scales = {name: float(getattr(layer, f"_{name}_float", 1.0)) for name in ("k_scale", "v_scale")}
    check_scales(**scales, where=f"torchtpu: layer {getattr(layer, 'layer_name', layer)}")
    return scales
