"""One compiled training step of torchtitan's Llama 3, side by side in one run.

    .venv/bin/python bench/train_step.py                 # debugmodel and the ~100M config
    .venv/bin/python bench/train_step.py --configs debugmodel --steps 3

For each model config, on one XLA CPU device, it reports tokens/s of:
  (a) torchtpu: torchtitan's Transformer on the tpu device, the whole step (forward, backward,
      clipping, AdamW) compiled by torchtpu.compile into one XLA program;
  (b) pure JAX: the same model and math written directly in JAX (below), the way a MaxText
      user would write it, with the same initial weights, jitted with donated state;
  (c) PyTorch eager on the CPU;
  (d) torch.compile (inductor) on the CPU.
The ratio torchtpu / pure JAX is the cost of the PyTorch frontend (goal: >= 0.95).
"""
from __future__ import annotations

import argparse
import copy
import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torchtitan.models.llama3 import Transformer, TransformerModelArgs, llama3_args  # noqa: E402

import torchtpu  # noqa: E402
from common import lm_step, timed  # noqa: E402

CONFIGS = {
    "debugmodel": (llama3_args["debugmodel"], 4, 128),
    # ~98M parameters from the same model class
    "llama3_100m": (TransformerModelArgs(dim=768, n_layers=12, n_heads=12, vocab_size=8192, rope_theta=500000), 2, 128),
}
LR, BETAS, EPS, WD, MAX_NORM = 8e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


# ----------------------------------------------------------------------------- (b) pure JAX


def jax_params_from(model: Transformer):
    p = {k: jnp.asarray(v.detach().float().numpy()) for k, v in model.state_dict().items() if k != "freqs_cis"}
    return p


def rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype) * w


def rope_tables(head_dim, seq, theta):
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2)[: head_dim // 2] / head_dim))
    angles = np.outer(np.arange(seq), freqs)
    return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


def apply_rope(x, cos, sin):
    # pairs (2i, 2i+1) as real/imaginary parts, as torch.view_as_complex reads them
    b, s, h, d = x.shape
    xr = x.reshape(b, s, h, d // 2, 2)
    re, im = xr[..., 0], xr[..., 1]
    c, sn = cos[None, :s, None, :], sin[None, :s, None, :]
    return jnp.stack([re * c - im * sn, re * sn + im * c], axis=-1).reshape(b, s, h, d)


def make_jax_loss(args: TransformerModelArgs, seq: int, pin=None):
    """The Llama 3 loss in plain JAX. `pin(x, kind)` may annotate activations (bench/sharded_step.py
    pins "resid" (b, s, dim), "heads" (b, s, h, d), "hidden" (b, s, features) and "logits")."""
    head_dim = args.dim // args.n_heads
    n_kv = args.n_kv_heads or args.n_heads
    cos, sin = rope_tables(head_dim, seq, args.rope_theta)
    if pin is None:
        def pin(x, kind):
            return x

    def loss_fn(p, tokens, labels):
        h = pin(p["tok_embeddings.weight"][tokens], "resid")
        b, s, _ = h.shape
        mask = jnp.tril(jnp.ones((s, s), bool))
        for i in range(args.n_layers):
            pre = f"layers.{i}."
            x = rms_norm(h, p[pre + "attention_norm.weight"], args.norm_eps)
            q = pin((x @ p[pre + "attention.wq.weight"].T).reshape(b, s, args.n_heads, head_dim), "heads")
            k = pin((x @ p[pre + "attention.wk.weight"].T).reshape(b, s, n_kv, head_dim), "heads")
            v = pin((x @ p[pre + "attention.wv.weight"].T).reshape(b, s, n_kv, head_dim), "heads")
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            rep = args.n_heads // n_kv
            k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
            scores = jnp.where(mask, scores, -jnp.inf)
            attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, -1)
            h = pin(h + pin(attn, "hidden") @ p[pre + "attention.wo.weight"].T, "resid")
            x = rms_norm(h, p[pre + "ffn_norm.weight"], args.norm_eps)
            ff = jax.nn.silu(x @ p[pre + "feed_forward.w1.weight"].T) * (x @ p[pre + "feed_forward.w3.weight"].T)
            h = pin(h + pin(ff, "hidden") @ p[pre + "feed_forward.w2.weight"].T, "resid")
        h = rms_norm(h, p["norm.weight"], args.norm_eps)
        logits = pin((h @ p["output.weight"].T).astype(jnp.float32), "logits")
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    return loss_fn


def make_jax_step(loss_fn):
    def step(params, m, v, count, tokens, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        scale = jnp.minimum(1.0, MAX_NORM / (norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
        count = count + 1
        b1, b2 = BETAS
        m = jax.tree.map(lambda m_, g: b1 * m_ + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, v, grads)
        c1, c2 = 1 - b1 ** count, 1 - b2 ** count

        def update(p_, m_, v_):
            p_ = p_ * (1 - LR * WD)
            return p_ - LR * (m_ / c1) / (jnp.sqrt(v_ / c2) + EPS)

        params = jax.tree.map(update, params, m, v)
        return params, m, v, count, loss

    return jax.jit(step, donate_argnums=(0, 1, 2, 3))


# ----------------------------------------------------------------------------- torch steps


def torch_step_fn(model, opt):
    return lm_step(model, opt, MAX_NORM)


def bench_config(name, steps, include_inductor):
    args, batch, seq = CONFIGS[name]
    args = copy.deepcopy(args)
    args.max_seq_len = seq
    torch.manual_seed(0)
    base = Transformer(args)
    with torch.no_grad():
        base.init_weights()
    nparams = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    ntok = batch * seq
    results = {}

    # (a) torchtpu
    model = copy.deepcopy(base).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, capturable=True)
    step = torchtpu.compile(torch_step_fn(model, opt))
    xt, yt = x.to("tpu"), y.to("tpu")
    results["torchtpu (compiled step)"] = timed(lambda: step(xt, yt), lambda l: l.item(), warmup=3, steps=steps)
    del model, opt, step

    # (b) pure JAX
    params = jax_params_from(base)
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    state = {"p": params, "m": m, "v": v, "c": jnp.zeros((), jnp.float32)}
    jstep = make_jax_step(make_jax_loss(args, seq))
    xj, yj = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())

    def run_jax():
        state["p"], state["m"], state["v"], state["c"], loss = jstep(state["p"], state["m"], state["v"], state["c"], xj, yj)
        return loss

    results["pure JAX reference"] = timed(run_jax, lambda l: float(l), warmup=2, steps=steps)
    del state

    # (c) PyTorch eager on CPU
    cpu_model = copy.deepcopy(base)
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    cstep = torch_step_fn(cpu_model, cpu_opt)
    results["PyTorch eager (CPU)"] = timed(lambda: cstep(x, y), lambda l: l.item(), warmup=1, steps=steps)

    # (d) torch.compile / inductor on CPU
    if include_inductor:
        ind_model = copy.deepcopy(base)
        ind_opt = torch.optim.AdamW(ind_model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        istep = torch.compile(torch_step_fn(ind_model, ind_opt))
        results["torch.compile inductor (CPU)"] = timed(lambda: istep(x, y), lambda l: l.item(), warmup=2, steps=steps)

    print(f"\n{name}: {nparams / 1e6:.1f}M parameters, batch {batch} x seq {seq} = {ntok} tokens/step, 1 XLA CPU device")
    print(f"{'path':<32}{'s/step':>10}{'tokens/s':>12}")
    for k, t in results.items():
        print(f"{k:<32}{t:>10.3f}{ntok / t:>12.0f}")
    ratio = results["pure JAX reference"] / results["torchtpu (compiled step)"]
    print(f"torchtpu / pure JAX throughput: {ratio:.2f}x")
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-inductor", action="store_true")
    a = ap.parse_args()
    for name in a.configs:
        bench_config(name, a.steps, not a.no_inductor)


if __name__ == "__main__":
    main()
