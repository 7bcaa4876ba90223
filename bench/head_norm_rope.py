"""Qwen3's query (or key) path, per-head RMS norm + rotary embedding + transpose to head-major
(`torchtpu::head_norm_rope`), compiled ahead of time for one TPU chip two ways in one run: the
op's Pallas kernels (what a TPU program runs) and the same op as XLA's fusions (its lowering on
other platforms, the arithmetic the kernels reproduce): XLA's estimated seconds, forward and
backward.

    python -m bench.head_norm_rope --topology v5p:2x2x1 --batch 8 --seq 4096 --heads 32

The defaults are one chip's queries in Qwen3 30B-A3B's shipped config (8 sequences of 4096, 32
heads of 128); `--heads 4` gives its keys.
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default="v5p:2x2x1")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from torchtpu.backend.ops import head_norm_rope as op
    from torchtpu.backend.ops import head_norm_rope_tpu as kernels
    from torchtpu.distributed import topology as topo

    chip = topo.topology_devices(args.topology)[0]
    sh = jax.sharding.SingleDeviceSharding(chip)
    b, s, h, d = args.batch, args.seq, args.heads, args.head_dim
    x = jax.ShapeDtypeStruct((b, s, h * d), jnp.bfloat16, sharding=sh)
    w = jax.ShapeDtypeStruct((d,), jnp.float32, sharding=sh)
    table = jax.ShapeDtypeStruct((s, d), jnp.bfloat16, sharding=sh)
    g = jax.ShapeDtypeStruct((b, h, s, d), jnp.bfloat16, sharding=sh)
    eps = 1e-6
    paths = {
        "Pallas kernels": (kernels.forward, kernels.backward),
        "XLA fusions": (op._xla_forward, op._xla_backward),
    }
    print(f"# head_norm_rope on one {args.topology} chip: x ({b}, {s}, {h} x {d}) bfloat16 -> ({b}, {h}, {s}, {d})")
    print("| path | forward (XLA's estimate) | backward |")
    print("| --- | --- | --- |")
    for name, (forward, backward) in paths.items():
        fwd = jax.jit(functools.partial(forward, head_dim=d, eps=eps)).lower(x, w, table, table).compile()
        bwd = jax.jit(functools.partial(backward, head_dim=d, eps=eps)).lower(g, x, w, table, table).compile()
        times = [topo.compile_report(c, [chip])["estimated_step_seconds"] for c in (fwd, bwd)]
        print(f"| {name} | " + " | ".join("n/a" if t is None else f"{t * 1e3:.3f} ms" for t in times) + " |")


if __name__ == "__main__":
    main()
