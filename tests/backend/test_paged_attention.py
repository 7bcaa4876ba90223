"""The paged KV cache and ragged paged attention (torchtpu/backend/ops/paged_attention.py).

The oracle is PyTorch on CPU written here: per sequence, its keys and values gathered from its
blocks and PyTorch's scaled_dot_product_attention with the causal (and sliding-window) mask of
the sequence's new tokens; the cache write against a CPU index_put.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401
from torchtpu.backend import aot
from torchtpu.backend.ops import paged_attention as pa
from torchtpu.distributed import topology

BLOCK = 4


def _batch(q_lens, kv_lens, kv_heads, group, head_dim, *, blocks=40, max_seqs=None, tokens=None, seed=0):
    """A random cache and a batch of sequences (q_lens new tokens each, kv_lens context each),
    their blocks scattered over the cache in random order; padded to `max_seqs` sequences and
    `tokens` query tokens like a serving bucket."""
    g = torch.Generator().manual_seed(seed)
    n = len(q_lens)
    max_seqs = max_seqs or n
    tokens = tokens or sum(q_lens)
    per_seq = max(-(-k // BLOCK) for k in kv_lens) + 1
    order = torch.randperm(blocks, generator=g)
    tables = torch.zeros(max_seqs, per_seq, dtype=torch.int32)
    used = 0
    for s, k in enumerate(kv_lens):
        nb = -(-k // BLOCK)
        tables[s, :nb] = order[used : used + nb]
        used += nb
    assert used <= blocks
    cache = torch.randn(blocks, BLOCK, 2 * kv_heads, head_dim, generator=g)
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=g)
    cu = torch.zeros(max_seqs + 1, dtype=torch.int32)
    cu[1 : n + 1] = torch.tensor(q_lens).cumsum(0)
    cu[n + 1 :] = cu[n]
    lens = torch.zeros(max_seqs, dtype=torch.int32)
    lens[:n] = torch.tensor(kv_lens)
    return q, cache, lens, tables, cu, torch.tensor([n], dtype=torch.int32)


def _oracle(q, cache, kv_lens, tables, cu, num_seqs, *, scale, window=None, soft_cap=None):
    """PyTorch on CPU, one sequence at a time, in float32."""
    q, cache = q.float(), cache.float()
    out = torch.zeros_like(q)
    heads = q.shape[1]
    kv_heads = cache.shape[2] // 2
    for s in range(int(num_seqs[0])):
        a, b, L = int(cu[s]), int(cu[s + 1]), int(kv_lens[s])
        nb = -(-L // BLOCK)
        ctx = cache[tables[s, :nb].long()].reshape(nb * BLOCK, 2 * kv_heads, -1)[:L]
        k, v = ctx[:, 0::2], ctx[:, 1::2]
        qs = q[a:b].transpose(0, 1)  # heads, q_len, d
        k = k.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = v.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        pos = torch.arange(L - (b - a), L)[:, None]
        p = torch.arange(L)[None, :]
        allowed = p <= pos
        if window is not None:
            allowed &= p > pos - window
        if soft_cap is None:
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=allowed, scale=scale)
        else:
            scores = soft_cap * torch.tanh(qs @ k.transpose(1, 2) * scale / soft_cap)
            o = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
        out[a:b] = o.transpose(0, 1)
    return out


def _jax(*tensors):
    return [jnp.asarray(t.float().numpy()) if t.is_floating_point() else jnp.asarray(t.numpy()) for t in tensors]


# mixed: a long prefill, a chunked prefill (context before its new tokens), 3 decodes, and a
# 1-token prefill; padded to 8 sequences and 40 tokens
MIXED = dict(q_lens=[13, 5, 1, 1, 1, 1], kv_lens=[13, 17, 9, 30, 2, 1], max_seqs=8, tokens=40)


def _attend(batch, **kw):
    fn = jax.jit(functools.partial(pa.ragged_paged_attention_jax, **kw))
    return torch.from_numpy(np.array(fn(*_jax(*batch))))


def _check(got, batch, want, tol):
    n = int(batch[4][int(batch[5][0])])
    torch.testing.assert_close(got[:n].float(), want[:n], **tol)
    assert torch.all(got[n:] == 0), "padding tokens must give zeros"


@pytest.mark.parametrize(
    "kv_heads,group,head_dim,window,soft_cap",
    [(2, 1, 16, None, None), (1, 4, 32, 6, None), (2, 3, 8, 3, 2.0)],
    ids=["mha", "gqa-window", "gqa-window-softcap"],
)
def test_pure_jax_matches_torch_cpu(kv_heads, group, head_dim, window, soft_cap):
    batch = _batch(**MIXED, kv_heads=kv_heads, group=group, head_dim=head_dim)
    scale = 1 / math.sqrt(head_dim)
    want = _oracle(*batch, scale=scale, window=window, soft_cap=soft_cap)
    got = _attend(batch, sm_scale=scale, sliding_window=window, soft_cap=soft_cap)
    _check(got, batch, want, dict(atol=1e-5, rtol=1e-5))


def test_bf16_matches_torch_cpu():
    q, cache, *meta = _batch(**MIXED, kv_heads=2, group=2, head_dim=16, seed=1)
    q, cache = q.bfloat16(), cache.bfloat16()
    want = _oracle(q, cache, *meta, scale=0.25)
    fn = jax.jit(functools.partial(pa.ragged_paged_attention_jax, sm_scale=0.25))
    got = fn(
        jnp.asarray(q.float().numpy(), jnp.bfloat16), jnp.asarray(cache.float().numpy(), jnp.bfloat16), *_jax(*meta)
    )
    assert got.dtype == jnp.bfloat16
    _check(torch.from_numpy(np.array(got.astype(jnp.float32))), (q, cache, *meta), want, dict(atol=2e-2, rtol=2e-2))


@pytest.mark.parametrize("q_tile", [1, 64])
def test_query_tilings_match_torch_cpu(q_tile):
    """One token per tile, and every token in one tile (many sequences each), as the default."""
    batch = _batch(**MIXED, kv_heads=2, group=2, head_dim=16, seed=7)
    want = _oracle(*batch, scale=0.25, soft_cap=5.0)
    _check(_attend(batch, sm_scale=0.25, soft_cap=5.0, q_tile=q_tile), batch, want, dict(atol=1e-5, rtol=1e-5))


# ----------------------------------------------------------------------------- torch ops on tpu


def test_write_kv_cache_op_matches_cpu_scatter():
    """torch.ops.torchtpu.paged_kv_write mutates the tpu cache as index_put does on CPU: k at the
    even, v at the odd head slots, padding slots (-1) skipped, the head dim padded with zeros."""
    g = torch.Generator().manual_seed(2)
    blocks, kv_heads, head_dim, tokens = 6, 2, 16, 7
    shape = pa.kv_cache_shape(blocks, BLOCK, kv_heads, head_dim)
    assert shape == (blocks, BLOCK, 4, 128)
    cache = torch.randn(shape, generator=g)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=g) for _ in range(2))
    slots = torch.tensor([5, 0, -1, 23, 9, -1, 14])
    want = cache.clone().reshape(blocks * BLOCK, 2 * kv_heads, -1)
    keep = slots >= 0
    kv = torch.zeros(tokens, 2 * kv_heads, shape[-1])
    kv[:, 0::2, :head_dim], kv[:, 1::2, :head_dim] = k, v
    want[slots[keep]] = kv[keep]
    on_tpu = cache.to("tpu")
    torch.ops.torchtpu.paged_kv_write(on_tpu, k.to("tpu"), v.to("tpu"), slots.to("tpu"))
    assert torch.equal(on_tpu.cpu(), want.reshape(shape))


def test_attention_op_on_tpu_matches_torch_cpu():
    q, cache, *meta = _batch(**MIXED, kv_heads=2, group=2, head_dim=16, seed=3)
    want = _oracle(q, cache, *meta, scale=0.25, window=7)
    got = torch.ops.torchtpu.ragged_paged_attention(
        q.to("tpu"), cache.to("tpu"), *(m.to("tpu") for m in meta), 0.25, 7, None
    )
    assert got.device.type == "tpu" and got.shape == q.shape
    _check(got.cpu(), (q, cache, *meta), want, dict(atol=1e-5, rtol=1e-5))


def test_compiled_step_writes_the_cache_in_place():
    """A compiled decode step (write the new tokens, then attend) updates the cache it closes
    over: its buffer is donated and aliased to the step's output, no second cache buffer is
    made, and the values are the oracle's."""
    kv_heads, group, head_dim = 2, 2, 16
    # a cache larger than the attention's temporaries, so that a copy of it would show
    q, cache, lens, tables, cu, n = _batch(
        **MIXED, kv_heads=kv_heads, group=group, head_dim=head_dim, blocks=512, seed=4
    )
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(q.shape[0], kv_heads, head_dim, generator=g) for _ in range(2))
    # each real token's slot is its position in its sequence's blocks; the padding's -1
    slots = torch.full((q.shape[0],), -1)
    for s in range(int(n[0])):
        for i, t in enumerate(range(int(cu[s]), int(cu[s + 1]))):
            p = int(lens[s]) - (int(cu[s + 1]) - int(cu[s])) + i
            slots[t] = int(tables[s, p // BLOCK]) * BLOCK + p % BLOCK
    want_cache = cache.clone().reshape(-1, 2 * kv_heads, head_dim)
    real = slots >= 0
    want_cache[slots[real], 0::2], want_cache[slots[real], 1::2] = k[real], v[real]
    want_cache = want_cache.reshape(cache.shape)
    want = _oracle(q, want_cache, lens, tables, cu, n, scale=0.25)

    on_tpu = cache.to("tpu")
    meta = [t.to("tpu") for t in (lens, tables, cu, n)]

    def step(q, k, v, slots):
        torch.ops.torchtpu.paged_kv_write(on_tpu, k, v, slots)
        return torch.ops.torchtpu.ragged_paged_attention(q, on_tpu, *meta, 0.25)

    compiled = torchtpu.compile(step)
    args = [t.to("tpu") for t in (q, k, v, slots)]
    executable = compiled.compile_for(*args)
    mem = executable.memory_analysis()
    cache_bytes = cache.numel() * 4
    assert mem.alias_size_in_bytes >= cache_bytes, "the cache buffer is not aliased to the step's output"
    assert mem.temp_size_in_bytes < cache_bytes, f"a temporary as large as the cache: {mem}"
    got = compiled(*args)
    _check(got.cpu(), (q, want_cache, lens, tables, cu, n), want, dict(atol=1e-5, rtol=1e-5))
    torch.testing.assert_close(on_tpu.cpu(), want_cache)


# ----------------------------------------------------------------------------- tensor parallelism


def test_split_over_kv_heads_gives_the_unsplit_values():
    """q and the cache split over kv heads on a 4-device "tp" mesh: the write and the attention
    run per shard (no gather of the cache) and give the values of one device."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    q, cache, *meta = _jax(*_batch(**MIXED, kv_heads=4, group=2, head_dim=16, seed=6))
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    k = jnp.asarray(np.random.default_rng(0).standard_normal((q.shape[0], 4, 16)), jnp.float32)
    slots = jnp.arange(q.shape[0]) * 3 - 5

    def step(cache, q, k, slots, *meta):
        cache = pa.write_kv_cache(cache, k, -k, slots)
        return cache, pa.ragged_paged_attention(q, cache, *meta, sm_scale=0.25)

    want = jax.jit(step)(cache, q, k, slots, *meta)
    split = jax.jit(step, donate_argnums=0)
    heads = NamedSharding(mesh, P(None, "tp", None))
    args = (
        jax.device_put(cache, NamedSharding(mesh, P(None, None, "tp", None))),
        jax.device_put(q, heads),
        jax.device_put(k, heads),
        *(jax.device_put(x, NamedSharding(mesh, P())) for x in (slots, *meta)),
    )
    hlo = split.lower(*args).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo, "the split program moves the cache"
    got = split(*args)
    assert got[0].sharding.spec == P(None, None, "tp", None)
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- the TPU kernel


def test_kernel_is_chosen_only_where_it_applies():
    q = jnp.zeros((8, 4, 128), jnp.bfloat16)
    meta = (jnp.zeros(2, jnp.int32), jnp.zeros((2, 3), jnp.int32), jnp.zeros(3, jnp.int32), jnp.zeros(1, jnp.int32))
    fn = functools.partial(pa.ragged_paged_attention, sm_scale=1.0)
    jaxpr = str(jax.make_jaxpr(fn)(q, jnp.zeros((6, 16, 4, 128), jnp.bfloat16), *meta))
    assert "platform_index" in jaxpr and jaxpr.count("pallas_call") == 1
    small = jnp.zeros((6, 16, 4, 16), jnp.bfloat16)
    assert "pallas_call" not in str(jax.make_jaxpr(fn)(q[..., :16], small, *meta))
    assert "multiple of 128" in pa.unsupported_reason((8, 4, 16), small.shape, jnp.bfloat16, jnp.bfloat16)
    # on CPU the lowered program is the pure JAX attention
    assert "tpu_custom_call" not in jax.jit(fn).lower(q, jnp.zeros((6, 16, 4, 128), jnp.bfloat16), *meta).as_text()


def test_decode_buckets_take_smaller_query_blocks():
    bf = jnp.bfloat16
    # (kv pages, queries) per block for q heads, combined kv heads, head dim, page size, tokens, pages, seqs:
    # a decode bucket (no more tokens than sequences) takes 128 // (q heads per kv head) queries a block
    assert pa._kernel_blocks(bf, bf, 8, 2, 128, 32, 64, 64, 64) == (64, 16)  # Llama 3 70B, TP 8
    assert pa._kernel_blocks(bf, bf, 8, 4, 128, 32, 64, 64, 64) == (64, 32)  # Llama 3 8B, TP 4
    assert pa._kernel_blocks(bf, bf, 8, 2, 128, 32, 8, 64, 8) == (64, 8)  # never more than the tokens
    # prefill and mixed buckets keep the library's size
    assert pa._kernel_blocks(bf, bf, 8, 2, 128, 32, 2048, 64, 8) == (64, 32)
    assert pa._kernel_blocks(bf, bf, 8, 2, 128, 32, 128, 64, 64) == (64, 32)
    # the declared cost is the work of the blocks the kernel walks: half the score FLOPs at 16 queries
    at = {bq: pa.kernel_cost(64, 8, 128, 64, 64, 32, 2, 2, 2, bq) for bq in (32, 16)}
    assert at[16].flops * 2 == at[32].flops * 67 // 65
    assert at[16].bytes_accessed > at[32].bytes_accessed  # two more (query block, sequence) pairs' pages


@pytest.mark.skipif(not topology.libtpu_available(), reason="needs libtpu")
def test_kernel_compiles_for_a_tpu_topology_under_tensor_parallelism():
    """Compiled ahead of time for v5e:2x2 with q and the cache split over 4 chips: the attention
    is the Mosaic kernel, its declared cost reaches XLA's cost analysis, and the cache write is
    aliased in place."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = topology.topology_mesh("v5e:2x2", (4,), ("tp",))
    tokens, heads, kv_heads, dim, blocks, block, seqs, pages = 64, 16, 8, 128, 64, 16, 8, 4

    def sds(shape, dtype, spec=None):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec or P()))

    cache = sds((blocks, block, 2 * kv_heads, dim), jnp.bfloat16, P(None, None, "tp", None))
    new = sds((tokens, kv_heads, dim), jnp.bfloat16, P(None, "tp", None))
    q = sds((tokens, heads, dim), jnp.bfloat16, P(None, "tp", None))
    meta = (sds((seqs,), jnp.int32), sds((seqs, pages), jnp.int32), sds((seqs + 1,), jnp.int32), sds((1,), jnp.int32))

    def step(cache, k, v, slots, q, *meta):
        cache = pa.write_kv_cache(cache, k, v, slots)
        return cache, pa.ragged_paged_attention(q, cache, *meta, sm_scale=0.1)

    compiled = aot.aot_compile(
        jax.jit(step, donate_argnums=0).lower(cache, new, new, sds((tokens,), jnp.int32), q, *meta)
    )
    hlo = compiled.as_text()
    assert hlo.count("ragged_paged_attention_kernel") >= 1 and "tpu_custom_call" in hlo
    assert "all-gather" not in hlo
    declared = pa.kernel_cost(tokens, heads // 4, dim, seqs, pages, block, 2 * kv_heads // 4, 2, 2, 32)
    assert compiled.cost_analysis()["flops"] >= declared.flops
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes >= blocks * block * 2 * kv_heads * dim * 2 // 4


# ----------------------------------------------------------------------------- bad input


def test_bad_shapes_name_the_problem():
    q = jnp.zeros((8, 6, 16))
    cache = jnp.zeros((6, 4, 4, 16))
    meta = (jnp.zeros(2, jnp.int32), jnp.zeros((2, 3), jnp.int32), jnp.zeros(3, jnp.int32), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="not a multiple of 2 kv heads"):
        pa.ragged_paged_attention(jnp.zeros((8, 5, 16)), cache, *meta, sm_scale=1.0)
    with pytest.raises(ValueError, match="kv_cache head dim 16 is smaller"):
        pa.ragged_paged_attention(jnp.zeros((8, 6, 32)), cache, *meta, sm_scale=1.0)
    with pytest.raises(ValueError, match=r"must be \(2,\), \(3,\), \(1,\)"):
        pa.ragged_paged_attention(q, cache, meta[0], meta[1], meta[0], meta[3], sm_scale=1.0)
    with pytest.raises(ValueError, match="sliding_window=0"):
        pa.ragged_paged_attention(q, cache, *meta, sm_scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="head slots, not 2 x 3"):
        pa.write_kv_cache(cache, jnp.zeros((8, 3, 16)), jnp.zeros((8, 3, 16)), jnp.zeros(8, jnp.int32))
    with pytest.raises(ValueError, match="fewer than 8 entries"):
        pa.write_kv_cache(cache, jnp.zeros((8, 2, 16)), jnp.zeros((8, 2, 16)), jnp.zeros(4, jnp.int32))
