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
XLA costs lower. `--loop` also prints XLA's own cost of the scanned step as it runs, a loop: the
same job compiled with its loops at the two depths (XLA costs a loop body once), whose difference is
what the part outside the loop grows per layer, and whose body is then the 2-layer loop program less
that part (the copies' intercept). Without the full
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
    trainer = Trainer(cfg)  # on meta at full depth: the job's model FLOPs and batch; nothing is compiled
    t0 = time.perf_counter()
    dump = dump_compiles_to(args.dump) if args.dump else contextlib.nullcontext()
    with dump:  # also around --loop's compiles, below
        _report(args, trainer, t0)


def _report(args, trainer, t0: float) -> None:
    from torchtpu.distributed.topology import chip_spec
    from torchtpu.train.dry_run.estimate import _runs_layer_scan, estimate_lines, leading_dense_layers, step_estimate

    est = step_estimate(trainer, {}, unscanned_copies=args.unscanned_copies)
    peak = chip_spec(args.topology.split(":")[0])["peak_bf16_flops"]
    print(f"# {args.config} on {args.topology}: dry-run estimate, costing compiles {time.perf_counter() - t0:.0f} s")
    print("\n".join(estimate_lines(trainer, est, peak)))
    layer = (est.get("per_layer") or {}).get("estimated_step_seconds")
    if layer is not None and est.get("estimated_step_seconds"):
        sloped = trainer.model_args.n_layers - leading_dense_layers(trainer.model_args)
        rest = est["estimated_step_seconds"] - sloped * layer
        print(
            f"XLA's time per layer    {layer * 1e3:.2f} ms (the slope, x {sloped} layers); the rest of the "
            f"micro-batch {rest * 1e3:.1f} ms"
        )
        if args.loop and _runs_layer_scan(trainer):
            _loop_cost(trainer.cfg, trainer, rest, sloped, peak)


def _loop_cost(cfg, trainer, rest: float, sloped: int, peak: float) -> None:
    """XLA's cost of the step with the layer scan as a loop: X(n) = rest + n (grow + body) over the
    copies' depths n, the loop body counted once: grow from two depths, body from the shallower."""
    from torchtpu.distributed.topology import costing_compiles
    from torchtpu.train.dry_run.estimate import _step_report, costing_depths, leading_dense_layers

    lead = leading_dense_layers(trainer.model_args)
    seconds = {}
    for n in costing_depths(trainer.model_args):
        t = type(trainer)(cfg, n_layers=n)
        with costing_compiles(t.mesh.jax_mesh, past_oom=False):
            rep, _, _, _ = _step_report(t, label=f"the {n}-layer program with its loops")
        loops = [lp.get("trip_count") for lp in rep.get("while_loops") or []]
        if not rep.get("estimated_step_seconds") or set(loops) != {n - lead}:
            print(f"XLA's cost of the loop  none (the {n}-layer program's loops: {loops})")
            return
        seconds[n] = rep["estimated_step_seconds"]
        del t
    (n2, x2), (n4, x4) = sorted(seconds.items())
    grow = (x4 - x2) / (n4 - n2)
    body = x2 - rest - (n2 - lead) * grow
    step = (rest + sloped * (grow + body)) * trainer.dims.grad_accum_steps
    mfu = trainer.flops_per_token * trainer.dims.tokens_per_step / (step * trainer.dims.world_size * peak)
    print(
        f"XLA's cost of the loop  {step:.3f} s per step, MFU {100 * mfu:.1f}%: the loop body {body * 1e3:.2f} ms "
        f"per layer, the part outside it {grow * 1e3:.2f} ms more per layer ({n2}- and {n4}-layer programs "
        f"with their loops: {x2 * 1e3:.1f} and {x4 * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    main()
