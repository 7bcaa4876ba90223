"""Layer scan vs unrolled blocks: compile time, program size and per-chip HBM, side by side.

Compiles torchtitan's Llama 3 train step (forward, backward, clipping, AdamW; FSDP over the
chips, bf16 params / fp32 reduce, every block recomputed) ahead of time for a TPU topology with
libtpu's compiler (no TPU needed), at two depths, three ways:

- unrolled: every block traced and compiled (activation checkpoint wrapper per block);
- scan/select: the layer scan, block i's weights picked inside the loop (the default);
- scan/stack: the layer scan over a stacked copy of the blocks' weights.

    python -m bench.scan_layers [--topology v5p:2x2x1] [--dim 1024] [--layers 4,8] [--seq 2048]

Compile time is CPU seconds of this process (the VM is shared; wall time says little).
"""

from __future__ import annotations

import argparse
import os
import re
import resource

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def compile_one(devices, dim, n_layers, seq, batch, mode):
    import torch
    import torch.nn.functional as F
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    import torchtpu
    from torchtpu.distributed import empty, init_device_mesh, materialize, scan
    from torchtpu.distributed.topology import compile_report
    from torchtpu.models.llama3 import parallelize_llama
    from torchtpu.models.llama3.parallelize import batch_placements

    mesh = init_device_mesh("tpu", (len(devices),), mesh_dim_names=("dp_shard",), devices=devices)
    args = TransformerModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=dim // 128,
        n_kv_heads=max(dim // 512, 1),
        vocab_size=32768,
        max_seq_len=seq,
        multiple_of=256,
    )
    with torch.device("meta"):
        model = Transformer(args)
    scan.PARAMS_BY = {"scan/stack": "stack"}.get(mode, "select")
    parallelize_llama(
        model,
        mesh,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        ac_mode="full",
        scan_layers=mode != "unrolled",
    )
    materialize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), capturable=True, foreach=True)

    def step(inp, lab):
        loss = F.cross_entropy(model(inp).flatten(0, 1).float(), lab.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    inp = empty((batch, seq), torch.int64, mesh=mesh, placements=batch_placements(mesh))
    lab = empty((batch, seq), torch.int64, mesh=mesh, placements=batch_placements(mesh))
    t0 = cpu_seconds()
    compiled = torchtpu.compile(step).compile_for(inp, lab)
    t = cpu_seconds() - t0
    report = compile_report(compiled, mesh.jax_mesh)
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    return {
        "cpu_s": t,
        "dots": len(re.findall(r"\bdot\(|convolution\(", hlo)),
        "whiles": len(re.findall(r"\bwhile\(", hlo)),
        "temp_gib": mem.temp_size_in_bytes / 1024**3,
        "args_gib": mem.argument_size_in_bytes / 1024**3,
        "needed_gib": report["hbm_bytes_needed"] / 1024**3,
        "params_gib_per_chip": sum(p.numel() for p in model.parameters()) * 4 / len(devices) / 1024**3,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--topology", default="v5p:2x2x1")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", default="4,8")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--modes", default="unrolled,scan/select,scan/stack")
    a = ap.parse_args()
    from torchtpu.distributed.topology import topology_devices

    devices = topology_devices(a.topology)
    print(
        f"Llama 3 dim {a.dim}, seq {a.seq}, batch {a.batch}, FSDP over {a.topology} ({len(devices)} chips), "
        "bf16 params / fp32 reduce, full recomputation"
    )
    print(
        f"{'mode':<12} {'layers':>6} {'compile CPU s':>13} {'dot ops':>7} {'while':>5} {'params GiB/chip':>15} "
        f"{'args GiB':>8} {'temp GiB':>8} {'HBM needed GiB':>14}"
    )
    for n in [int(x) for x in a.layers.split(",")]:
        for mode in a.modes.split(","):
            r = compile_one(devices, a.dim, n, a.seq, a.batch, mode)
            print(
                f"{mode:<12} {n:>6} {r['cpu_s']:>13.1f} {r['dots']:>7} {r['whiles']:>5} "
                f"{r['params_gib_per_chip']:>15.3f} {r['args_gib']:>8.3f} {r['temp_gib']:>8.3f} "
                f"{r['needed_gib']:>14.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
