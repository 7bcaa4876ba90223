"""Attention forward + backward compiled ahead of time for a TPU chip, with torchtpu's Pallas
flash-attention kernels (what F.scaled_dot_product_attention runs on TPU: the forward and the
one-pass backward), the same forward with the dK/dV and dQ backward kernels
(TORCHTPU_FLASH_BACKWARD=two-kernel), and torchtpu's blocked pure-JAX attention
(TORCHTPU_PALLAS_ATTENTION=0), in one run: HBM temporaries, the FLOPs XLA counts and its
estimated seconds.

    python -m bench.attention_tpu --topology v5p:2x2x1 --batch 1 --heads 32 --kv-heads 8 --seq 8192

The defaults are one Llama 3 8B layer's attention at seq 8192 on one chip. The blocked path
runs its query blocks in a loop whose body XLA costs once, so its FLOPs and seconds are
undercounts; the kernels declare theirs (attention_tpu.kernel_costs).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def compile_attention(args):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from torchtpu.backend.registry import LOWERINGS, aten
    from torchtpu.distributed import topology as topo

    # a one-chip mesh: the program then records which chip it is for (the backward picks its kernels by VMEM)
    mesh = jax.sharding.Mesh(np.array(topo.topology_devices(args.topology)[:1]), ("chip",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    q = jax.ShapeDtypeStruct((args.batch, args.heads, args.seq, args.head_dim), jnp.bfloat16, sharding=sh)
    kv = jax.ShapeDtypeStruct((args.batch, args.kv_heads, args.seq, args.head_dim), jnp.bfloat16, sharding=sh)
    S = args.seq

    # the lowerings of the attention ops torchtitan's SDPA reaches on tpu, called on JAX arrays
    forward = LOWERINGS[aten._scaled_dot_product_fused_attention_overrideable.default].fn
    backward = LOWERINGS[aten._scaled_dot_product_fused_attention_overrideable_backward.default].fn

    def step(q, k, v, g):
        out, lse = forward(q, k, v, None, 0.0, True)[:2]
        grads = backward(g, q, k, v, None, [True] * 3, out, lse, None, None, S, S, 0.0, True, None, None)
        return grads[:3]

    t0 = time.perf_counter()
    compiled = topo.aot_compile(jax.jit(step).lower(q, kv, kv, q))
    secs = time.perf_counter() - t0
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    return {
        "temp": mem.temp_size_in_bytes,
        "flops": cost.get("flops", -1),
        "est_s": cost.get("optimal_seconds", -1),
        "kernels": compiled.as_text().count('custom_call_target="tpu_custom_call"'),
        "compile_s": secs,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    rows = {}
    for name, flag, backward in (("pallas", "1", "auto"), ("two-kernel", "1", "two-kernel"), ("blocked", "0", "auto")):
        os.environ["TORCHTPU_PALLAS_ATTENTION"] = flag  # both read when the step is traced
        os.environ["TORCHTPU_FLASH_BACKWARD"] = backward
        rows[name] = compile_attention(args)
    print(
        f"attention fwd+bwd, B{args.batch} H{args.heads}/{args.kv_heads} S{args.seq} D{args.head_dim} bf16 causal, "
        f"one {args.topology} chip"
    )
    print(f"{'':12}{'temporaries':>14}{'XLA FLOPs':>12}{'XLA est. s':>12}{'kernels':>9}{'compile s':>11}")
    for name, r in rows.items():
        print(
            f"{name:12}{r['temp'] / 2**20:>10.0f} MiB{r['flops']:>12.3e}{r['est_s']:>12.2e}{r['kernels']:>9}"
            f"{r['compile_s']:>11.0f}"
        )
    print(f"temporaries pallas/blocked: {rows['pallas']['temp'] / rows['blocked']['temp']:.2f}x")


if __name__ == "__main__":
    main()
