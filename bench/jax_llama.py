"""The pure-JAX Llama 3 every benchmark compares torchtpu against: one module, so all of them
measure against the same reference.

Written the way a strong JAX user would (MaxText-style), independently of torchtpu: parameters
are a dict keyed by torchtitan's state_dict names (one entry per layer, or, with `scan=True`,
the blocks' weights stacked under "layers" and run by one `lax.scan`); options:

- `compute_dtype`: cast the weights to it inside each layer (mixed precision; None = as stored);
- `remat`: every layer under `jax.checkpoint` (full activation recomputation);
- `attention`: "dense" (masked softmax written out), "xla" (`jax.nn.dot_product_attention`) or
  "pallas" (JAX's Pallas TPU flash-attention kernel inside `shard_map`; needs `mesh`);
- `pin(x, kind)`: sharding annotations of activations ("resid" (b, s, dim), "heads"
  (b, s, h, d), "hidden" (b, s, features), "logits").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

__all__ = ["LAYER_KEYS", "rms_norm", "rope_tables", "apply_rope", "make_loss", "adamw_step"]

LAYER_KEYS = (
    "attention_norm.weight",
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "attention.wo.weight",
    "ffn_norm.weight",
    "feed_forward.w1.weight",
    "feed_forward.w2.weight",
    "feed_forward.w3.weight",
)


def rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype) * w


def rope_tables(head_dim, seq, theta):
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2)[: head_dim // 2] / head_dim))
    angles = np.outer(np.arange(seq), freqs)
    return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


def apply_rope(x, cos, sin):
    """Rotary embedding in float32, returned in x's dtype. Pairs (2i, 2i+1) are the real and
    imaginary parts, as torch.view_as_complex reads them (torchtitan's layout)."""
    b, s, h, d = x.shape
    xr = x.astype(jnp.float32).reshape(b, s, h, d // 2, 2)
    re, im = xr[..., 0], xr[..., 1]
    c, sn = cos[None, :s, None, :], sin[None, :s, None, :]
    return jnp.stack([re * c - im * sn, re * sn + im * c], axis=-1).reshape(b, s, h, d).astype(x.dtype)


def _attention(q, k, v, kind, mesh, batch_axes, tp):
    """Causal attention of (b, s, h, d) q and (b, s, kv, d) k/v -> (b, s, h, d)."""
    head_dim = q.shape[-1]
    if kind == "xla":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    if kind == "dense":
        s = q.shape[1]
        mask = jnp.tril(jnp.ones((s, s), bool))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        scores = jnp.where(mask, scores, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    if kind != "pallas":
        raise ValueError(f"attention must be 'dense', 'xla' or 'pallas', got {kind!r}")
    if mesh is None:
        raise ValueError("attention='pallas' needs the mesh (the kernel runs per shard under shard_map)")
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

    spec = P(batch_axes, tp, None, None)
    fn = jax.shard_map(
        lambda a, b, c: flash_attention(a, b, c, causal=True, sm_scale=1 / math.sqrt(head_dim)),
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
        check_vma=False,
    )
    out = fn(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
    return out.transpose(0, 2, 1, 3)


def make_loss(
    args,
    seq: int,
    *,
    pin=None,
    compute_dtype=None,
    remat: bool = False,
    scan: bool = False,
    attention: str = "dense",
    mesh=None,
    batch_axes=None,
    tp=None,
):
    """loss_fn(params, tokens, labels): mean token cross entropy (float32 logits) of Llama 3 with
    torchtitan's `args` (dim, n_layers, n_heads, n_kv_heads, norm_eps, rope_theta).
    `batch_axes` / `tp`: the mesh axes the batch and the heads are split over (Pallas only)."""
    head_dim = args.dim // args.n_heads
    n_kv = args.n_kv_heads or args.n_heads
    cos, sin = rope_tables(head_dim, seq, args.rope_theta)
    if pin is None:

        def pin(x, kind):
            return x

    def cast(x):
        return x if compute_dtype is None else x.astype(compute_dtype)

    def layer(h, w):
        w = {k: cast(v) for k, v in w.items()}
        b, s, _ = h.shape
        x = rms_norm(h, w["attention_norm.weight"], args.norm_eps)
        q = pin((x @ w["attention.wq.weight"].T).reshape(b, s, args.n_heads, head_dim), "heads")
        k = pin((x @ w["attention.wk.weight"].T).reshape(b, s, n_kv, head_dim), "heads")
        v = pin((x @ w["attention.wv.weight"].T).reshape(b, s, n_kv, head_dim), "heads")
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = _attention(q, k, v, attention, mesh, batch_axes, tp).reshape(b, s, -1)
        h = pin(h + pin(attn, "hidden") @ w["attention.wo.weight"].T, "resid")
        x = rms_norm(h, w["ffn_norm.weight"], args.norm_eps)
        ff = jax.nn.silu(x @ w["feed_forward.w1.weight"].T) * (x @ w["feed_forward.w3.weight"].T)
        return pin(h + pin(ff, "hidden") @ w["feed_forward.w2.weight"].T, "resid")

    if remat:
        layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)

    def loss_fn(p, tokens, labels):
        h = pin(cast(p["tok_embeddings.weight"])[tokens], "resid")
        if scan:
            h, _ = jax.lax.scan(lambda c, w: (layer(c, w), None), h, p["layers"])
        else:
            for i in range(args.n_layers):
                h = layer(h, {k: p[f"layers.{i}.{k}"] for k in LAYER_KEYS})
        h = rms_norm(h, cast(p["norm.weight"]), args.norm_eps)
        logits = pin((h @ cast(p["output.weight"]).T).astype(jnp.float32), "logits")
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    return loss_fn


def adamw_step(loss_fn, *, lr, betas, eps, weight_decay, max_norm):
    """step(params, m, v, count, tokens, labels) -> (params, m, v, count, loss): one AdamW step
    with global-norm clipping, as torch.optim.AdamW + clip_grad_norm_ compute it (not jitted)."""

    def step(params, m, v, count, tokens, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
        count = count + 1
        b1, b2 = betas
        m = jax.tree.map(lambda m_, g: b1 * m_ + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, v, grads)
        c1, c2 = 1 - b1**count, 1 - b2**count

        def update(p_, m_, v_):
            p_ = p_ * (1 - lr * weight_decay)
            return p_ - lr * (m_ / c1) / (jnp.sqrt(v_ / c2) + eps)

        params = jax.tree.map(update, params, m, v)
        return params, m, v, count, loss

    return step
