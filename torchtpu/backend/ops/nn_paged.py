"""Paged KV-cache attention as torch ops: what vLLM's attention backend on tpu calls.

Two ops in the `torchtpu` namespace, lowered to the JAX functions of paged_attention.py:

- `torchtpu::paged_kv_write(kv_cache!, key, value, slot_mapping)` writes each token's key and
  value into its cache slot (slot = block * block_size + offset; a negative slot is padding and
  writes nothing). It mutates the cache: in eager mode the dispatcher writes the new array back;
  inside a compiled step the cache is program state, its input buffer donated, so the write is
  in place and no step copies the cache.
- `torchtpu::ragged_paged_attention(q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
  sm_scale, sliding_window, soft_cap)`: causal attention of a mixed batch of prefill chunks and
  decode tokens over their sequences' cache blocks. It is registered with `jax_op`
  (backend/jax_op.py), the way a user's JAX function or Pallas kernel becomes a torch op.

The cache layout is [num_blocks, block_size, 2 * num_kv_heads, head_dim], key and value
interleaved on the head axis (key at even, value at odd slots).
"""

from __future__ import annotations

import torch

from ..registry import jax_op, lower

_lib = torch.library.Library("torchtpu", "FRAGMENT")
_lib.define("paged_kv_write(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()")


@torch.library.register_fake("torchtpu::paged_kv_write")
def _paged_kv_write_fake(kv_cache, key, value, slot_mapping):
    return None


@lower(torch.ops.torchtpu.paged_kv_write.default)
def paged_kv_write(kv_cache, key, value, slot_mapping):
    from . import paged_attention

    return (paged_attention.write_kv_cache(kv_cache, key, value, slot_mapping),)


def ragged_paged_attention(
    q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale, sliding_window=None, soft_cap=None
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
    )


# A JAX function registered as users register theirs (backend/jax_op.py); it picks its Pallas kernel
# or its JAX form itself (paged_attention.py), and its output is shaped like q.
jax_op(
    "torchtpu::ragged_paged_attention",
    ragged_paged_attention,
    schema="(Tensor q, Tensor kv_cache, Tensor kv_lens, Tensor block_tables, Tensor cu_q_lens, Tensor num_seqs, "
    "float sm_scale, int? sliding_window=None, float? soft_cap=None) -> Tensor",
    fake=lambda q, *rest: torch.empty_like(q),
    choose_platform=False,
)
