"""FlexAttention on tpu against F.scaled_dot_product_attention's paths, compiled ahead of time for one
TPU chip in one run: causal attention (or a sliding window), forward and backward in one program,
bfloat16. XLA's estimated seconds and the program's temporaries for

- flex_attention's JAX path (backend/ops/flex_attention.py), with the block lists PyTorch's
  `create_block_mask` makes and the mask_mod as the JAX function torchtpu traces it into;
- SDPA's Pallas flash kernels (backend/ops/attention_tpu.py), what a TPU program runs for
  `is_causal=True` (no sliding window: SDPA has none, so `--window` leaves this row out);
- SDPA's blocked JAX attention (backend/ops/nn.py), what it runs off TPU.

    python -m bench.flex_attention --topology v5p:2x2x1 --batch 2 --heads 8 --seq 2048
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default="v5p:2x2x1")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=0, help="a causal sliding window of this many keys (0: causal)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from torchtpu.backend import aot
    from torchtpu.backend.ops import attention_tpu, nn
    from torchtpu.backend.ops import flex_attention as flex
    from torchtpu.distributed import topology as topo

    chip = topo.topology_devices(args.topology)[0]
    # a one-chip mesh: the program's inputs then say which chip it is for, which picks the flash
    # backward that chip's VMEM holds (the one-pass kernel on v5p and v6e)
    sh = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([chip]), ("x",)), jax.sharding.PartitionSpec())
    b, h, s, d, w = args.batch, args.heads, args.seq, args.head_dim, args.window
    scale = d**-0.5

    def mask_fn(b_, h_, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        return keep & (q_idx - kv_idx < w) if w else keep

    def torch_mask(b_, h_, q_idx, kv_idx):
        return mask_fn(b_, h_, q_idx, kv_idx)

    block_mask = create_block_mask(torch_mask, None, None, s, s, device="cpu")
    lists = [jnp.asarray(t.numpy()) for t in (block_mask.kv_num_blocks, block_mask.kv_indices)]
    lists += [jnp.asarray(t.numpy()) for t in (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)]
    blocks = flex.Blocks(*lists, *block_mask.BLOCK_SIZE)

    def flex_step(q, k, v, g):
        out, lse, _ = flex.forward(q, k, v, blocks, None, mask_fn, scale=scale)
        return flex.backward(q, k, v, out, lse, g, None, blocks, None, mask_fn, scale=scale)[:3]

    def pallas_step(q, k, v, g):
        out, lse = attention_tpu.attention_forward(q, k, v, causal=True, scale=scale)
        return attention_tpu.attention_backward(g, q, k, v, out, lse, causal=True, scale=scale)

    def blocked_step(q, k, v, g):  # its backward recomputes the forward block by block
        return nn._fused_backward(g, q, k, v, None, True, scale)

    steps = {"flex_attention (JAX)": flex_step}
    if not w:
        steps.update({"SDPA, Pallas kernels": pallas_step, "SDPA, blocked JAX": blocked_step})
    x = jax.ShapeDtypeStruct((b, h, s, d), jnp.bfloat16, sharding=sh)
    what = f"sliding window {w}" if w else "causal"
    print(f"# attention on one {args.topology} chip: ({b}, {h}, {s}, {d}) bfloat16, {what}, forward + backward")
    print("| path | XLA's estimate | temporaries |")
    print("| --- | --- | --- |")
    with torch.no_grad():
        for name, step in steps.items():
            compiled = aot.aot_compile(jax.jit(step).lower(x, x, x, x))
            seconds = topo.compile_report(compiled, [chip])["estimated_step_seconds"]
            temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
            shown = "n/a" if seconds is None else f"{seconds * 1e3:.3f} ms"
            print(f"| {name} | {shown} | {temp:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
