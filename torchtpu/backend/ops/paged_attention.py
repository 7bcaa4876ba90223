"""Paged KV cache and ragged paged attention for serving (pure JAX functions).

PyTorch reaches them through the torch ops of nn_paged.py (tpu tensors; inside torchtpu.compile
the cache write is an in-place update of the donated cache buffer):

    cache = torch.zeros(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim),
                        dtype=torch.bfloat16, device="tpu")          # one tensor per layer
    torch.ops.torchtpu.paged_kv_write(cache, k, v, slot_mapping)     # mutates cache
    out = torch.ops.torchtpu.ragged_paged_attention(
        q, cache, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale, sliding_window, soft_cap)

The cache of one layer is `[num_blocks, block_size, 2 * num_kv_heads, cache_head_dim]`, keys at
the even and values at the odd slots of the head axis (the layout of JAX's Pallas kernel
`jax.experimental.pallas.ops.tpu.ragged_paged_attention`). `cache_head_dim` is the head dim,
or more: `kv_cache_shape` rounds it up to 128, which the Pallas kernel needs; both functions
pad k, v and q with zeros to it (a dot product with zeros adds nothing) and the output is cut
back to q's head dim.

- `write_kv_cache(kv_cache, k, v, slot_mapping)`: k, v `[tokens, kv_heads, head_dim]`; token
  i goes to slot `slot_mapping[i]` = block * block_size + offset; a negative slot is padding
  and is not written. One scatter into the cache: with the cache donated (a compiled step's
  state is), XLA updates it in place.
- `ragged_paged_attention(q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs, ...)`: q
  `[tokens, q_heads, head_dim]` holds the new tokens of `num_seqs[0]` sequences back to back,
  sequence s at `cu_q_lens[s]:cu_q_lens[s + 1]`; its context (the new tokens included) is
  `kv_lens[s]` tokens long, in the blocks `block_tables[s]`. Query i of a sequence (0-based)
  attends the context positions p < kv_len - q_len + i + 1, and within a sliding window w also
  p > kv_len - q_len + i - w; `soft_cap` caps the scores at soft_cap * tanh(s / soft_cap).
  Prefill, chunked prefill and decode sequences mix freely. Tokens past `cu_q_lens[num_seqs]`
  (padding) give zeros. Grouped-query attention: query head h reads kv head h // (q_heads /
  kv_heads). All shapes are fixed (the token and sequence counts are padded buckets), so one
  compiled program serves every batch of a bucket.

A quantized cache holds fp8 (`kv_dtype`: float8_e4m3fn or float8_e5m2), either typed as that fp8
type or as uint8 bytes of it (vLLM allocates its fp8 caches as uint8), with one float scale for
the keys and one for the values (`k_scale`, `v_scale`; 1.0 unless a checkpoint provides them).
The write stores `clip(x / scale, -max, max)` rounded to the fp8 type (saturating to its largest
finite value, as vLLM's CUDA kernels do); attention reads `fp8 -> float32 x scale` (the Pallas
kernel converts inside the kernel, to float32 then q's dtype). Half the bytes of a bfloat16 cache
per token. An unquantized cache (`kv_dtype=None` and a cache of a non-fp8 type) is stored and read
as its own type. The kernel loads an 8-bit cache four bytes a word, two kv heads' keys and
values, so it takes an fp8 cache with an even number of kv heads per shard; with one, attention
runs as the pure JAX form (logged once on a TPU host).

On TPU the attention runs JAX's Pallas ragged paged attention kernel, chosen when the program
is lowered (`jax.lax.platform_dependent`, as attention_tpu.py does for training attention);
everywhere else, and for what the kernel does not take (`unsupported_reason`: a cache head dim
off multiples of 128, a head count its tiling rejects, TORCHTPU_PALLAS_ATTENTION=0), the pure
JAX attention below. Its cost: queries go in tiles of `q_tile` tokens; for each sequence a
tile holds, that sequence's context blocks are gathered in chunks of about 256 positions, once
for the whole tile, and the tile's scores against them are computed with an online softmax.
Memory is one chunk (`[q_tile, q_heads, 256]` scores and the chunk's K/V), never
`[tokens, context]`; the gathers read each (tile, sequence) pair's context once, so a decode
batch reads each context once per tile it falls in (once when its q_tile tokens are distinct
sequences), and a prefill of n tokens reads its context n / q_tile times. The loops run only
over the sequences and context a tile really has (their trip counts come from the data, the
shapes do not).

Pallas interpret mode does not run this kernel with jax 0.10.2 (the plain interpreter fails
discharging its masked stores, the TPU interpreter on a reshaped ref), so on CPU the kernel is
only compiled ahead of time for TPU topologies (tests/backend/test_paged_attention.py), not run.
Mosaic lowers the kernel for an fp8 cache with the chip generation of JAX's default device, so
compiling that ahead of time on a host without TPUs needs `jax.default_device(<a device of the
topology>)` around the lowering (tests/serve/test_kv_cache_dtype.py).

Under tensor parallelism (a mesh with a "tp" axis over which the kv heads divide) both
functions run per shard under `jax.shard_map`: q and the cache split over heads, the metadata
replicated; attention is independent per kv head, so no collective is needed.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as _rpa
from jax.sharding import PartitionSpec as P

from ...hardware import TP_AXIS
from . import attention_tpu

__all__ = [
    "kv_cache_shape",
    "cache_head_dim",
    "write_kv_cache",
    "ragged_paged_attention",
    "ragged_paged_attention_jax",
    "unsupported_reason",
    "kernel_cost",
    "fp8_format",
    "quantize",
    "check_scales",
]

log = logging.getLogger("torchtpu")

_LANES = 128
_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_MASKED = -1e30  # a finite "minus infinity" for the online softmax (exp gives 0, never NaN)
_CHUNK_POSITIONS = 256  # context positions per gathered chunk in the pure JAX attention


def cache_head_dim(head_dim: int) -> int:
    """The cache's last dimension for heads of `head_dim`: rounded up to 128 (the Pallas
    kernel's lane width)."""
    return -(-head_dim // _LANES) * _LANES


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """The shape of one layer's cache: `[num_blocks, block_size, 2 * num_kv_heads, cache_head_dim(head_dim)]`."""
    return (num_blocks, block_size, 2 * num_kv_heads, cache_head_dim(head_dim))


def _check_cache(kv_cache, head_dim: int, where: str):
    if kv_cache.ndim != 4 or kv_cache.shape[2] % 2:
        raise ValueError(
            f"{where}: kv_cache of shape {tuple(kv_cache.shape)} is not "
            "[num_blocks, block_size, 2 * num_kv_heads, head_dim] (see kv_cache_shape)"
        )
    if kv_cache.shape[3] < head_dim:
        raise ValueError(
            f"{where}: kv_cache head dim {kv_cache.shape[3]} is smaller than the heads' {head_dim}; "
            "allocate it with kv_cache_shape"
        )


def fp8_format(cache_dtype, kv_dtype=None, where: str = "paged attention"):
    """The fp8 type a cache of `cache_dtype` holds, or None for an unquantized cache: `kv_dtype`
    when given (the cache is that fp8 type, or uint8 bytes of it), else the cache's own type if
    it is an fp8 type."""
    cache_dtype = jnp.dtype(cache_dtype)
    if kv_dtype is None:
        return cache_dtype if cache_dtype in _FP8 else None
    kv_dtype = jnp.dtype(kv_dtype)
    if kv_dtype not in _FP8:
        raise ValueError(f"{where}: kv_dtype {kv_dtype} is not an fp8 type (float8_e4m3fn or float8_e5m2)")
    if cache_dtype not in (kv_dtype, jnp.dtype(jnp.uint8)):
        raise ValueError(
            f"{where}: a kv_cache of {cache_dtype} cannot hold {kv_dtype}; allocate it as {kv_dtype} or uint8"
        )
    return kv_dtype


def check_scales(k_scale, v_scale, where: str):
    """Raise unless both scales of an fp8 cache are positive and finite; `where` starts the message."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not 0 < float(value) < float("inf"):
            raise ValueError(f"{where}: {name}={value}; an fp8 cache's scales are positive and finite")


def quantize(x, scale: float, fp8):
    """x / scale in the fp8 type `fp8`, saturated to its largest finite value (NaN stays NaN)."""
    top = float(jnp.finfo(fp8).max)
    return jnp.clip(x.astype(jnp.float32) / jnp.float32(scale), -top, top).astype(fp8)


def _viewed_as(x, dtype):
    """x's bytes as `dtype` of the same width (fp8 values as uint8 bytes, or back); x itself if it
    is of that dtype."""
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def _pad_last(x, size: int):
    if x.shape[-1] == size:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


# ----------------------------------------------------------------------------- per-shard split


def _head_split(kv_heads: int, *arrays):
    """(mesh, head axis or None) for running per shard, or None outside a multi-device mesh."""
    mesh = attention_tpu.mesh_of(*arrays)
    if mesh is None:
        return None
    tp = dict(mesh.shape).get(TP_AXIS, 1)
    return mesh, (TP_AXIS if tp > 1 and kv_heads % tp == 0 else None)


def _per_head_shard(fn, split, specs_in, spec_out):
    """`fn` per shard of `split` (see _head_split), `specs_in`/`spec_out` naming the head
    dimension of each operand (an int) or None for a replicated operand."""
    if split is None:
        return fn
    mesh, axis = split

    def spec(entry):
        if entry is None:
            return P()
        dim, ndim = entry
        return P(*[axis if i == dim else None for i in range(ndim)])

    return jax.shard_map(
        fn, mesh=mesh, in_specs=tuple(spec(s) for s in specs_in), out_specs=spec(spec_out), check_vma=False
    )


# ----------------------------------------------------------------------------- cache write


def write_kv_cache(kv_cache, k, v, slot_mapping, *, kv_dtype=None, k_scale: float = 1.0, v_scale: float = 1.0):
    """`kv_cache` with token i's k and v written at slot `slot_mapping[i]` (negative: skipped).
    `slot_mapping` may be longer than k (a padded bucket); its first len(k) entries are used.
    An fp8 cache (`kv_dtype`, see the module's docstring) gets k / k_scale and v / v_scale,
    saturated, in its fp8 type."""
    tokens, kv_heads, head_dim = k.shape
    _check_cache(kv_cache, head_dim, "write_kv_cache")
    fp8 = fp8_format(kv_cache.dtype, kv_dtype, "write_kv_cache")
    if fp8 is not None:
        check_scales(k_scale, v_scale, "write_kv_cache")
    if v.shape != k.shape:
        raise ValueError(f"write_kv_cache: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if kv_cache.shape[2] != 2 * kv_heads:
        raise ValueError(
            f"write_kv_cache: kv_cache has {kv_cache.shape[2]} head slots, not 2 x {kv_heads} kv heads of k and v"
        )
    if slot_mapping.ndim != 1 or slot_mapping.shape[0] < tokens:
        raise ValueError(f"write_kv_cache: slot_mapping {tuple(slot_mapping.shape)} has fewer than {tokens} entries")
    slots = slot_mapping[:tokens]

    def local(cache, k, v, slots):
        blocks, block_size, combined, dim = cache.shape
        if fp8 is not None:
            k, v = quantize(k, k_scale, fp8), quantize(v, v_scale, fp8)
        kv = jnp.stack([k, v], axis=2).reshape(tokens, combined, k.shape[-1])  # k, v interleaved per head
        if fp8 is None:
            kv = _pad_last(kv, dim).astype(cache.dtype)
        else:  # the fp8 values, or their bytes in a uint8 cache
            kv = _viewed_as(_pad_last(kv, dim), cache.dtype)
        rows = blocks * block_size
        # an index past the end is dropped (a negative one would count from the end)
        at = jnp.where(slots < 0, rows, slots)
        flat = cache.reshape(rows, combined, dim).at[at].set(kv, mode="drop")
        return flat.reshape(cache.shape)

    split = _head_split(kv_heads, kv_cache, k, v)
    return _per_head_shard(local, split, [(2, 4), (1, 3), (1, 3), None], (2, 4))(kv_cache, k, v, slots)


# ----------------------------------------------------------------------------- pure JAX attention


def _token_positions(num_tokens, kv_lens, cu_q_lens, num_seqs):
    """Per token: (its sequence, its position in that sequence's context, whether it is real)."""
    max_seqs = kv_lens.shape[0]
    n = num_seqs[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    ends = jnp.where(jnp.arange(max_seqs) < n, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    seq = jnp.clip(jnp.searchsorted(ends, t, side="right").astype(jnp.int32), 0, max_seqs - 1)
    start, end = cu_q_lens[seq], cu_q_lens[seq + 1]
    pos = kv_lens[seq] - (end - start) + (t - start)
    return seq, pos, t < cu_q_lens[n]


def ragged_paged_attention_jax(
    q,
    kv_cache,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    q_tile: int = 16,
    kv_dtype=None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """Ragged paged attention in pure JAX (any platform; see the module's note on its cost). An
    fp8 cache (`kv_dtype`, see the module's docstring) is read as float32 times its scales."""
    tokens, heads, head_dim = q.shape
    _, block_size, combined, cache_dim = kv_cache.shape
    fp8 = fp8_format(kv_cache.dtype, kv_dtype, "ragged_paged_attention")
    if fp8 is not None:
        check_scales(k_scale, v_scale, "ragged_paged_attention")
    scaled = fp8 is not None and (k_scale, v_scale) != (1.0, 1.0)
    kv_heads = combined // 2
    group = heads // kv_heads
    kv_lens, block_tables, cu_q_lens, num_seqs = (
        x.astype(jnp.int32) for x in (kv_lens, block_tables, cu_q_lens, num_seqs)
    )
    chunk_blocks = max(1, min(block_tables.shape[1], _CHUNK_POSITIONS // block_size))
    span = chunk_blocks * block_size
    pad_blocks = -block_tables.shape[1] % chunk_blocks
    tables = jnp.pad(block_tables, ((0, 0), (0, pad_blocks)))

    q_tile = max(1, min(q_tile, tokens))
    n_tiles = -(-tokens // q_tile)
    seq, pos, real = _token_positions(n_tiles * q_tile, kv_lens, cu_q_lens, num_seqs)
    qf = jnp.pad(q, ((0, n_tiles * q_tile - tokens), (0, 0), (0, 0))).astype(jnp.float32)
    qf = qf.reshape(n_tiles, q_tile, kv_heads, group, head_dim) * jnp.float32(sm_scale)
    lanes = jnp.arange(span, dtype=jnp.int32)

    def tile(args):
        qt, seq_t, pos_t, real_t = args

        def per_sequence(s, state):
            mine = real_t & (seq_t == s)
            last = jnp.max(jnp.where(mine, pos_t, 0))
            first = 0
            if sliding_window is not None:
                first = jnp.maximum(jnp.min(jnp.where(mine, pos_t, last)) - sliding_window + 1, 0)

            def per_chunk(c, state):
                m, l, acc = state
                blocks = lax.dynamic_slice_in_dim(tables[s], c * chunk_blocks, chunk_blocks)
                kv = kv_cache[blocks].reshape(span, kv_heads, 2, cache_dim)[..., :head_dim]
                kv = (kv if fp8 is None else _viewed_as(kv, fp8)).astype(jnp.float32)
                if scaled:  # dequantized: keys x k_scale, values x v_scale
                    kv = kv * jnp.array([k_scale, v_scale], jnp.float32)[:, None]
                p = c * span + lanes
                allowed = mine[:, None] & (p[None, :] <= pos_t[:, None])
                if sliding_window is not None:
                    allowed = allowed & (p[None, :] > pos_t[:, None] - sliding_window)
                scores = jnp.einsum("tkgd,pkd->tkgp", qt, kv[:, :, 0])
                if soft_cap is not None:
                    scores = soft_cap * jnp.tanh(scores / soft_cap)
                allowed = allowed[:, None, None, :]
                scores = jnp.where(allowed, scores, _MASKED)
                m_new = jnp.maximum(m, scores.max(-1))
                w = jnp.where(allowed, jnp.exp(scores - m_new[..., None]), 0.0)
                alpha = jnp.exp(m - m_new)
                acc = acc * alpha[..., None] + jnp.einsum("tkgp,pkd->tkgd", w, kv[:, :, 1])
                return m_new, l * alpha + w.sum(-1), acc

            return lax.fori_loop(first // span, last // span + 1, per_chunk, state)

        state = (
            jnp.full(qt.shape[:-1], _MASKED, jnp.float32),
            jnp.zeros(qt.shape[:-1], jnp.float32),
            jnp.zeros(qt.shape, jnp.float32),
        )
        lo = seq_t[0]
        hi = jnp.max(jnp.where(real_t, seq_t, -1))
        _, l, acc = lax.fori_loop(lo, hi + 1, per_sequence, state)
        return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)

    shaped = (x.reshape(n_tiles, q_tile) for x in (seq, pos, real))
    out = lax.map(tile, (qf, *shaped))
    return out.reshape(n_tiles * q_tile, heads, head_dim)[:tokens].astype(q.dtype)


# ----------------------------------------------------------------------------- Pallas kernel


def unsupported_reason(q_shape, cache_shape, q_dtype, cache_dtype) -> str | None:
    """Why the Pallas kernel cannot run attention of these per-shard shapes, or None if it can."""
    if not attention_tpu.enabled():
        return "TORCHTPU_PALLAS_ATTENTION=0"
    if cache_shape[3] % _LANES:
        return f"cache head dim {cache_shape[3]} is not a multiple of {_LANES} (allocate it with kv_cache_shape)"
    if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"dtype {jnp.dtype(q_dtype)} (the kernel takes float32 or bfloat16)"
    if jnp.dtype(cache_dtype).itemsize == 1 and cache_shape[2] % 4:
        return (
            f"an odd number of kv heads per shard ({cache_shape[2] // 2}) in an 8-bit cache (the kernel loads "
            "four bytes a word: two kv heads' keys and values)"
        )
    try:
        _rpa.kernel.get_min_heads_per_blk(q_shape[1], cache_shape[2], q_dtype, cache_dtype)
    except (ValueError, AssertionError) as e:
        return f"head counts {q_shape[1]} / {cache_shape[2] // 2}: {e}"
    return None


# Rows of a decode block's score matmul: queries per block x query heads per kv head. 128 is one
# pass of the MXU's height (v5p's 128 x 128 arrays).
_DECODE_ROWS = 128


def _kernel_blocks(q_dtype, cache_dtype, heads, combined, head_dim, page_size, tokens, pages_per_seq, max_seqs):
    """(kv pages, queries) per kernel block: the library's tuned table where JAX names a TPU
    (on a TPU host); its untuned default (128 pages, 32 queries) when compiling ahead of time
    from a host without one (the library's lookup reads jax.devices()).

    A bucket of no more tokens than sequences (a decode step: one new token per sequence) takes
    fewer queries per block: `_DECODE_ROWS // (query heads per kv head)`, at least one and at most
    the table's. The kernel computes its whole query block against each sequence of the block (a
    [queries x heads per kv head, context] score tile, its softmax and the product with V), and in
    a decode block each sequence owns one query of it: 32 queries a block compute 32 rows per real
    one. At 16, Llama 3 70B under tensor parallel 8 (8 query heads per kv head) computes 128 rows
    per sequence and kv head instead of 256, reads the same context pages, and walks 4 query blocks
    instead of 2. Prefill and mixed buckets keep the table's size."""
    try:
        q_heads, kv_combined = _rpa.kernel.get_min_heads_per_blk(heads, combined, q_dtype, cache_dtype)
        pages, queries = _rpa.get_tuned_block_sizes(
            q_dtype, cache_dtype, q_heads, kv_combined // 2, head_dim, page_size, tokens, pages_per_seq
        )
    except (NotImplementedError, AssertionError, RuntimeError):
        pages, queries = min(pages_per_seq, 128), min(tokens, 32)
    if tokens <= max_seqs:
        per_kv_head = max(1, heads // max(1, combined // 2))
        queries = max(1, min(queries, _DECODE_ROWS // per_kv_head))
    return pages, queries


def kernel_cost(tokens, heads, head_dim, max_seqs, pages_per_seq, page_size, combined, itemsize, q_itemsize, bq):
    """The cost the Pallas kernel is declared to XLA with (it declares none itself), per shard.

    The kernel walks (query block, sequence) pairs: at most one per query block plus one per
    further sequence. Each pair copies in its sequence's context pages and computes the whole
    query block against them. The bound taken is full block tables (context = pages_per_seq *
    page_size for every pair), which is exact for a decode step whose block tables are sized to
    its context and an upper bound otherwise."""
    from jax.experimental import pallas as pl

    pairs = min(-(-tokens // bq) + max_seqs - 1, max_seqs * -(-tokens // bq))
    context = pages_per_seq * page_size
    kv_bytes = pairs * context * combined * head_dim * itemsize
    scores = pairs * bq * heads * context
    return pl.CostEstimate(
        flops=int(4 * scores * head_dim),
        transcendentals=int(scores),
        bytes_accessed=int(kv_bytes + 2 * tokens * heads * head_dim * q_itemsize),
    )


def _pallas_attention(
    q,
    kv_cache,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    kv_dtype=None,
    k_scale=1.0,
    v_scale=1.0,
):
    tokens, heads, head_dim = q.shape
    fp8 = fp8_format(kv_cache.dtype, kv_dtype, "ragged_paged_attention")
    # an fp8 cache goes to the kernel as its fp8 type, which dequantizes each block it loads
    scales = {}
    if fp8 is not None:
        kv_cache = _viewed_as(kv_cache, fp8)
        scales = dict(k_scale=float(k_scale), v_scale=float(v_scale))
    _, page_size, combined, cache_dim = kv_cache.shape
    max_seqs, pages_per_seq = block_tables.shape
    qp = _pad_last(q, cache_dim)
    pages, queries = _kernel_blocks(
        q.dtype, kv_cache.dtype, heads, combined, cache_dim, page_size, tokens, pages_per_seq, max_seqs
    )
    cost = kernel_cost(
        tokens,
        heads,
        cache_dim,
        max_seqs,
        pages_per_seq,
        page_size,
        combined,
        kv_cache.dtype.itemsize,
        q.dtype.itemsize,
        queries,
    )
    meta = tuple(x.astype(jnp.int32) for x in (kv_lens, block_tables, cu_q_lens, num_seqs))

    def kernel(q, cache, *meta):
        # the library's function unjitted, so its pallas_call is this jaxpr's own and takes the cost
        return (
            _rpa.ragged_paged_attention.__wrapped__(
                q,
                cache,
                *meta,
                sm_scale=sm_scale,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
                num_kv_pages_per_block=pages,
                num_queries_per_block=queries,
                **scales,
            ),
        )

    with jax.enable_x64(False):  # Mosaic index maps are 32-bit
        (out,) = attention_tpu.bind_pallas(kernel, (qp, kv_cache, *meta), [cost], False)
    # the kernel leaves padding tokens' rows as it finds them
    real = jnp.arange(tokens) < meta[2][meta[3][0]]
    return jnp.where(real[:, None, None], out[..., :head_dim], jnp.zeros((), out.dtype))


_FP8_FALLBACKS: set = set()


def _note_fp8_fallback(reason: str) -> None:
    """Log once per reason, on a TPU host, that attention over an fp8 cache runs without the kernel."""
    if reason in _FP8_FALLBACKS or jax.default_backend() != "tpu":
        return
    _FP8_FALLBACKS.add(reason)
    log.warning(
        "torchtpu ragged paged attention over an fp8 KV cache on TPU: no Pallas kernel (%s); it runs as the "
        "pure JAX attention",
        reason,
    )


def ragged_paged_attention(
    q,
    kv_cache,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_dtype=None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """Ragged paged attention (see the module's docstring): the Pallas kernel on TPU, the pure
    JAX attention elsewhere; per head shard under tensor parallelism. An fp8 cache: `kv_dtype`,
    `k_scale`, `v_scale` as for write_kv_cache."""
    tokens, heads, head_dim = q.shape
    _check_cache(kv_cache, head_dim, "ragged_paged_attention")
    fp8 = fp8_format(kv_cache.dtype, kv_dtype, "ragged_paged_attention")
    kv_heads = kv_cache.shape[2] // 2
    if heads % kv_heads:
        raise ValueError(f"ragged_paged_attention: {heads} query heads are not a multiple of {kv_heads} kv heads")
    max_seqs = block_tables.shape[0]
    if kv_lens.shape != (max_seqs,) or cu_q_lens.shape != (max_seqs + 1,) or num_seqs.shape != (1,):
        raise ValueError(
            f"ragged_paged_attention: kv_lens {tuple(kv_lens.shape)}, cu_q_lens {tuple(cu_q_lens.shape)}, "
            f"num_seqs {tuple(num_seqs.shape)} must be ({max_seqs},), ({max_seqs + 1},), (1,) for block_tables "
            f"{tuple(block_tables.shape)}"
        )
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"ragged_paged_attention: sliding_window={sliding_window} must be positive or None")
    if soft_cap is not None and soft_cap == 0:
        raise ValueError("ragged_paged_attention: soft_cap=0 caps every score at 0; pass None for no cap")
    options = dict(sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap)
    if fp8 is not None:
        options.update(kv_dtype=fp8, k_scale=float(k_scale), v_scale=float(v_scale))
    split = _head_split(kv_heads, q, kv_cache)
    shards = 1 if split is None or split[1] is None else dict(split[0].shape)[split[1]]
    local_q = (tokens, heads // shards, head_dim)
    local_cache = (*kv_cache.shape[:2], kv_cache.shape[2] // shards, kv_cache.shape[3])
    reason = unsupported_reason(local_q, local_cache, q.dtype, fp8 or kv_cache.dtype)
    use_kernel = reason is None
    if fp8 is not None and reason is not None:
        _note_fp8_fallback(reason)

    def local(q, cache, *meta):
        if not use_kernel:
            return ragged_paged_attention_jax(q, cache, *meta, **options)
        return lax.platform_dependent(
            q,
            cache,
            *meta,
            tpu=lambda *a: _pallas_attention(*a, **options),
            default=lambda *a: ragged_paged_attention_jax(*a, **options),
        )

    specs = [(1, 3), (2, 4), None, None, None, None]
    return _per_head_shard(local, split, specs, (1, 3))(q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
