"""One Mixture-of-Experts grouped matmul on XLA's CPU backend two ways in one run, each in a process of
its own: `jax.lax.ragged_dot` (what programs for TPU take where megablox's kernels do not apply;
XLA:CPU computes it densely over every expert) and grouped_mm_blocked's loop over row tiles (what
programs for every other platform run). For each: the process's peak resident set, XLA's
temporaries, and the median time of the forward and of the forward with both gradients (`jax.vjp`,
as the expert dispatch differentiates it).

    python -m bench.grouped_mm_cpu --rows 16384 --dim 256 --hidden 768 --experts 64

The defaults are one layer of Qwen3's debugmodel_moe over the 16 x 128 tokens of
train_configs/qwen3_debug.toml (times 8 experts per token) on one device, bfloat16 as the experts
run; the tokens are routed at random, and expert 3 gets none.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

PATHS = ("ragged_dot", "blocked")


def _child(args) -> None:
    """Compile and time one path; print one JSON line."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.common import timed
    from torchtpu.backend.ops import linalg

    rng = np.random.default_rng(0)
    m, k, n, g = args.rows, args.dim, args.hidden, args.experts
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / 16, jnp.bfloat16)
    ids = rng.integers(0, g, m)
    ids[ids == 3] = 4
    ends = jnp.asarray(np.cumsum(np.bincount(ids, minlength=g)), jnp.int32)
    if args.child == "ragged_dot":

        def experts(a, b):
            return linalg._ragged_grouped_mm(a, b, ends, jnp.bfloat16)

    else:

        def experts(a, b):
            return linalg._blocked_grouped_mm(a, b, ends, jnp.bfloat16)

    def with_grads(a, b):
        y, vjp = jax.vjp(experts, a, b)
        return y, vjp(y)

    out = {}
    for name, fn in (("forward", experts), ("forward_and_grads", with_grads)):
        compiled = jax.jit(fn).lower(x, w).compile()
        out[f"{name}_temp_mib"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
        seconds = timed(lambda fn=compiled: fn(x, w), jax.block_until_ready, warmup=1, steps=args.steps)
        out[f"{name}_ms"] = seconds * 1e3
    print(json.dumps(out))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    m, k, n, g = args.rows, args.dim, args.hidden, args.experts
    print(f"({m} x {k}) rows through {g} experts of ({k} x {n}), bfloat16, XLA:CPU, one device")
    print(f"{'path':<12} {'peak RSS':>10} {'temps fwd':>10} {'fwd+grads':>10} {'forward':>10} {'fwd+grads':>10}")
    rows = {}
    for path in PATHS:
        cmd = [sys.executable, "-m", "bench.grouped_mm_cpu", "--child", path]
        cmd += ["--rows", str(m), "--dim", str(k), "--hidden", str(n), "--experts", str(g), "--steps", str(args.steps)]
        env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=1"))
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            raise SystemExit(f"{path}: exit status {proc.returncode}")
        r = rows[path] = json.loads(out.strip().splitlines()[-1])
        r["peak_gib"] = usage.ru_maxrss / 2**20
        print(
            f"{path:<12} {r['peak_gib']:>8.2f} G {r['forward_temp_mib']:>8.1f} M "
            f"{r['forward_and_grads_temp_mib']:>8.1f} M {r['forward_ms']:>7.0f} ms {r['forward_and_grads_ms']:>7.0f} ms"
        )
    a, b = rows["blocked"], rows["ragged_dot"]
    print(
        f"blocked / ragged_dot: peak RSS {a['peak_gib'] / b['peak_gib']:.3f}x, forward and gradients "
        f"{a['forward_and_grads_ms'] / b['forward_and_grads_ms']:.3f}x the time"
    )


if __name__ == "__main__":
    main()
