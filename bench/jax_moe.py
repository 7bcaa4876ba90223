"""The pure-JAX Qwen3 Mixture-of-Experts model the MoE benchmarks compare torchtpu against.

Written the way a strong JAX user would, independently of torchtpu, with torchtitan's Qwen3 MoE
math (`args`: torchtitan's Qwen3ModelArgs): pre-norm blocks, q/k RMSNorm per head, rotary
embedding, grouped-query attention (bench/jax_llama.py's, the Pallas flash kernel with
attention="pallas"), and a token-choice top-k MoE feed-forward:

- router: gate (dim -> experts) logits, softmax (or sigmoid) scores in float32, top-k, the top-k
  scores renormalized when `route_norm`, scaled by `route_scale`;
- dispatch: the (token, choice) pairs sorted by expert (stable argsort of the expert ids), the
  token rows gathered in that order, tokens per expert counted by compare-and-sum (the chosen
  scores are a one-hot contraction of the scores, so no gradient is a scatter of scalars, which
  XLA's TPU cost model cannot time);
- experts: SwiGLU as three grouped matmuls over each expert's rows, megablox's `gmm` per shard of
  the routed rows under `shard_map` (weights whole on each device, as FSDP gathers them); JAX's
  autodiff of `gmm` gives the input gradient (gmm) and the weight gradient (tgmm);
- combine: each pair's row gathered back to (token, choice) order and summed with its score.

Parameters are a dict keyed by torchtitan's state_dict names; `pin(x, kind)` places activations
("resid" (b, s, dim), "heads" (b, s, h, d), "hidden" (b, s, features), "logits", "rows" (routed
rows, features)). Dropless, like torchtitan's MoE.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from bench.jax_llama import _attention, apply_rope, rms_norm, rope_tables

__all__ = ["LAYER_KEYS", "make_loss"]

LAYER_KEYS = (
    "attention_norm.weight",
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "attention.wo.weight",
    "attention.q_norm.weight",
    "attention.k_norm.weight",
    "ffn_norm.weight",
    "moe.router.gate.weight",
    "moe.experts.w1",
    "moe.experts.w2",
    "moe.experts.w3",
)


def _tiles(m, k, n):
    def pick(x, choices):
        return next(c for c in choices if x % c == 0)

    return pick(m, (512, 256, 128)), pick(k, (1024, 512, 256, 128)), pick(n, (1024, 512, 256, 128))


def _grouped(x, w, sizes_global, mesh, row_axes):
    """(M, K) x (E, K, N) per group of rows, megablox gmm per shard of the rows."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    shards = math.prod(mesh.shape[a] for a in row_axes) if row_axes else 1
    m_local = x.shape[0] // shards
    tile = _tiles(m_local, x.shape[1], w.shape[2])
    ends = jnp.cumsum(sizes_global).astype(jnp.int32)

    def local(x, w, ends):
        start = jax.lax.axis_index(row_axes) * m_local if row_axes else 0
        local_ends = jnp.clip(ends - start, 0, m_local)
        sizes = jnp.diff(local_ends, prepend=jnp.zeros((1,), jnp.int32)).astype(jnp.int32)
        return gmm(x, w, sizes, jnp.float32, tile).astype(x.dtype)

    if not row_axes:
        return local(x, w, ends)
    rows = P(row_axes)
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, P(), P()), out_specs=rows, check_vma=False)(x, w, ends)


def make_loss(args, seq, *, pin, compute_dtype, remat, attention, mesh, batch_axes, tp=None):
    """loss_fn(params, tokens, labels): mean token cross entropy (float32 logits) of torchtitan's
    Qwen3 MoE with `args`."""
    head_dim = args.head_dim
    n_kv = args.n_kv_heads or args.n_heads
    moe = args.moe_args
    experts, top_k = moe.num_experts, moe.top_k
    cos, sin = rope_tables(head_dim, seq, args.rope_theta)
    row_axes = tuple(a for a in (batch_axes or ()) if mesh.shape[a] > 1) if mesh is not None else ()

    def cast(x):
        return x.astype(compute_dtype)

    def moe_ffn(x, w):
        b, s, d = x.shape
        t = x.reshape(b * s, d)
        logits = (t @ w["moe.router.gate.weight"].T).astype(jnp.float32)
        scores = jax.nn.sigmoid(logits) if moe.score_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
        _, ids = jax.lax.top_k(jax.lax.stop_gradient(scores), top_k)
        # the chosen scores as a one-hot contraction (its gradient is dense, not a scatter)
        top = jnp.einsum("te,tke->tk", scores, jax.nn.one_hot(ids, experts, dtype=scores.dtype))
        if moe.route_norm:
            top = top / (jnp.sum(top, axis=-1, keepdims=True) + 1e-20)
        top = top * moe.route_scale
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # (token, choice) pairs by expert
        back = jnp.argsort(order)  # where each pair's row lands
        sizes = jnp.sum(flat[:, None] == jnp.arange(experts, dtype=flat.dtype), axis=0)
        rows = pin(t[order // top_k], "rows")
        h = jax.nn.silu(_grouped(rows, w["moe.experts.w1"].transpose(0, 2, 1), sizes, mesh, row_axes))
        h = h * _grouped(rows, w["moe.experts.w3"].transpose(0, 2, 1), sizes, mesh, row_axes)
        out = _grouped(pin(h, "rows"), w["moe.experts.w2"].transpose(0, 2, 1), sizes, mesh, row_axes)
        per_choice = out[back].reshape(b * s, top_k, d).astype(jnp.float32)
        return jnp.einsum("tkd,tk->td", per_choice, top).astype(x.dtype).reshape(b, s, d)

    def layer(h, w):
        w = {k: cast(v) for k, v in w.items()}
        b, s, _ = h.shape
        x = rms_norm(h, w["attention_norm.weight"], args.norm_eps)
        q = (x @ w["attention.wq.weight"].T).reshape(b, s, args.n_heads, head_dim)
        k = (x @ w["attention.wk.weight"].T).reshape(b, s, n_kv, head_dim)
        v = pin((x @ w["attention.wv.weight"].T).reshape(b, s, n_kv, head_dim), "heads")
        q = pin(rms_norm(q, w["attention.q_norm.weight"], args.norm_eps), "heads")
        k = pin(rms_norm(k, w["attention.k_norm.weight"], args.norm_eps), "heads")
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = _attention(q, k, v, attention, mesh, batch_axes, tp).reshape(b, s, -1)
        h = pin(h + pin(attn, "hidden") @ w["attention.wo.weight"].T, "resid")
        x = rms_norm(h, w["ffn_norm.weight"], args.norm_eps)
        return pin(h + moe_ffn(x, w), "resid")

    if remat:
        layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)

    def loss_fn(p, tokens, labels):
        h = pin(cast(p["tok_embeddings.weight"])[tokens], "resid")
        for i in range(args.n_layers):
            h = layer(h, {k: p[f"layers.{i}.{k}"] for k in LAYER_KEYS})
        h = rms_norm(h, cast(p["norm.weight"]), args.norm_eps)
        logits = pin((h @ cast(p["output.weight"]).T).astype(jnp.float32), "logits")
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    return loss_fn
