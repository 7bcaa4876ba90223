"""torchtpu's trainer step vs a pure-JAX Llama 3 step, compiled ahead of time for a TPU slice.

    .venv/bin/python bench/tpu_step.py --config train_configs/llama3_8b.toml --topology v5p:2x2x1
    .venv/bin/python bench/tpu_step.py --config train_configs/llama3_8b.toml --topology v6e:2x2 --scan --pallas

(a) torchtpu: the step `torchtpu-train --dry-run` compiles (torchtitan's Llama 3 for the config's
    flavor, parallelized by the trainer, one micro-batch, full activation recomputation as the
    config says, bf16 compute with fp32 master weights and fp32 gradient reduction, AdamW with
    clipping).
(b) pure JAX, written the way a MaxText user would: the same model and math, parameters as a
    dict of fp32 arrays with torchtpu's own shardings (read from the trainer's model, so both
    programs lay out every tensor alike), cast to bf16 inside each layer, each layer under
    `jax.checkpoint` (full recomputation) and, with --scan, all layers under one `lax.scan`
    over stacked parameters; attention by `jax.nn.dot_product_attention` (causal) or, with
    --pallas, the Pallas TPU flash-attention kernel inside `shard_map`; int32 token ids.

Both are costed the same way (torchtpu.distributed.topology.depth_extrapolated_cost: XLA's cost
model on shallow unrolled programs, extrapolated to the model's depth, which a scan cannot
fool: the dry run's method, from unrolled 2- and 4-layer programs); HBM per chip, collectives and compile time come from the full-depth programs. MFU uses
torchtitan's model FLOPs per token and the chip's bf16 peak.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from torchtpu.distributed.topology import aot_compile, compile_report, depth_extrapolated_cost  # noqa: E402

from train_step import apply_rope, rms_norm, rope_tables  # noqa: E402

BETAS, EPS = (0.9, 0.95), 1e-8


# ----------------------------------------------------------------------------- (a) torchtpu


def torchtpu_program(cfg, n_layers=None):
    """(compile_report, seconds to compile, trainer) of the trainer's step."""
    from torchtpu.train.dry_run import _compile_step
    from torchtpu.train.trainer import Trainer

    t = Trainer(cfg, n_layers=n_layers)
    t0 = time.perf_counter()
    compiled = _compile_step(t)
    dt = time.perf_counter() - t0
    rep = compile_report(compiled, t.mesh.jax_mesh)
    return rep, dt, t


def param_specs(trainer) -> dict:
    """torchtpu's PartitionSpec of every parameter, by torchtitan name."""
    from torchtpu.backend.tensor import storage_of
    from torchtpu.backend.views import array_of

    out = {}
    for name, v in trainer.model.named_parameters():
        st = storage_of(v)
        sh = st.dist.sharding if st.dist is not None else array_of(v).sharding
        out[name.replace("_checkpoint_wrapped_module.", "")] = (tuple(v.shape), P(*sh.spec))
    return out


# ----------------------------------------------------------------------------- (b) pure JAX

LAYER_KEYS = ("attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
              "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
              "feed_forward.w3.weight")


def _attention(q, k, v, mesh, batch_axes, tp, pallas):
    """Causal attention of (b, s, h, d) q and (b, s, kv, d) k/v."""
    if not pallas:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    spec = P(batch_axes, tp, None, None)
    fn = jax.shard_map(lambda a, b, c: flash_attention(a, b, c, causal=True, sm_scale=1 / math.sqrt(a.shape[-1])),
                       mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
    out = fn(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
    return out.transpose(0, 2, 1, 3)


def make_reference_loss(args, seq, mesh, n_layers, scan, pallas, remat):
    head_dim = args.dim // args.n_heads
    n_kv = args.n_kv_heads or args.n_heads
    cos, sin = rope_tables(head_dim, seq, args.rope_theta)
    axes = mesh.axis_names
    batch_axes = tuple(a for a in axes if a.startswith("dp") and mesh.shape[a] > 1) or None
    tp = "tp" if "tp" in axes and mesh.shape["tp"] > 1 else None
    acts = {"resid": P(batch_axes, None, None), "heads": P(batch_axes, None, tp, None),
            "hidden": P(batch_axes, None, tp), "logits": P(batch_axes, None, tp)}

    def pin(x, kind):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, acts[kind]))

    def layer(h, w):
        w = {k: v.astype(jnp.bfloat16) for k, v in w.items()}  # mixed precision: bf16 compute
        b, s, _ = h.shape
        x = rms_norm(h, w["attention_norm.weight"], args.norm_eps)
        q = pin((x @ w["attention.wq.weight"].T).reshape(b, s, args.n_heads, head_dim), "heads")
        k = pin((x @ w["attention.wk.weight"].T).reshape(b, s, n_kv, head_dim), "heads")
        v = pin((x @ w["attention.wv.weight"].T).reshape(b, s, n_kv, head_dim), "heads")
        q = apply_rope(q.astype(jnp.float32), cos, sin).astype(jnp.bfloat16)
        k = apply_rope(k.astype(jnp.float32), cos, sin).astype(jnp.bfloat16)
        attn = _attention(q, k, v, mesh, batch_axes, tp, pallas).reshape(b, s, -1)
        h = pin(h + pin(attn, "hidden") @ w["attention.wo.weight"].T, "resid")
        x = rms_norm(h, w["ffn_norm.weight"], args.norm_eps)
        ff = jax.nn.silu(x @ w["feed_forward.w1.weight"].T) * (x @ w["feed_forward.w3.weight"].T)
        return pin(h + pin(ff, "hidden") @ w["feed_forward.w2.weight"].T, "resid")

    if remat:
        layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)

    def loss_fn(p, tokens, labels):
        h = pin(p["tok_embeddings.weight"].astype(jnp.bfloat16)[tokens], "resid")
        if scan and n_layers:
            h, _ = jax.lax.scan(lambda c, w: (layer(c, w), None), h, p["layers"])
        else:
            for i in range(n_layers):
                h = layer(h, {k: p[f"layers.{i}.{k}"] for k in LAYER_KEYS})
        h = rms_norm(h, p["norm.weight"].astype(jnp.bfloat16), args.norm_eps)
        logits = pin(h @ p["output.weight"].astype(jnp.bfloat16).T, "logits").astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    return loss_fn


def reference_program(trainer, specs, n_layers, scan, pallas, remat, lr=3e-4, wd=0.1, max_norm=1.0):
    """(compile_report, seconds to compile) of the pure-JAX step at `n_layers`."""
    args, mesh = trainer.model_args, trainer.mesh.jax_mesh
    dims = trainer.dims
    shapes = {}
    for name, (shape, spec) in specs.items():
        if name.startswith("layers."):
            i, key = name.split(".", 2)[1:]
            if int(i) >= n_layers:
                continue
            if scan:
                if i == "0":
                    shapes.setdefault("layers", {})[key] = ((n_layers, *shape), P(None, *spec))
                continue
        shapes[name] = (shape, spec)

    def sds(tree):
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s[0], jnp.float32, sharding=NamedSharding(mesh, s[1])),
                            tree, is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[1], P))

    params = sds(shapes)
    loss_fn = make_reference_loss(args, dims.seq_len, mesh, n_layers, scan, pallas, remat)

    def step(params, m, v, count, tokens, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
        count = count + 1
        b1, b2 = BETAS
        m = jax.tree.map(lambda m_, g: b1 * m_ + (1 - b1) * g * scale, m, grads)
        v = jax.tree.map(lambda v_, g: b2 * v_ + (1 - b2) * (g * scale) ** 2, v, grads)
        c1, c2 = 1 - b1 ** count, 1 - b2 ** count
        params = jax.tree.map(lambda p_, m_, v_: p_ * (1 - lr * wd) - lr * (m_ / c1) / (jnp.sqrt(v_ / c2) + EPS),
                              params, m, v)
        return params, m, v, count, loss, norm

    batch_axes = tuple(a for a in mesh.axis_names if a.startswith("dp") and mesh.shape[a] > 1) or None
    tok = jax.ShapeDtypeStruct((dims.local_batch_size * dims.dp, dims.seq_len), jnp.int32,
                               sharding=NamedSharding(mesh, P(batch_axes, None)))
    count = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
    t0 = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(0, 1, 2, 3)).lower(params, params, params, count, tok, tok)
    compiled = aot_compile(lowered)
    dt = time.perf_counter() - t0
    return compile_report(compiled, mesh), dt


# ----------------------------------------------------------------------------- report


def _gib(n):
    return f"{n / 1024**3:.2f} GiB"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--topology", required=True)
    ap.add_argument("--scan", action="store_true", help="pure JAX: layers under one lax.scan")
    ap.add_argument("--pallas", action="store_true", help="pure JAX: Pallas TPU flash attention")
    ap.add_argument("--no-full", action="store_true", help="skip the full-depth compiles (no HBM/collectives)")
    a, overrides = ap.parse_known_args(argv)  # the rest: torchtpu-train options, e.g. --training.seq_len 4096

    from torchtpu.train.config import load_config
    from torchtpu.train.dry_run import COSTING_DEPTHS, recompute_factor, unrolled
    from torchtpu.train.trainer import _ac_settings

    cfg = load_config(["--config", a.config, "--dry-run", "--tpu.topology", a.topology, *overrides])
    print(f"# bench/tpu_step.py {a.config} on {a.topology} ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)"
          f" reference: {'scanned' if a.scan else 'unrolled'} layers, {'Pallas flash' if a.pallas else 'XLA'} attention",
          flush=True)
    rows = {}
    # depth-extrapolated cost: unrolled shallow programs of both
    small_tt, small_ref = [], []
    base = None
    for n in COSTING_DEPTHS:
        rep, _, t = torchtpu_program(unrolled(cfg), n_layers=n)
        small_tt.append(rep)
        base = base or t
        specs = param_specs(t)
        ac_mode, _ = _ac_settings(cfg)
        small_ref.append(reference_program(t, specs, n, False, a.pallas, ac_mode != "none")[0])
        del t
        gc.collect()
    depth = base.model_args.n_layers
    est = {"torchtpu": depth_extrapolated_cost(*small_tt, *COSTING_DEPTHS, depth),
           "pure JAX": depth_extrapolated_cost(*small_ref, *COSTING_DEPTHS, depth)}
    full = {}
    if not a.no_full:
        rep, dt, trainer = torchtpu_program(cfg)
        full["torchtpu"] = (rep, dt)
        specs = param_specs(trainer)
        full["pure JAX"] = reference_program(trainer, specs, depth, a.scan, a.pallas, _ac_settings(cfg)[0] != "none")
    dims = base.dims
    chips = dims.world_size
    peak = small_tt[0]["peak_bf16_flops_per_device"]
    tokens_micro = dims.local_batch_size * dims.dp * dims.seq_len
    model_per_chip = base.flops_per_token * tokens_micro / chips
    for name in ("torchtpu", "pure JAX"):
        e = est[name]
        s = e["estimated_step_seconds"]
        row = {"est. step / micro-batch": f"{s * 1e3:.1f} ms" if s else "n/a",
               "tokens/s per chip": f"{tokens_micro / s / chips:,.0f}" if s else "n/a",
               "est. MFU": f"{100 * model_per_chip / (s * peak):.1f}%" if s else "n/a",
               "XLA FLOPs / chip": f"{e['flops_per_device']:.4g} ({e['flops_per_device'] / model_per_chip:.2f}x model)"}
        if name in full:
            rep, dt = full[name]
            row["HBM / chip"] = f"{_gib(rep['hbm_bytes_needed'])} (temp {_gib(rep['memory']['temp_bytes'])})"
            row["fits"] = "yes" if rep["fits"] else "NO"
            row["collectives"] = ", ".join(f"{k} {v}" for k, v in rep["collectives"].items() if v)
            row["compile time"] = f"{dt:.0f} s"
            row["XLA raw est. (full program)"] = (f"{rep['estimated_step_seconds'] * 1e3:.1f} ms"
                                                  if rep["estimated_step_seconds"] else "n/a")
        rows[name] = row
    print(f"model FLOPs / chip / micro-batch {model_per_chip:.4g}; recomputation '{_ac_settings(cfg)[0]}' expects "
          f"{recompute_factor(_ac_settings(cfg)[0]):.2f}x; costing: {est['torchtpu']['method']}")
    keys = list(rows["torchtpu"])
    print("| figure | torchtpu | pure JAX |\n| --- | --- | --- |")
    for k in keys:
        print(f"| {k} | {rows['torchtpu'].get(k, '-')} | {rows['pure JAX'].get(k, '-')} |")
    ts, js = est["torchtpu"]["estimated_step_seconds"], est["pure JAX"]["estimated_step_seconds"]
    if ts and js:
        print(f"torchtpu / pure JAX est. step time: {ts / js:.3f} (goal <= 1.05)")
    if full:
        print(f"torchtpu / pure JAX HBM per chip: "
              f"{full['torchtpu'][0]['hbm_bytes_needed'] / full['pure JAX'][0]['hbm_bytes_needed']:.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
