"""The chunked loss's effect on a sharded step's HBM and FLOPs: [tpu] loss_chunk_size 0 vs on, side by side.

Compiles the trainer's step (what `torchtpu-train --dry-run` compiles) ahead of time for a TPU
topology with libtpu's compiler (no TPU needed), shallow and unrolled, once with the plain loss
and once chunked, and prints per-chip HBM, temporaries, XLA's FLOP count per chip, its
collectives and the largest slices of device memory.

    python -m bench.loss_chunk_memory --config train_configs/llama3_70b.toml --topology v5p:4x4x4
    python -m bench.loss_chunk_memory --config train_configs/llama3_8b.toml --topology v5p:2x2x1 --layers 4
    python -m bench.loss_chunk_memory --config train_configs/llama3_8b.toml --topology v5p:2x2x1 --chunks 2048

Other arguments go to the trainer's config (e.g. --training.seq_len 4096).
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def compile_once(argv, layers: int, chunk: int, dump: str) -> dict:
    from torchtpu.costing import count_collectives, largest_temporaries
    from torchtpu.distributed.topology import compile_report, dump_compiles_to
    from torchtpu.train.config.manager import load_config
    from torchtpu.train.dry_run.estimate import compile_step, unrolled
    from torchtpu.train.trainer import Trainer

    cfg = unrolled(load_config([*argv, "--tpu.loss_chunk_size", str(chunk)]))
    trainer = Trainer(cfg, n_layers=layers)
    t0 = time.perf_counter()
    with dump_compiles_to(dump):
        compiled = compile_step(trainer.built_step())
    seconds = time.perf_counter() - t0
    report = compile_report(compiled, trainer.mesh.jax_mesh)
    report["compile_seconds"] = seconds
    report["collectives"] = count_collectives(compiled.as_text())
    report["largest"] = largest_temporaries(dump, 6)
    del trainer, compiled
    gc.collect()
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--topology", required=True)
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks compiled (unrolled)")
    ap.add_argument("--chunks", default="0,2048", help="the loss_chunk_size of each run, comma-separated")
    a, overrides = ap.parse_known_args(argv)
    base = ["--config", a.config, "--dry-run", "--tpu.topology", a.topology, *overrides]
    gib = 1024**3
    print(f"# bench/loss_chunk_memory.py {a.config} on {a.topology}, {a.layers} layers unrolled", flush=True)
    print(
        "| loss_chunk_size | HBM / chip | temp / chip | XLA FLOPs / chip | collectives | compile "
        "| largest slices (GiB: shapes) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for chunk in (int(c) for c in a.chunks.split(",")):
        with tempfile.TemporaryDirectory() as dump:
            r = compile_once(base, a.layers, chunk, dump)
        largest = "; ".join(f"{x['bytes'] / gib:.2f}: {x['shapes']}" for x in r["largest"][:3])
        collectives = ", ".join(f"{n} {k}" for k, n in r["collectives"].items() if n)
        print(
            f"| {chunk} | {r['hbm_bytes_needed'] / gib:.2f} GiB | {r['memory']['temp_bytes'] / gib:.2f} GiB "
            f"| {r['flops_per_device']:.4e} | {collectives} | {r['compile_seconds']:.0f} s | {largest} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
