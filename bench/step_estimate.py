"""The dry run's step-time and MFU estimate for a config and TPU topology, without the full-depth compile.

    python -m bench.step_estimate --config train_configs/llama3_8b.toml --topology v5p:2x2x1
    python -m bench.step_estimate --config train_configs/llama3_70b.toml --topology v5p:4x4x4 --training.local_batch_size 1

`torchtpu-train --dry-run` compiles the whole step (for HBM fit, collectives, the largest
temporaries) and then costs it by compiling unrolled 2- and 4-layer copies of the same job and
extrapolating to the model's depth (XLA costs a loop body once, so the scanned program cannot be
costed as it is). This prints only the second half: the same estimate lines, from the same two
costing compiles, in a third of the dry run's time. Use it to compare code or config changes on
the step estimate; use the dry run for memory. Other arguments go to the trainer's config.
`--dump <folder>` keeps XLA's dump of the costing compiles (and of `--loop`'s), for `bench.hlo_breakdown`
(with `TORCHTPU_DRY_RUN_CACHE=off` when their reports are in the dry-run cache). A scanned job's
copies keep the layer scan, unrolled into straight-line code, as the dry run's do; `--unscanned-copies`
costs copies of the unscanned model instead (the dry run's method for jobs without the scan), which
XLA costs lower. `--loop` also prints XLA's own cost of the scanned step as it runs, a loop, from
three more compiles (XLA costs a loop body once): the job with its loops at the two depths, whose
difference is what the part outside the loops grows per layer, and the deeper one again with two
blocks per iteration, whose excess over one block per iteration is one layer of the loop body.
Without the full
program's compile the costing copies keep XLA's out-of-memory checks: a copy larger than HBM (DeepSeek-V3
671B's) is an error here, and the dry run costs it (topology.PAST_OOM_COMPILER_OPTIONS).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--topology", required=True)
    ap.add_argument("--dump", help="a folder for XLA's dump of the costing compiles (bench.hlo_breakdown reads it)")
    ap.add_argument(
        "--unscanned-copies",
        action="store_true",
        help="cost copies of the unscanned model (XLA shares the forward's values with the recomputation there)",
    )
    ap.add_argument(
        "--loop", action="store_true", help="also XLA's cost of the scanned step's loop (two more compiles)"
    )
    args, rest = ap.parse_known_args()
    import contextlib

    from torchtpu.backend.aot import dump_compiles_to
    from torchtpu.train.config.manager import load_config
    from torchtpu.train.trainer import Trainer

    cfg = load_config(["--config", args.config, "--dry-run", "--tpu.topology", args.topology, *rest])
    job = Trainer(cfg).built_step()  # on meta at full depth: the job's model FLOPs and batch; nothing is compiled
    t0 = time.perf_counter()
    dump = dump_compiles_to(args.dump) if args.dump else contextlib.nullcontext()
    with dump:  # also around --loop's compiles, below
        _report(args, job, t0)


def _report(args, job, t0: float) -> None:
    from torchtpu.hardware import CHIPS, parse_topology
    from torchtpu.train.dry_run.estimate import _runs_layer_scan, estimate_lines, leading_dense_layers, step_estimate

    est = step_estimate(job, {}, unscanned_copies=args.unscanned_copies)
    peak = CHIPS[parse_topology(args.topology).generation].peak_bf16_flops
    print(f"# {args.config} on {args.topology}: dry-run estimate, costing compiles {time.perf_counter() - t0:.0f} s")
    print("\n".join(estimate_lines(job, est, peak)))
    layer = (est.get("per_layer") or {}).get("estimated_step_seconds")
    if layer is not None and est.get("estimated_step_seconds"):
        sloped = job.model_args.n_layers - leading_dense_layers(job.model_args)
        rest = est["estimated_step_seconds"] - sloped * layer
        print(
            f"XLA's time per layer    {layer * 1e3:.2f} ms (the slope, x {sloped} layers); the rest of the "
            f"micro-batch {rest * 1e3:.1f} ms"
        )
        if args.loop and _runs_layer_scan(job):
            _loop_cost(job.cfg, job, sloped, peak)


def _loop_cost(cfg, job, sloped: int, peak: float) -> None:
    """XLA's cost of the step with the layer scan as a loop. XLA counts a loop body once: a program
    whose loops run m blocks costs X(m) = outside(m) + body, and the same program with two blocks per
    iteration X2(m) = outside(m) + 2 body. So body = X2(m4) - X(m4), the part outside the loops grows
    by (X(m4) - X(m2)) / (m4 - m2) per block, and the step is outside(sloped) + sloped x body, with
    m2, m4 the costing copies' scanned blocks."""
    from torchtpu.costing import mfu_percent
    from torchtpu.distributed.scan import straight_line_loops
    from torchtpu.distributed.topology import costing_compiles
    from torchtpu.train.dry_run.estimate import _step_report, costing_depths, leading_dense_layers

    lead = leading_dense_layers(job.model_args)
    n2, n4 = costing_depths(job.model_args)
    seconds = {}
    for n, per_iteration in ((n2, 1), (n4, 1), (n4, 2)):
        t = job.at_depth(cfg, n)
        label = f"the {n}-layer program with its loops" + (
            f", {per_iteration} blocks per iteration" * (per_iteration > 1)
        )
        with straight_line_loops(per_iteration), costing_compiles(t.mesh.jax_mesh, past_oom=False):
            rep, _, _, _ = _step_report(t, label=label)
        loops = [lp.get("trip_count") for lp in rep.get("while_loops") or []]
        if not rep.get("estimated_step_seconds") or set(loops) != {(n - lead) // per_iteration}:
            print(f"XLA's cost of the loop  none ({label}: loops {loops})")
            return
        seconds[n, per_iteration] = rep["estimated_step_seconds"]
        del t
    x2, x4, x4_paired = seconds[n2, 1], seconds[n4, 1], seconds[n4, 2]
    m2, m4 = n2 - lead, n4 - lead
    body = x4_paired - x4
    grow = (x4 - x2) / (m4 - m2)
    outside = x4 - body + (sloped - m4) * grow
    step = (outside + sloped * body) * job.dims.grad_accum_steps
    dims = job.dims
    mfu = mfu_percent(job.flops_per_token * dims.tokens_per_step, step, dims.world_size, peak)
    print(
        f"XLA's cost of the loop  {step:.3f} s per step, MFU {mfu:.1f}%: the loop body {body * 1e3:.2f} ms "
        f"per layer; outside the loops {outside * 1e3:.1f} ms per micro-batch, {grow * 1e3:.2f} ms more per layer "
        f"({n4}-layer program with 2 and 1 blocks per iteration: {x4_paired * 1e3:.1f} and {x4 * 1e3:.1f} ms; "
        f"{n2} layers: {x2 * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    main()
