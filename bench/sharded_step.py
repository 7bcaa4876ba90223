"""Sharded compiled training step: torchtpu's sharding layer vs pure JAX with the same shardings.

    python -m bench.sharded_step                      # CPU runs + TPU v5p:2x2x1 AOT
    python -m bench.sharded_step --steps 3 --no-aot   # CPU runs only
    python -m bench.sharded_step --no-cpu             # TPU ahead-of-time part only

The ~100M-parameter torchtitan Llama 3 ("llama3_100m" of bench/train_step.py: dim 768, 12 layers,
12 heads, vocab 8192), one compiled step (forward, backward, clipping, AdamW; float32), under

  FSDP      mesh ("dp_shard",)        every parameter split on dim 0 over dp_shard
  TP x FSDP mesh ("dp_shard", "tp")   Megatron layout: wq/wk/wv/w1/w3 and both embedding tables
                                      split on dim 0 (output features / vocabulary) over tp,
                                      wo/w2 on dim 1 (input features) over tp; FSDP on dim 0 on
                                      top; sequence parallelism off, loss_parallel off

(a) torchtpu: torchtitan's Transformer parallelized by torchtpu.models.llama3.parallelize_llama,
    the step compiled by torchtpu.compile;
(b) pure JAX: bench/jax_llama.py's model, as bench/train_step.py runs it, given the SAME parameter shardings as
    NamedShardings, the batch over dp_shard, activations pinned with with_sharding_constraint
    the way a MaxText user annotates them (batch over dp_shard; heads / ffn hidden over tp).

Part 1 runs both on 8 XLA CPU devices and reports tokens/s. Part 2 compiles both ahead of
time for the TPU topology v5p:2x2x1 (4 chips: FSDP4 and TP2 x FSDP2) and reports what the TPU
compiler says: XLA's estimated step time, a roofline estimate, flops and HBM per device and
the collectives, and lists any collective that differs between the two programs.
"""

from __future__ import annotations

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from torchtitan.models.llama3 import Transformer  # noqa: E402

import torchtpu  # noqa: E402
from bench.common import lm_step, timed  # noqa: E402
from bench.train_step import (  # noqa: E402
    BETAS,
    CONFIGS,
    EPS,
    LR,
    MAX_NORM,
    WD,
    jax_params_from,
    make_jax_loss,
    make_jax_step,
)
from torchtpu.distributed import distribute_tensor, empty, init_device_mesh, materialize  # noqa: E402
from torchtpu.distributed.params import partition_spec  # noqa: E402
from torchtpu.distributed.topology import aot_compile, compile_report, topology_devices  # noqa: E402
from torchtpu.hardware import CHIPS, TP_AXIS  # noqa: E402
from torchtpu.models.llama3 import parallelize_llama  # noqa: E402
from torchtpu.models.llama3.parallelize import batch_placements  # noqa: E402

DP, TP = "dp_shard", TP_AXIS
TOPOLOGY = "v5p:2x2x1"
# v5p per chip: bf16 peak and HBM bandwidth from torchtpu's chip table (torchtpu.hardware).
# A float32 matmul at Precision.HIGHEST runs as 6 bf16 MXU passes, at DEFAULT as 1.
V5P = CHIPS["v5p"]
HIGHEST_PASSES = 6


# ----------------------------------------------------------------------------- layouts


def layouts(kind: str):
    """(mesh shape for n devices, axis names, sequence_parallel) of a parallelism kind."""
    return {"fsdp": ((DP,), False), "tp_fsdp": ((DP, TP), False)}[kind]


def jax_param_specs(names_shapes, tp: bool) -> dict:
    """The issue's layouts, written independently of torchtpu: FSDP = dim 0 over dp_shard; TP =
    Megatron (colwise out-dim / rowwise in-dim / vocab over tp) with FSDP on dim 0 on top."""
    specs = {}
    for name, shape in names_shapes.items():
        if len(shape) == 1:
            specs[name] = P(DP)
        elif not tp:
            specs[name] = P(DP, None)
        elif re.search(r"(wq|wk|wv|w1|w3)\.weight$|tok_embeddings\.weight$|^output\.weight$", name):
            specs[name] = P((TP, DP), None)
        elif re.search(r"(wo|w2)\.weight$", name):
            specs[name] = P(DP, TP)
        else:
            raise ValueError(f"no TP layout for {name}")
    return specs


def make_sharded_loss(args, seq: int, mesh, tp: bool):
    """bench/train_step.py's pure-JAX Llama 3 with activation sharding annotations."""
    t = TP if tp else None
    specs = {
        "resid": (DP, None, None),
        "heads": (DP, None, t, None),
        "hidden": (DP, None, t),
        "logits": (DP, None, None),
    }

    def pin(x, kind):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*specs[kind])))

    return make_jax_loss(args, seq, pin)


def jax_sharded_step(args, seq, mesh, specs):
    """The pure-JAX step jitted with explicit shardings for state and batch."""
    inner = make_jax_step(make_sharded_loss(args, seq, mesh, TP in mesh.axis_names)).__wrapped__
    ps = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    rep = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P(DP, None))
    fn = jax.jit(
        inner,
        donate_argnums=(0, 1, 2, 3),
        in_shardings=(ps, ps, ps, rep, batch, batch),
        out_shardings=(ps, ps, ps, rep, rep),
    )
    return fn, ps, rep, batch


def torchtpu_specs(model) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        if k == "freqs_cis":
            continue
        out[k] = partition_spec(v)
    return out


def _norm_spec(s, ndim):
    e = list(s) + [None] * (ndim - len(s))
    return tuple(x[0] if isinstance(x, tuple) and len(x) == 1 else x for x in e)


def check_same_layouts(tt_specs, jx_specs, shapes):
    bad = [
        (k, tt_specs[k], jx_specs[k])
        for k in jx_specs
        if _norm_spec(tt_specs[k], len(shapes[k])) != _norm_spec(jx_specs[k], len(shapes[k]))
    ]
    if bad:
        for k, a, b in bad[:10]:
            print(f"  LAYOUT MISMATCH {k}: torchtpu {a} vs pure JAX {b}")
        raise SystemExit("torchtpu and pure JAX parameter layouts differ; the comparison would not be fair")
    print(f"  parameter layouts identical in both programs ({len(jx_specs)} tensors)")


# ----------------------------------------------------------------------------- part 1: CPU


def cpu_run(kind, base, args, batch, seq, steps):
    names, sp = layouts(kind)
    shape = (8,) if kind == "fsdp" else (4, 2)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    res = {}

    # (a) torchtpu
    mesh = init_device_mesh("tpu", shape, mesh_dim_names=names)
    model = copy.deepcopy(base).to("tpu")
    parallelize_llama(model, mesh, sequence_parallel=sp, loss_parallel=False)
    shapes = {k: tuple(v.shape) for k, v in base.state_dict().items() if k != "freqs_cis"}
    specs = jax_param_specs(shapes, TP in names)
    check_same_layouts(torchtpu_specs(model), specs, shapes)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, capturable=True, foreach=True
    )
    step = torchtpu.compile(lm_step(model, opt, MAX_NORM))
    xt, yt = (distribute_tensor(a, mesh, batch_placements(mesh)) for a in (x, y))
    losses = []
    t0 = time.perf_counter()
    losses.append(step(xt, yt).item())  # eager warm-up (state discovery)
    t1 = time.perf_counter()
    losses.append(step(xt, yt).item())  # trace + compile + run
    t2 = time.perf_counter()
    print(f"  torchtpu: eager first step {t1 - t0:.1f}s, trace+compile+run {t2 - t1:.1f}s", flush=True)
    res["torchtpu"] = timed(lambda: step(xt, yt), lambda l: losses.append(l.item()), warmup=1, steps=steps)
    res["torchtpu losses"] = losses
    model = opt = step = xt = yt = None  # free them (the timed closure above still names them)
    gc.collect()

    # (b) pure JAX, same layouts
    jmesh = mesh.jax_mesh
    fn, ps, rep, bsh = jax_sharded_step(args, seq, jmesh, specs)
    params = {k: jax.device_put(v, ps[k]) for k, v in jax_params_from(base).items()}
    st = {
        "p": params,
        "m": jax.tree.map(jnp.zeros_like, params),
        "v": jax.tree.map(jnp.zeros_like, params),
        "c": jax.device_put(jnp.zeros((), jnp.float32), rep),
    }
    xj, yj = (jax.device_put(jnp.asarray(a.numpy()), bsh) for a in (x, y))
    jl = []

    def run_jax():
        st["p"], st["m"], st["v"], st["c"], loss = fn(st["p"], st["m"], st["v"], st["c"], xj, yj)
        return loss

    t0 = time.perf_counter()
    jl.append(float(run_jax()))
    print(f"  pure JAX: compile+run {time.perf_counter() - t0:.1f}s", flush=True)
    res["pure JAX"] = timed(run_jax, lambda l: jl.append(float(l)), warmup=2, steps=steps)
    res["pure JAX losses"] = jl
    st.clear()  # free the arrays
    params = fn = None
    gc.collect()
    return res


# ----------------------------------------------------------------------------- part 2: TPU AOT

_COLL = re.compile(
    r"=\s*(\([^=]*?\)|\S+)\s+(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(-start)?\("
)
_ARS = re.compile(r"=\s*(\S+)\s+fusion\(.*calls=%?(all-reduce-scatter[\w.\-]*)")


def collective_list(hlo: str) -> collections.Counter:
    """Multiset of (collective, result shape) in optimized HLO (async pairs once; the TPU
    compiler's reduce-scatter fusions counted as reduce-scatter)."""
    out = collections.Counter()
    comp = None
    for line in hlo.splitlines():
        m = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$", line)
        if m:
            comp = m.group(1)
            continue
        if comp and comp.startswith("all-reduce-scatter"):
            continue
        m = _ARS.search(line)
        if m:
            out[("reduce-scatter", m.group(1).split("{")[0])] += 1
            continue
        m = _COLL.search(line)
        if m:
            out[(m.group(2), m.group(1).split("{")[0])] += 1
    return out


def precision_counts(hlo: str) -> dict:
    dots = [l for l in hlo.splitlines() if re.search(r"\s(dot|convolution)\(", l)]
    hi = sum("operand_precision={highest" in l for l in dots)
    return {"dots": len(dots), "highest": hi}


def roofline(rep, highest: bool):
    peak = V5P.peak_bf16_flops / (HIGHEST_PASSES if highest else 1)
    tf = rep["flops_per_device"] / peak
    tm = rep["bytes_accessed_per_device"] / V5P.hbm_bandwidth
    return max(tf, tm), tf, tm


def aot_torchtpu(kind, args, batch, seq):
    names, sp = layouts(kind)
    shape = (4,) if kind == "fsdp" else (2, 2)
    mesh = init_device_mesh("tpu", shape, mesh_dim_names=names, devices=topology_devices(TOPOLOGY))
    with torch.device("meta"):
        m = Transformer(args)
    parallelize_llama(m, mesh, sequence_parallel=sp, loss_parallel=False)
    materialize(m)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, capturable=True, foreach=True)
    cs = torchtpu.compile(lm_step(m, opt, MAX_NORM))
    inp = empty((batch, seq), torch.int64, mesh=mesh, placements=batch_placements(mesh))
    lab = empty((batch, seq), torch.int64, mesh=mesh, placements=batch_placements(mesh))
    t0 = time.perf_counter()
    compiled = cs.compile_for(inp, lab)
    dt = time.perf_counter() - t0
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items() if k != "freqs_cis"}
    return compiled, mesh.jax_mesh, dt, torchtpu_specs(m), shapes


def aot_jax(args, batch, seq, jmesh, specs, shapes, precision=None):
    fn, ps, rep, bsh = jax_sharded_step(args, seq, jmesh, specs)
    sds = {k: jax.ShapeDtypeStruct(shapes[k], jnp.float32, sharding=ps[k]) for k in specs}
    c = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
    tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=bsh)
    t0 = time.perf_counter()
    with jax.default_matmul_precision(precision or "default"):
        lowered = fn.lower(sds, sds, sds, c, tok, tok)
    compiled = aot_compile(lowered)
    return compiled, time.perf_counter() - t0


# ----------------------------------------------------------------------------- report


def fmt_s(s):
    return "n/a" if s is None else (f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama3_100m", choices=list(CONFIGS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kinds", nargs="*", default=["fsdp", "tp_fsdp"])
    ap.add_argument("--no-cpu", action="store_true")
    ap.add_argument("--no-aot", action="store_true")
    ap.add_argument(
        "--default-precision",
        action="store_true",
        help="also compile pure JAX at JAX's default matmul precision (1 bf16 pass on TPU)",
    )
    ap.add_argument("--dump", default=None, help="folder to write the optimized TPU HLO of each program into")
    a = ap.parse_args()

    args = copy.deepcopy(CONFIGS[a.config][0])
    args.max_seq_len = a.seq
    ntok = a.batch * a.seq
    label = {"fsdp": "FSDP", "tp_fsdp": "TP2 x FSDP"}
    tpu_label = {"fsdp": "FSDP4", "tp_fsdp": "TP2 x FSDP2"}  # 4 chips
    md = [
        f"Run {datetime.date.today().isoformat()}: `{a.config}`, global batch {a.batch} x seq {a.seq}, "
        f"float32, AdamW + clipping; sequence_parallel=False, loss_parallel=False.",
        "",
    ]

    if not a.no_cpu:
        torch.manual_seed(0)
        base = Transformer(args)
        with torch.no_grad():
            base.init_weights()
        nparams = sum(p.numel() for p in base.parameters())
        print(f"{a.config}: {nparams / 1e6:.1f}M parameters; {ntok} tokens/step; {len(jax.devices())} XLA CPU devices")
        rows = []
        for kind in a.kinds:
            print(f"[cpu] {kind}", flush=True)
            r = cpu_run(kind, base, args, a.batch, a.seq, a.steps)
            tt, jx = r["torchtpu"], r["pure JAX"]
            n = min(len(r["torchtpu losses"]), len(r["pure JAX losses"]))
            dl = max(abs(u - v) / abs(v) for u, v in zip(r["torchtpu losses"][:n], r["pure JAX losses"][:n]))
            print(f"  losses torchtpu {[round(v, 4) for v in r['torchtpu losses']]}")
            print(f"  losses pure JAX {[round(v, 4) for v in r['pure JAX losses']]}  (max rel diff {dl:.1e})")
            mesh_s = "(8,) dp_shard" if kind == "fsdp" else "(4, 2) dp_shard x tp"
            rows.append((f"{label[kind]}{'8' if kind == 'fsdp' else '4'}", mesh_s, tt, jx, dl))
        print(f"\n{'layout':<14}{'mesh':<22}{'torchtpu tok/s':>16}{'pure JAX tok/s':>16}{'ratio':>8}")
        md += [
            f"**8 XLA CPU devices** (one process, `--xla_force_host_platform_device_count=8`; "
            f"median of {a.steps} timed steps after warm-up; {nparams / 1e6:.1f}M parameters)",
            "",
            "| layout | mesh | torchtpu | pure JAX | torchtpu / pure JAX | loss max rel. diff |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, mesh_s, tt, jx, dl in rows:
            print(f"{name:<14}{mesh_s:<22}{ntok / tt:>16.1f}{ntok / jx:>16.1f}{jx / tt:>7.2f}x")
            md.append(
                f"| {name} | {mesh_s} | {ntok / tt:.1f} tok/s ({tt:.2f} s) | {ntok / jx:.1f} tok/s ({jx:.2f} s) "
                f"| **{jx / tt:.2f}x** | {dl:.1e} |"
            )
        md.append("")
        del base
        gc.collect()

    if not a.no_aot:
        rows = []
        diffs = []
        for kind in a.kinds:
            print(f"[aot {TOPOLOGY}] {kind}", flush=True)
            ctt, jmesh, dt_tt, tt_specs, shapes = aot_torchtpu(kind, args, a.batch, a.seq)
            specs = jax_param_specs(shapes, kind != "fsdp")
            check_same_layouts(tt_specs, specs, shapes)
            print(f"  torchtpu compile_for {dt_tt:.1f}s", flush=True)
            progs = [("torchtpu", ctt)]
            for prec in ("highest", "default") if a.default_precision else ("highest",):
                cj, dt = aot_jax(args, a.batch, a.seq, jmesh, specs, shapes, precision=prec)
                print(f"  pure JAX ({prec}) compile {dt:.1f}s", flush=True)
                progs.append((f"pure JAX ({prec})", cj))
            reps = {}
            for name, comp in progs:
                rep = compile_report(comp, jmesh)
                hlo = comp.as_text()
                pc = precision_counts(hlo)
                hi = pc["highest"] > pc["dots"] / 2
                rl = roofline(rep, hi)
                reps[name] = (rep, rl, pc, collective_list(hlo))
                if a.dump:
                    os.makedirs(a.dump, exist_ok=True)
                    fname = f"{kind}_{name.replace(' ', '_').replace('(', '').replace(')', '')}.hlo.txt"
                    with open(os.path.join(a.dump, fname), "w") as f:
                        f.write(hlo)
            base_c = reps["torchtpu"][3]
            for name in ("pure JAX (highest)",):
                other = reps[name][3]
                d = [(k, base_c[k], other[k]) for k in sorted(set(base_c) | set(other)) if base_c[k] != other[k]]
                diffs.append((kind, name, d))
            rows.append((kind, reps))

        mesh_tpu = {"fsdp": "(4,) dp_shard", "tp_fsdp": "(2, 2) dp_shard x tp"}
        head = (
            "| layout | program | XLA est. step | roofline est. (compute / HBM) | flops / device | "
            "bytes accessed / device | HBM needed / device (arguments / temporaries) | all-gather | reduce-scatter | all-reduce | "
            "all-to-all | coll.-permute | f32 dots at HIGHEST |"
        )
        md += [
            f"**TPU {TOPOLOGY} (4 chips), compiled ahead of time** on this host (libtpu's compiler, no TPU). "
            f"'XLA est. step' is `compile_report(...)['estimated_step_seconds']` (XLA's cost model; n/a when "
            f"it gives none). 'roofline est.' is computed here: max(flops / peak, bytes accessed / "
            f"{V5P.hbm_bandwidth / 1e12:.3f} TB/s), with peak {V5P.peak_bf16_flops / 1e12:.0f} TFLOP/s for programs whose float32 "
            f"dots run at DEFAULT precision (1 bf16 MXU pass) and {V5P.peak_bf16_flops / HIGHEST_PASSES / 1e12:.1f} TFLOP/s "
            f"(6 passes) for those at HIGHEST. torchtpu asks for HIGHEST on float32 matmuls (PyTorch's "
            f"float32 semantics), so 'pure JAX (highest)' (`jax.default_matmul_precision('highest')`) is the "
            f"same-math reference"
            + (
                "; 'pure JAX (default)' is what plain JAX does by default, for information."
                if a.default_precision
                else "."
            )
            + " The ratio is reference time / torchtpu time (>= 1: torchtpu as fast or faster).",
            "",
            head,
            "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |",
        ]
        print(f"\nTPU {TOPOLOGY} AOT")
        notes = []
        for kind, reps in rows:
            for name, (rep, rl, pc, _) in reps.items():
                c = rep["collectives"]
                est = rep["estimated_step_seconds"]
                line = (
                    f"| {tpu_label[kind]} {mesh_tpu[kind]} | {name} | {fmt_s(est)} | {fmt_s(rl[0])} "
                    f"({fmt_s(rl[1])} / {fmt_s(rl[2])}) | {rep['flops_per_device']:.4g} | "
                    f"{rep['bytes_accessed_per_device']:.4g} | {rep['hbm_bytes_needed'] / 2**20:.0f} MiB "
                    f"({rep['memory']['argument_bytes'] / 2**20:.0f} / {rep['memory']['temp_bytes'] / 2**20:.0f}) | "
                    f"{c['all-gather']} | {c['reduce-scatter']} | {c['all-reduce']} | {c['all-to-all']} | "
                    f"{c['collective-permute']} | {pc['highest']}/{pc['dots']} |"
                )
                md.append(line)
                print(line)
            tt = reps["torchtpu"]
            for ref in ("pure JAX (highest)", "pure JAX (default)"):
                if ref not in reps:
                    continue
                r = reps[ref]
                e1, e2 = tt[0]["estimated_step_seconds"], r[0]["estimated_step_seconds"]
                xs = f"XLA est. {e2 / e1:.2f}x" if e1 and e2 else "XLA est. n/a"
                s = (
                    f"{tpu_label[kind]}, torchtpu vs {ref} (reference time / torchtpu time): {xs}, "
                    f"roofline {r[1][0] / tt[1][0]:.2f}x"
                )
                print(s)
                notes.append(f"- {s}")
        md += [""] + notes + [""]
        md.append(
            "Collectives that differ between torchtpu and pure JAX (highest), as (op, result shape): "
            "count torchtpu vs pure JAX:"
        )
        md.append("")
        for kind, _name, d in diffs:
            if not d:
                md.append(f"- {tpu_label[kind]}: none (identical multisets of collectives)")
            for (op, shp), n1, n2 in d:
                md.append(f"- {tpu_label[kind]}: `{op}` `{shp}`: {n1} vs {n2}")
        md.append("")

    print("\n---- markdown ----")
    print("\n".join(md))


if __name__ == "__main__":
    main()
