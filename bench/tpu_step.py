"""torchtpu's trainer step vs a pure-JAX Llama 3 step, compiled ahead of time for a TPU slice.

    python -m bench.tpu_step --config train_configs/llama3_8b.toml --topology v5p:2x2x1 --scan --pallas
    python -m bench.tpu_step --config train_configs/llama3_8b.toml --topology v6e:2x2 --scan --pallas --no-full

(a) torchtpu: the step `torchtpu-train --dry-run` compiles (torchtitan's Llama 3 for the config's
    flavor, parallelized by the trainer, one micro-batch, full activation recomputation as the
    config says, bf16 compute with fp32 master weights and fp32 gradient reduction, AdamW with
    clipping).
(b) pure JAX (bench/jax_llama.py), written the way a MaxText user would: the same model and math, parameters as a
    dict of fp32 arrays with torchtpu's own shardings (read from the trainer's model, so both
    programs lay out every tensor alike), cast to bf16 inside each layer, each layer under
    `jax.checkpoint` (full recomputation) and, with --scan, all layers under one `lax.scan`
    over stacked parameters; attention by `jax.nn.dot_product_attention` (causal) or, with
    --pallas, the Pallas TPU flash-attention kernel inside `shard_map`; int32 token ids.

Both are costed the same way (torchtpu.costing.depth_extrapolated_cost: XLA's cost
model on shallow unrolled programs, extrapolated to the model's depth, which a scan cannot
fool: unrolled 2- and 4-layer programs of both, like for like; the dry run costs a scanned job with
copies that keep its scan, unrolled into straight-line code, which XLA costs somewhat higher
(docs/dry-run.md, "How the step is costed"); the reference's Pallas kernels declare
to XLA the costs torchtpu's declare for the same shapes, see with_torchtpu_kernel_costs; both
costing programs are compiled without collective-matmul loops, whose bodies XLA would cost once,
see topology.COSTING_COMPILER_OPTIONS); HBM per chip, collectives and compile time come from the
full-depth programs, compiled with the compiler's defaults. MFU uses
torchtitan's model FLOPs per token and the chip's bf16 peak.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from bench import jax_llama, jax_moe  # noqa: E402
from torchtpu.costing import (  # noqa: E402
    COSTING_DEPTHS,
    depth_extrapolated_cost,
    largest_temporaries,
    mfu_percent,
    temporaries_lines,
)
from torchtpu.distributed.topology import (  # noqa: E402
    aot_compile,
    compile_report,
    costing_compiles,
    dump_compiles_to,
    topology_devices,
)
from torchtpu.hardware import TP_AXIS  # noqa: E402

BETAS, EPS = (0.9, 0.95), 1e-8


# ----------------------------------------------------------------------------- (a) torchtpu


def torchtpu_program(cfg, n_layers=None):
    """(compile_report, seconds to compile, trainer) of the trainer's step."""
    from torchtpu.train.dry_run.estimate import compile_step
    from torchtpu.train.trainer import Trainer

    t = Trainer(cfg, n_layers=n_layers)
    t0 = time.perf_counter()
    compiled = compile_step(t.built_step())
    dt = time.perf_counter() - t0
    rep = compile_report(compiled, t.mesh.jax_mesh)
    return rep, dt, t


def param_specs(trainer) -> dict:
    """torchtpu's PartitionSpec of every parameter, by torchtitan name."""
    from torchtpu.distributed.params import partition_spec

    out = {}
    for name, v in trainer.model.named_parameters():
        out[name.replace("_checkpoint_wrapped_module.", "").replace(".module.", ".")] = (
            tuple(v.shape),
            partition_spec(v),
        )
    return out


# ----------------------------------------------------------------------------- (b) pure JAX


def make_reference_loss(args, seq, mesh, scan, pallas, remat):
    """bench/jax_llama.py's Llama 3 as a MaxText user runs it on this mesh: bf16 compute, activations
    pinned to the batch (data-parallel axes) and heads / hidden features (tp) shards."""
    axes = mesh.axis_names
    batch_axes = tuple(a for a in axes if a.startswith("dp") and mesh.shape[a] > 1) or None
    tp = TP_AXIS if TP_AXIS in axes and mesh.shape[TP_AXIS] > 1 else None
    acts = {
        "resid": P(batch_axes, None, None),
        "heads": P(batch_axes, None, tp, None),
        "hidden": P(batch_axes, None, tp),
        "logits": P(batch_axes, None, tp),
        "rows": P(batch_axes, None),
    }

    def pin(x, kind):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, acts[kind]))

    if getattr(args, "moe_enabled", False):
        if scan:
            raise ValueError(
                "the pure-JAX MoE reference runs its layers unrolled (as torchtpu's MoE blocks); drop --scan"
            )
        return jax_moe.make_loss(
            args,
            seq,
            pin=pin,
            compute_dtype=jnp.bfloat16,
            remat=remat,
            attention="pallas" if pallas else "xla",
            mesh=mesh,
            batch_axes=batch_axes,
            tp=tp,
        )
    return jax_llama.make_loss(
        args,
        seq,
        pin=pin,
        compute_dtype=jnp.bfloat16,
        remat=remat,
        scan=scan,
        attention="pallas" if pallas else "xla",
        mesh=mesh,
        batch_axes=batch_axes,
        tp=tp,
    )


def with_torchtpu_kernel_costs(fn):
    """`fn` with each Pallas flash-attention kernel in it (other kernels, such as megablox's, keep
    their own declared costs) declaring to XLA the cost torchtpu's kernels of the same structure
    declare for the same shapes (`attention_tpu.kernel_costs`: the blocks a causal kernel visits;
    the library's backward is a dK/dV and a dQ kernel, costed as torchtpu's two-kernel backward,
    not its one-pass one). The library's forward kernel declares the FLOPs of the whole, non-causal score matrix
    (twice the causal work) and its two backward kernels declare none, which XLA's cost model
    counts as free; left so, the two programs' attention would be costed differently (by about
    1e12 FLOPs per layer per chip at 8B, in torchtpu's disfavour)."""
    from jax.extend import core as jcore

    from torchtpu.backend.ops.attention_tpu import kernel_costs

    def closed(c):
        return jcore.ClosedJaxpr(recost(c.jaxpr), c.consts)

    def recost(jaxpr):
        eqns = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call" and len(eqn.invars[0].aval.shape) == 4:  # flash: q first
                q, k = eqn.invars[0].aval, eqn.invars[1].aval
                b, h, length, d = q.shape
                costs = kernel_costs(b, h, length, k.shape[2], d, causal=True, itemsize=q.dtype.itemsize, library=True)
                # forward: q, k, v in; dK/dV: two results; dQ: one result from q, k, v, l, m, do, di
                kind = "backward_dkv" if len(eqn.outvars) == 2 else "backward_dq" if len(eqn.invars) > 3 else "forward"
                eqn = eqn.replace(params={**eqn.params, "cost_estimate": costs[kind]})
            else:
                new = {}
                for key, v in eqn.params.items():
                    if isinstance(v, jcore.ClosedJaxpr):
                        new[key] = closed(v)
                    elif isinstance(v, jcore.Jaxpr):
                        new[key] = recost(v)
                    elif isinstance(v, tuple) and v and all(isinstance(x, jcore.ClosedJaxpr) for x in v):
                        new[key] = tuple(closed(x) for x in v)
                if new:
                    eqn = eqn.replace(params={**eqn.params, **new})
            eqns.append(eqn)
        return jaxpr.replace(eqns=eqns)

    def run(*args):
        traced, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = jax.core.eval_jaxpr(recost(traced.jaxpr), traced.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), out)

    return run


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
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s[0], jnp.float32, sharding=NamedSharding(mesh, s[1])),
            tree,
            is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[1], P),
        )

    params = sds(shapes)
    loss_fn = make_reference_loss(args, dims.seq_len, mesh, scan and n_layers > 0, pallas, remat)
    step = jax_llama.adamw_step(loss_fn, lr=lr, betas=BETAS, eps=EPS, weight_decay=wd, max_norm=max_norm)
    if pallas:
        step = with_torchtpu_kernel_costs(step)

    batch_axes = tuple(a for a in mesh.axis_names if a.startswith("dp") and mesh.shape[a] > 1) or None
    tok = jax.ShapeDtypeStruct(
        (dims.micro_batch_size, dims.seq_len), jnp.int32, sharding=NamedSharding(mesh, P(batch_axes, None))
    )
    count = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
    t0 = time.perf_counter()
    # a pure-JAX program needs no 64-bit types (torchtpu turns jax's x64 on for PyTorch's int64 and
    # float64), and Mosaic's (Pallas TPU) index maps must be 32-bit
    from torchtpu.backend.ops.grouped_mm_tpu import costable_kernels

    # megablox's tile bookkeeping counted with compares (XLA's TPU cost model cannot time its
    # scatter-adds of scalars), as torchtpu's kernels run it
    with jax.enable_x64(False), costable_kernels():
        lowered = jax.jit(step, donate_argnums=(0, 1, 2, 3)).lower(params, params, params, count, tok, tok)
        compiled = aot_compile(lowered)
    dt = time.perf_counter() - t0
    return compile_report(compiled, mesh), dt


# ----------------------------------------------------------------------------- report


def full_depth_and_flops(cfg, shallow_trainer):
    """(n_layers, torchtitan's training FLOPs per token) of the job's model at its own depth (the
    trainers that cost it were built with fewer layers)."""
    import torch

    from torchtpu.models.registry import get_family
    from torchtpu.train.model_builder import build_model_args

    family = get_family(cfg.model.name)
    args = build_model_args(cfg, shallow_trainer.tokenizer.vocab_size)
    with torch.device("meta"):
        model = family.build_model(args)
    return args.n_layers, family.flops_per_token(model, args, cfg.training.seq_len)[1]


def _log(msg):
    """A progress line with the machine's load (compile times depend on it)."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{msg} (load average {load} on {os.cpu_count()} CPUs)", flush=True)


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

    from torchtpu.train.config.manager import load_config
    from torchtpu.train.dry_run.estimate import recompute_text, unrolled, with_loop_warning
    from torchtpu.train.model_builder import ac_settings

    cfg = load_config(["--config", a.config, "--dry-run", "--tpu.topology", a.topology, *overrides])
    print(
        f"# bench/tpu_step.py {a.config} on {a.topology} ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)"
        f" reference: {'scanned' if a.scan else 'unrolled'} layers, {'Pallas flash' if a.pallas else 'XLA'} attention",
        flush=True,
    )
    rows = {}
    # depth-extrapolated cost: unrolled shallow programs of both
    small_tt, small_ref = [], []
    base = None
    for n in COSTING_DEPTHS:
        # compiled as the dry run compiles its costing programs: no collective-matmul loops, whose
        # bodies XLA would cost once (topology.COSTING_COMPILER_OPTIONS)
        with costing_compiles(topology_devices(a.topology)):
            rep, dt, t = torchtpu_program(unrolled(cfg), n_layers=n)
        _log(f"torchtpu, {n} layers unrolled: compiled in {dt:.0f} s")
        small_tt.append(rep)
        base = base or t
        specs = param_specs(t)
        ac_mode, _ = ac_settings(cfg)
        with costing_compiles(t.mesh.jax_mesh):
            rep, dt = reference_program(t, specs, n, False, a.pallas, ac_mode != "none")
        _log(f"pure JAX, {n} layers unrolled: compiled in {dt:.0f} s")
        small_ref.append(rep)
        del t
        gc.collect()
    # the costing trainers were built shallow: the job's own depth and model FLOPs come from its full args
    depth, flops_per_token = full_depth_and_flops(cfg, base)
    est = {
        "torchtpu": with_loop_warning(depth_extrapolated_cost(*small_tt, *COSTING_DEPTHS, depth), small_tt),
        "pure JAX": with_loop_warning(depth_extrapolated_cost(*small_ref, *COSTING_DEPTHS, depth), small_ref),
    }
    full, temps = {}, {}
    if not a.no_full:
        with tempfile.TemporaryDirectory(prefix="tpu-step-") as dump, dump_compiles_to(dump):
            rep, dt, trainer = torchtpu_program(cfg)
            temps["torchtpu"] = largest_temporaries(dump)
        full["torchtpu"] = (rep, dt)
        _log(f"torchtpu, {depth} layers: compiled in {dt:.0f} s")
        specs = param_specs(trainer)
        with tempfile.TemporaryDirectory(prefix="tpu-step-") as dump, dump_compiles_to(dump):
            full["pure JAX"] = reference_program(trainer, specs, depth, a.scan, a.pallas, ac_settings(cfg)[0] != "none")
            temps["pure JAX"] = largest_temporaries(dump)
        _log(f"pure JAX, {depth} layers: compiled in {full['pure JAX'][1]:.0f} s")
    dims = base.dims
    chips = dims.world_size
    peak = small_tt[0]["peak_bf16_flops_per_device"]
    tokens_micro = dims.micro_batch_size * dims.seq_len
    model_per_chip = flops_per_token * tokens_micro / chips
    for name in ("torchtpu", "pure JAX"):
        e = est[name]
        s = e["estimated_step_seconds"]
        row = {
            "est. step / micro-batch": f"{s * 1e3:.1f} ms" if s else "n/a",
            "tokens/s per chip": f"{tokens_micro / s / chips:,.0f}" if s else "n/a",
            "est. MFU": f"{mfu_percent(flops_per_token * tokens_micro, s, chips, peak):.1f}%" if s else "n/a",
            "XLA FLOPs / chip": f"{e['flops_per_device']:.4g} ({e['flops_per_device'] / model_per_chip:.2f}x model)",
        }
        small = (small_tt if name == "torchtpu" else small_ref)[-1]
        row[f"HBM / chip at {COSTING_DEPTHS[-1]} layers (unrolled)"] = (
            f"{_gib(small['hbm_bytes_needed'])} (temp {_gib(small['memory']['temp_bytes'])})"
        )
        if name in full:
            rep, dt = full[name]
            row["HBM / chip"] = f"{_gib(rep['hbm_bytes_needed'])} (temp {_gib(rep['memory']['temp_bytes'])})"
            row["fits"] = "yes" if rep["fits"] else "NO"
            row["collectives"] = ", ".join(f"{k} {v}" for k, v in rep["collectives"].items() if v)
            row["compile time"] = f"{dt:.0f} s"
            row["XLA raw est. (full program)"] = (
                f"{rep['estimated_step_seconds'] * 1e3:.1f} ms" if rep["estimated_step_seconds"] else "n/a"
            )
        rows[name] = row
    print(
        f"model FLOPs / chip / micro-batch {model_per_chip:.4g}; recomputation '{ac_settings(cfg)[0]}' expects "
        f"{recompute_text(*ac_settings(cfg))}; costing: {est['torchtpu']['method']}"
    )
    keys = list(rows["torchtpu"])
    print("| figure | torchtpu | pure JAX |\n| --- | --- | --- |")
    for k in keys:
        print(f"| {k} | {rows['torchtpu'].get(k, '-')} | {rows['pure JAX'].get(k, '-')} |")
    ts, js = est["torchtpu"]["estimated_step_seconds"], est["pure JAX"]["estimated_step_seconds"]
    if ts and js:
        print(f"torchtpu / pure JAX est. step time: {ts / js:.3f} (goal <= 1.05)")
    for name, groups in temps.items():  # where each full-depth program's memory goes
        print(f"largest temporaries, {name} (per chip, XLA's buffer assignment: size; buffers that reuse it)")
        print("\n".join(temporaries_lines(groups)))
    if full:
        print(
            f"torchtpu / pure JAX HBM per chip: "
            f"{full['torchtpu'][0]['hbm_bytes_needed'] / full['pure JAX'][0]['hbm_bytes_needed']:.3f} (goal <= 1.05)"
        )


if __name__ == "__main__":
    main()
