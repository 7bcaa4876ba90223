"""`torchtpu-train --dry-run`: size a TPU slice without a TPU.

    status = dry_run(job)    # job: a BuiltStep of a Trainer built with [tpu] dry_run = true; 0 fits, 1 does not

It compiles the real training step ahead of time for the job's devices (a TPU topology's
compile-only devices when `[tpu] topology` names one) and prints:

- memory per device: arguments, outputs, XLA's temporaries and the largest of them by shape and
  source operation (from XLA's buffer assignment), against the chip's HBM;
- an estimated step time, the tokens/s per chip and the MFU it implies, and how it was costed.
  XLA's cost analysis of a program counts a while-loop body once (a model whose layers run
  under `lax.scan` looks n_layers times cheaper) and a kernel without a declared cost as
  nothing. So the step is also compiled unrolled with 2 and with 4 layers, where no loop over
  layers is left to miscount, and XLA's figures for those two are extrapolated linearly to the
  model's depth (`costing.depth_extrapolated_cost`; docs/DESIGN_NOTES.md says why 2 and 4). A
  model whose first blocks are dense and the rest Mixture-of-Experts (DeepSeek-V3) keeps all its
  dense blocks in both copies, and 2 and 4 of the others (`costing_depths`), so the slope is one
  MoE block's. The costing copies are compiled past XLA's out-of-memory check once the full
  program has compiled with it (an unrolled copy may need more HBM than the scanned step;
  topology.PAST_OOM_COMPILER_OPTIONS), and the method line names a copy that does not fit. When
  XLA gives no time estimate at all, a compute-bound bound is printed instead, and it is never
  called an MFU;
- XLA's FLOPs next to the model's own (torchtitan's 6N + attention per token) and the factor
  activation recomputation should add, so work the program does beyond that shows.

It says what it is doing while it works: the mesh first, then a line when each phase starts
(lowering, compiling the full program, building and compiling each costing copy) and ends, with
its elapsed time, and while a phase lasts a line every HEARTBEAT_SECONDS. When the full program
loops over the layers, its own XLA FLOPs and time rows are left out of the first table (XLA costs
a loop body once): the one estimate printed is the costing programs'.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtpu.costing import COSTING_DEPTHS, mfu_percent

__all__ = [
    "BuiltStep",
    "compile_step",
    "costing_depths",
    "dry_run",
    "estimate_lines",
    "leading_dense_layers",
    "out_of_memory_line",
    "recompute_factor",
    "recompute_text",
    "step_estimate",
    "unrolled",
    "with_fit_note",
]


HEARTBEAT_SECONDS = 20.0


@dataclass(frozen=True)
class BuiltStep:
    """What the dry run compiles and reports on: a job's configuration, devices, parallel degrees, mesh,
    model (arguments, built model, MoE layers, FLOPs per token) and its step (a torchtpu.compile
    function). `at_depth(cfg, n)` builds the same job for `cfg` with n blocks (the costing copies)."""

    cfg: Any
    devices: Any
    dims: Any
    mesh: Any
    model_args: Any
    model: Any
    moe_layers: list
    flops_per_token: float
    step_fn: Any
    at_depth: Callable[[Any, int], BuiltStep]


@contextlib.contextmanager
def phase(what: str):
    """Print `dry run: WHAT ...` now, `... still working, N s` every HEARTBEAT_SECONDS, and
    `dry run: WHAT: done in N s` at the end (a compile of a large model takes minutes)."""
    t0 = time.perf_counter()
    print(f"dry run: {what} ...", flush=True)
    done = threading.Event()

    def beat():
        while not done.wait(HEARTBEAT_SECONDS):
            print(f"dry run: {what}: still working, {time.perf_counter() - t0:.0f} s", flush=True)

    thread = threading.Thread(target=beat, name="torchtpu-dry-run-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    print(f"dry run: {what}: done in {time.perf_counter() - t0:.1f} s", flush=True)


def mesh_line(job) -> str:
    """`mesh dp_replicate 1 x dp_shard 8 x tp 1 = 8 devices (v5p:2x2x1)`: the layout the step is compiled for."""
    dims = job.dims
    layout = " x ".join(f"{name} {n}" for name, n in zip(dims.mesh_axis_names, dims.mesh_shape))
    where = job.cfg.tpu.topology or job.devices[0].device_kind
    return (
        f"dry run: mesh {layout} = {dims.world_size} devices ({where}); global batch {dims.global_batch_size} x "
        f"{dims.seq_len} tokens in {dims.grad_accum_steps} micro-batch(es)"
    )


def recompute_factor(ac_mode: str, every: int = 1) -> tuple[float, float]:
    """(low, high) FLOPs of a step with activation recomputation over one without, for a decoder
    whose FLOPs are in its layers' matmuls and attention. Recomputing a layer runs its forward
    (1/3 of forward + backward) twice: full recomputation 4/3; "selective" every n-th block
    1 + 1/(3n); "op" recomputes every block but for the matmuls and attention the policy keeps
    (every other matmul; which ones, and so the FLOPs, depend on the block), so between 1 and 4/3;
    none 1."""
    if ac_mode == "full":
        return 4 / 3, 4 / 3
    if ac_mode == "selective":
        return 1 + 1 / (3 * every), 1 + 1 / (3 * every)
    if ac_mode == "op":
        return 1.0, 4 / 3
    return 1.0, 1.0


def recompute_text(ac_mode: str, every: int = 1) -> str:
    """recompute_factor as a reader sees it: "1.33x", or "1.00x to 1.33x"."""
    low, high = recompute_factor(ac_mode, every)
    return f"{low:.2f}x" if low == high else f"{low:.2f}x to {high:.2f}x"


def _micro_batch(job):
    """One micro-batch of int32 token ids laid out as the job's batches are."""
    import torch

    import torchtpu.distributed as td
    from torchtpu.distributed.batch import batch_placements

    dims = job.dims
    shape = (dims.micro_batch_size, dims.seq_len)
    placements = batch_placements(job.mesh)
    # One micro-batch: with accumulation the step repeats the same forward/backward over the
    # same buffers, so memory is one micro-batch's; time and FLOPs are scaled to the step.
    return [
        (
            td.empty(shape, torch.int32, mesh=job.mesh, placements=placements),
            td.empty(shape, torch.int32, mesh=job.mesh, placements=placements),
        )
    ]


def compile_step(job):
    """The step of `job` compiled for one micro-batch of int32 token ids (jax.stages.Compiled)."""
    return job.step_fn.compile_for(_micro_batch(job))


def _step_report(job, dump: str | None = None, label: str = "the full program"):
    """(compile_report, largest temporaries (with `dump`, a folder for XLA's dump) or None, compile
    seconds, None) of the job's step for one micro-batch; the last item is the date of the first
    compile instead when the same program's report comes from the dry run's cache."""
    from torchtpu.backend.aot import aot_compile
    from torchtpu.costing import largest_temporaries
    from torchtpu.distributed.topology import compile_report, dump_compiles_to

    from . import cache as dry_run_cache

    with phase(f"lowering {label}"):
        lowered = job.step_fn.lower_for(_micro_batch(job))
    mesh = job.mesh.jax_mesh
    key = dry_run_cache.program_key(lowered, mesh)
    hit = dry_run_cache.load(key)
    if hit is not None and (dump is None or hit["temporaries"] is not None):
        print(f"dry run: compiling {label}: its report is in the dry-run cache (compiled {hit['created']})", flush=True)
        return hit["report"], hit["temporaries"], hit["compile_seconds"], hit["created"]
    t0 = time.perf_counter()
    with phase(f"compiling {label}"), dump_compiles_to(dump) if dump else contextlib.nullcontext():
        compiled = aot_compile(lowered)
    seconds = time.perf_counter() - t0
    report = compile_report(compiled, mesh)
    temps = largest_temporaries(dump) if dump else None
    del compiled
    # as the cache keeps them (JSON), so a cached run prints exactly what this one does
    report, temps = dry_run_cache.save(key, report, temps, seconds)
    return report, temps, seconds, None


def unrolled(cfg):
    """`cfg` with the layer scan ([tpu] scan_layers) off: the costing programs must not loop over layers."""
    import dataclasses

    if not cfg.tpu.scan_layers:
        return cfg
    out = dataclasses.replace(cfg, tpu=dataclasses.replace(cfg.tpu, scan_layers=False))
    out._origins = dict(getattr(cfg, "_origins", {}))
    return out


def leading_dense_layers(model_args) -> int:
    """How many dense blocks come first in a model whose other blocks are Mixture-of-Experts ones
    (DeepSeek-V3's `n_dense_layers`); 0 when its blocks repeat one pattern from the first."""
    lead = int(getattr(model_args, "n_dense_layers", 0) or 0)
    return lead if 0 < lead < model_args.n_layers else 0


def costing_depths(model_args) -> tuple[int, int]:
    """The depths of the two costing copies: COSTING_DEPTHS layers of the repeating blocks, after
    all of a model's leading dense blocks (DeepSeek-V3 671B: 3 dense + 2 and 3 dense + 4 MoE
    blocks), so that the slope between them is one repeating block's cost and the leading blocks
    are costed as they are, not as repeating ones."""
    lead = leading_dense_layers(model_args)
    return (lead + COSTING_DEPTHS[0], lead + COSTING_DEPTHS[1])


def step_estimate(job, report: dict, unscanned_copies: bool = False) -> dict:
    """Per-micro-batch cost of the job's step at its full depth, with the method used.

    Compiles the same job at `costing_depths` layers as programs whose cost XLA counts fully, and
    extrapolates; a model at most that deep is costed as it is when it has no loops. If that
    fails, the full program's own XLA figures are used, flagged when it has loops.

    A job that runs its blocks under the layer scan is costed with copies that keep the scan, its
    loops unrolled into straight-line code (`scan.straight_line_loops`): the scan's own program
    (stacked weights, the forward's kept outputs written into their stacks, the backward's
    recomputation as it runs). Copies of the unscanned model instead let XLA share the forward's
    values with the recomputation and cost less than the scanned step does (docs/dry-run.md).
    `unscanned_copies` costs the unscanned model anyway (bench.step_estimate --unscanned-copies,
    to compare); a job without the scan is always costed unscanned."""
    import contextlib

    from torchtpu.costing import depth_extrapolated_cost
    from torchtpu.distributed.scan import straight_line_loops
    from torchtpu.distributed.topology import costing_compiles

    depth = job.model_args.n_layers
    depths = costing_depths(job.model_args)
    loops = report.get("while_loops") or []
    if depth <= depths[1] and not loops:
        return {
            "method": "XLA cost model on the whole program (no loops)",
            **{
                k: report[k]
                for k in ("flops_per_device", "bytes_accessed_per_device", "estimated_step_seconds", "roofline_seconds")
            },
        }
    try:
        small, cached = [], []
        scanned = _runs_layer_scan(job)
        scanned_copies = scanned and not unscanned_copies
        cfg = job.cfg if scanned_copies else unrolled(job.cfg)
        straight = straight_line_loops if scanned_copies else contextlib.nullcontext
        for n in depths:
            with phase(f"building the {n}-layer costing copy"), straight():
                t = job.at_depth(cfg, n)
            # past XLA's out-of-memory errors only once the full program, whose kernels are the copies', has
            # compiled with the checks (a report of it here); bench.step_estimate, without one, keeps them
            with costing_compiles(t.mesh.jax_mesh, past_oom="flops_per_device" in report), straight():
                rep, _, _, when = _step_report(t, label=f"the {n}-layer costing copy")
            small.append(rep)
            if when:
                cached.append(f"{n}-layer from {when}")
            del t
        est = depth_extrapolated_cost(small[0], small[1], *depths, depth)
        if scanned_copies:
            est["method"] += " (the copies keep the layer scan, unrolled into straight-line code)"
        elif scanned:
            est["method"] += " (copies of the unscanned model: the step runs the layer scan)"
        lead = leading_dense_layers(job.model_args)
        if lead:
            est["method"] += f" (each copy holds all {lead} leading dense layer(s); the slope is the MoE blocks')"
        est = with_fit_note(with_loop_warning(est, small, depths), small, depths)
        if cached:
            est["method"] += f" (costing programs' figures from the dry-run cache: {', '.join(cached)})"
        return est
    except Exception as e:  # noqa: BLE001  (a model that cannot be built shallower: say so, use the whole program)
        if "flops_per_device" not in report:  # no whole-program figures to fall back on (bench.step_estimate)
            raise
        method = "XLA cost model on the whole program"
        if loops:
            method += (
                f" (it has {len(loops)} while loop(s), whose bodies XLA costs once: no time estimate; FLOPs too low)"
            )
        return {
            "method": f"{method}; depth extrapolation failed: {type(e).__name__}: {e}",
            "flops_per_device": report["flops_per_device"],
            "bytes_accessed_per_device": report["bytes_accessed_per_device"],
            "estimated_step_seconds": report["estimated_step_seconds"] if not loops else None,
            "roofline_seconds": report.get("roofline_seconds"),
        }


def _runs_layer_scan(job) -> bool:
    """Whether the job's model runs blocks under the layer scan: `[tpu] scan_layers` on, and a
    family that did not turn it off for blocks that differ (Llama 4's interleaved flavors)."""
    from torchtpu.distributed.scan import is_scanned

    return bool(job.cfg.tpu.scan_layers) and any(is_scanned(m) for m in job.model.modules())


def with_loop_warning(est: dict, costing_reports, depths=COSTING_DEPTHS) -> dict:
    """`est` with its method saying so when a costing program still holds while loops (XLA costs a
    loop's body once, so the estimate is then too low), and its time estimate withdrawn."""
    loops = [(n, len(r.get("while_loops") or [])) for n, r in zip(depths, costing_reports)]
    if not any(k for _, k in loops):
        return est
    held = ", ".join(f"{k} in the {n}-layer program" for n, k in loops if k)
    return {
        **est,
        "method": f"{est['method']}; WARNING: the costing programs hold while loops ({held}), whose bodies "
        "XLA costs once: FLOPs too low, no time estimate",
        "estimated_step_seconds": None,
    }


def with_fit_note(est: dict, costing_reports, depths=COSTING_DEPTHS) -> dict:
    """`est` with its method saying which costing programs need more HBM than the chip has.

    Costing programs are unrolled: they hold every layer's activations at once, where the scanned
    step holds one layer's, and may not fit although the step does. The dry run compiles them past
    XLA's out-of-memory check (topology.PAST_OOM_COMPILER_OPTIONS), and XLA's figures for them are kept;
    the method line says they come from a program that could not run as compiled."""
    over = [(n, r) for n, r in zip(depths, costing_reports) if r.get("fits") is False and r.get("hbm_bytes_needed")]
    if not over:
        return est
    held = ", ".join(
        f"the {n}-layer one needs {_gib(r['hbm_bytes_needed'])} of {_gib(r['hbm_bytes_available'])} per device"
        for n, r in over
    )
    return {
        **est,
        "method": f"{est['method']}; NOTE: costing program(s) larger than HBM ({held}), compiled past XLA's "
        "out-of-memory check (xla_tpu_no_crash_on_oom): their figures are XLA's for programs that could not run "
        "as compiled",
    }


def _recomputation_skips_last_expert_matmul(job) -> bool:
    """Whether a MoE layer of the job's model runs torchtpu's dispatch with its scores applied after
    the experts: its experts' last matmul and the way back are one custom-gradient step, which a
    recomputation of the layer does not rerun."""
    from torchtpu.models.moe import ExpertParallelMoE

    return any(isinstance(m, ExpertParallelMoE) and not m.score_before_experts for m, _ in job.moe_layers)


def estimate_lines(job, est: dict, peak: float | None) -> list[str]:
    """The dry run's lines on model FLOPs and the estimated step (time, tokens/s, MFU) of
    the job's job, from `est` (step_estimate's per-micro-batch cost) and the chip's bf16 peak."""
    from ..model_builder import ac_settings

    dims = job.dims
    accum = dims.grad_accum_steps
    lines = []
    tokens = dims.tokens_per_step
    chips = dims.world_size
    model_flops = job.flops_per_token * tokens
    lines.append(
        f"model FLOPs / step      {model_flops:.4g} ({job.flops_per_token:.4g} per token x {tokens} "
        "tokens, torchtitan's 6N + attention)"
    )
    ac_mode, ac_every = ac_settings(job.cfg)
    lines.append(f"costing method          {est['method']}")
    flops = est.get("flops_per_device")
    if flops:
        model_per_device = model_flops / accum / chips
        expected = recompute_text(ac_mode, ac_every)
        if ac_mode in ("full", "selective") and _recomputation_skips_last_expert_matmul(job):
            expected += ", less where a MoE layer's recomputation stops before its experts' last matmul"
        lines.append(
            f"XLA FLOPs / device      {flops:.4g} per micro-batch = {flops / model_per_device:.2f}x the "
            f"model's {model_per_device:.4g} (activation recomputation '{ac_mode}' expects {expected})"
        )
    seconds = est.get("estimated_step_seconds")
    if seconds and seconds > 0:
        step = seconds * accum
        tps = tokens / step / chips
        lines.append(f"estimated step          {step:.3f} s ({accum} x {seconds:.4f} s per micro-batch)")
        lines.append(f"tokens/s per chip       {tps:,.0f} (estimate)")
        if peak:
            lines.append(
                f"MFU (estimate)          {mfu_percent(model_flops, step, chips, peak):.1f}% (model FLOPs / "
                "estimated step / chip bf16 peak)"
            )
    else:
        bound = flops / peak * accum if flops and peak else None
        if bound:
            # every FLOP at the chip's peak is 100% utilization by construction: a bound, not an MFU
            lines.append(
                f"tokens/s upper bound    {tokens / bound / chips:,.0f} per chip (every XLA FLOP at the "
                "chip's peak; XLA gave no time estimate, so no MFU estimate)"
            )
    return lines


def _gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB"


def dry_run(job) -> int:
    """Compile the job's step ahead of time, print the report; 0 if it fits, else 1."""
    import torchtpu.distributed as td
    from torchtpu.costing import temporaries_lines
    from torchtpu.distributed.topology import format_report

    if not hasattr(job.step_fn, "compile_for") or not hasattr(td, "empty"):
        raise RuntimeError(
            "this torchtpu build cannot compile a step ahead of time (compile_for / "
            "torchtpu.distributed.empty are missing)"
        )
    dims = job.dims
    accum = dims.grad_accum_steps
    print(mesh_line(job), flush=True)
    keep = os.environ.get("TORCHTPU_DRY_RUN_DUMP")  # a folder to keep XLA's dump of the step in
    with contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory(prefix="torchtpu-dry-run-") as dump:
        try:
            report, temps, t_compile, cached = _step_report(job, dump)
        except Exception as e:  # noqa: BLE001
            text = str(e)
            if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
                raise
            print(
                out_of_memory_line(text or type(e).__name__, _where(job), _fit_hint(job)),
                file=sys.stderr,
                flush=True,
            )
            return 1

    if accum > 1:
        print(
            f"(program compiled for 1 of {accum} micro-batches; memory, FLOPs and XLA's figures below are per "
            "micro-batch program, the step-time, tokens/s and MFU lines scale them to the whole step)",
            flush=True,
        )
    # a program that loops over the layers: XLA's own figures count the loop body once; the one
    # estimate printed is the costing programs' (below)
    print(format_report(report, costed_below=bool(report.get("while_loops"))), flush=True)
    lines = [f"compile time            {t_compile:.1f} s"]
    if cached:
        lines[0] += (
            f" (compiled {cached}; this report is from the dry-run cache: the same program, compiler, options and "
            "devices; TORCHTPU_DRY_RUN_CACHE=off compiles again)"
        )
    if temps:
        lines.append("largest temporaries     (per device, from XLA's buffer assignment: size; buffers that reuse it)")
        lines += temporaries_lines(temps)
    wide = {k: v for k, v in report["wide_types"].items() if v}
    if wide:
        lines.append(
            f"64-bit / complex         {wide} (emulated on TPU; XLA's cost model gives no estimate with X64 calls)"
        )
    # memory and fit are known now; the step-time estimate may compile more programs (below)
    print("\n".join(lines), flush=True)
    estimate = step_estimate(job, report)
    print("\n".join(estimate_lines(job, estimate, report["peak_bf16_flops_per_device"])), flush=True)

    fits = report["fits"]
    if fits is False:
        print(
            f"torchtpu-train: dry run: the step needs {_gib(report['hbm_bytes_needed'])} of HBM per device but a "
            f"{report['chip']} device has {_gib(report['hbm_bytes_available'])}: it does NOT fit on "
            f"{_where(job)}; {_fit_hint(job)}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    if fits is None:
        print(
            "dry run: compiled; no HBM capacity known for these devices (name a [tpu] topology to check the fit)",
            flush=True,
        )
    else:
        print("dry run: it fits", flush=True)
    return 0


def out_of_memory_line(text: str, where: str, hint: str) -> str:
    """The dry run's one line for XLA's out-of-memory error `text` compiling the step on `where`: HBM
    (with `hint`, what to shard more), or a kernel's VMEM (on-chip scratch, which the kernel's tiles
    fill), naming the op XLA names."""
    lines = [" ".join(line.split()) for line in text.strip().splitlines() if line.strip()]
    first = lines[0].rstrip(".") if lines else text
    if "vmem" not in text.lower():
        return (
            f"torchtpu-train: dry run: the step does NOT fit in device memory on {where}: the XLA compiler says: "
            f"{first}; {hint}"
        )
    detail = next((line for line in lines if "memory space vmem" in line), first).split(" custom-call(")[0]
    said = first if detail == first else f"{first} {detail}"
    return (
        f"torchtpu-train: dry run: the step does NOT compile on {where}: a kernel needs more VMEM (on-chip "
        f"memory) than the chip has: the XLA compiler says: {said.rstrip('.')}"
    )


def _fit_hint(job) -> str:
    hint = (
        "shard more (parallelism.data_parallel_shard_degree, tensor_parallel_degree) or lower "
        "training.local_batch_size / seq_len"
    )
    if job.cfg.activation_checkpoint.mode != "full":
        hint += ', or set activation_checkpoint.mode = "full"'
    return hint


def _where(job) -> str:
    return job.cfg.tpu.topology or f"{len(job.devices)} {job.devices[0].device_kind} devices"
