"""Paged KV-cache attention as torch ops: what vLLM's attention backend on tpu calls.

Two ops in the `torchtpu` namespace, lowered to the JAX functions of paged_attention.py:

- `torchtpu::paged_kv_write(kv_cache!, key, value, slot_mapping, kv_cache_dtype="auto", k_scale=1.0,
  v_scale=1.0)` writes each token's key and
  value into its cache slot (slot = block * block_size + offset; a negative slot is padding and
  writes nothing). It mutates the cache: in eager mode the dispatcher writes the new array back;
  inside a compiled step the cache is program state, its input buffer donated, so the write is
  in place and no step copies the cache.
- `torchtpu::ragged_paged_attention(q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
  sm_scale, sliding_window, soft_cap, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0)`: causal
  attention of a mixed batch of prefill chunks and decode tokens over their sequences' cache
  blocks. It is registered with `jax_op` (backend/jax_op.py), the way a user's JAX function or
  Pallas kernel becomes a torch op.

The cache layout is [num_blocks, block_size, 2 * num_kv_heads, head_dim], key and value
interleaved on the head axis (key at even, value at odd slots).

`kv_cache_dtype` names what the cache holds, as vLLM's option does: "auto" for the cache tensor's
own dtype; "fp8" or "fp8_e4m3" (float8_e4m3fn) and "fp8_e5m2" (float8_e5m2) for an fp8 cache, a
uint8 tensor of fp8 bytes (how vLLM allocates it) or a tensor of that float8 dtype. An fp8 cache
stores key / k_scale and value / v_scale, saturated to the fp8 type's largest finite value, and
attention reads them back times the scales (paged_attention.py). A float8 cache tensor with
"auto" is an fp8 cache of its own type.
"""

from __future__ import annotations

import torch

from ..registry import jax_op, lower

# vLLM's kv_cache_dtype names of an fp8 cache -> the fp8 type its bytes hold ("fp8" is e4m3, as on
# most of vLLM's platforms)
FP8_KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}

_lib = torch.library.Library("torchtpu", "FRAGMENT")
_lib.define(
    "paged_kv_write(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping, "
    'str kv_cache_dtype="auto", float k_scale=1.0, float v_scale=1.0) -> ()'
)


def _kv_dtype(kv_cache_dtype: str):
    """The fp8 type of `kv_cache_dtype`, or None for "auto" (the cache's own dtype)."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: the paged KV cache holds 'auto' (its own dtype) or "
            f"{', '.join(map(repr, FP8_KV_CACHE_DTYPES))}"
        )
    import jax.numpy as jnp

    return jnp.dtype(FP8_KV_CACHE_DTYPES[kv_cache_dtype])


@torch.library.register_fake("torchtpu::paged_kv_write")
def _paged_kv_write_fake(kv_cache, key, value, slot_mapping, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    return None


@lower(torch.ops.torchtpu.paged_kv_write.default)
def paged_kv_write(kv_cache, key, value, slot_mapping, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    from . import paged_attention

    return (
        paged_attention.write_kv_cache(
            kv_cache,
            key,
            value,
            slot_mapping,
            kv_dtype=_kv_dtype(kv_cache_dtype),
            k_scale=float(k_scale),
            v_scale=float(v_scale),
        ),
    )


def ragged_paged_attention(
    q,
    kv_cache,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    kv_cache_dtype="auto",
    k_scale=1.0,
    v_scale=1.0,
):
    from . import paged_attention

    return paged_attention.ragged_paged_attention(
        q,
        kv_cache,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        kv_dtype=_kv_dtype(kv_cache_dtype),
        k_scale=float(k_scale),
        v_scale=float(v_scale),
    )


# A JAX function registered as users register theirs (backend/jax_op.py); it picks its Pallas kernel
# or its JAX form itself (paged_attention.py), and its output is shaped like q.
jax_op(
    "torchtpu::ragged_paged_attention",
    ragged_paged_attention,
    schema="(Tensor q, Tensor kv_cache, Tensor kv_lens, Tensor block_tables, Tensor cu_q_lens, Tensor num_seqs, "
    'float sm_scale, int? sliding_window=None, float? soft_cap=None, str kv_cache_dtype="auto", '
    "float k_scale=1.0, float v_scale=1.0) -> Tensor",
    fake=lambda q, *rest: torch.empty_like(q),
    choose_platform=False,
)
