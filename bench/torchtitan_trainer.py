"""torchtitan's own trainer on tpu (eager and compiled) beside torchtpu-train, same model and batch.

    python -m bench.torchtitan_trainer                # 10 steps each, median tokens/s of steps 3..10
    python -m bench.torchtitan_trainer --steps 6

One XLA CPU device per run (on a TPU VM, one chip), torchtitan's llama3 debug config
(tests/assets/torchtitan/llama3_debug.toml) at seq_len 256 and local batch 8 in float32:
  (a) `torchrun -m torchtitan.train`, eager: one XLA program per op;
  (b) the same with `--compile.enable --compile.backend tpu`: Dynamo graphs of the model and the loss;
  (c) `torchtpu-train` on the same model, sequence length, batch and optimizer: the whole step (forward,
      backward, clipping, AdamW) as one XLA program.
It prints each run's median tokens/s (torchtitan's `tps`, torchtpu-train's metrics) and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.processes import cpu_flags
from tests.torchtitan_job import run, steps, workdir

ROOT = Path(__file__).resolve().parent.parent
FP32 = ("--training.mixed_precision_param", "float32")
BATCH = ("--training.local_batch_size", "8")  # the test config's 2 sequences a step, as torchtitan ships: 8


def _median_tps(records: dict[int, dict], first: int) -> float:
    return statistics.median(r["tps"] for s, r in records.items() if s >= first)


def torchtitan(root: Path, steps_: int, *extra: str) -> float:
    out = run(root, "llama3_debug.toml", "--training.steps", str(steps_), *FP32, *BATCH, *extra)
    return _median_tps(steps(out), 3)


def torchtpu_train(dump: Path, steps_: int) -> float:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags(1))
    cmd = [
        sys.executable,
        "-m",
        "torchtpu.train",
        "--config",
        str(ROOT / "train_configs" / "debug_model.toml"),
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "8",
        "--training.steps",
        str(steps_),
        "--metrics.log_freq",
        "1",
        "--validation.no-enable",
        "--job.dump_folder",
        str(dump),
    ]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=ROOT)
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tps"] for r in records if r.get("step", 0) >= 3 and "tps" in r)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = workdir(Path(tmp))
        eager = torchtitan(root, args.steps, "--job.dump_folder", "eager")
        compiled = torchtitan(
            root, args.steps, "--job.dump_folder", "compiled", "--compile.enable", "--compile.backend", "tpu"
        )
        ours = torchtpu_train(Path(tmp) / "torchtpu", args.steps)
    print(f"tokens/s (median of steps 3..{args.steps}), llama3 debugmodel, seq 256, batch 8, 1 XLA CPU device, float32")
    print(f"  torchtitan.train eager            {eager:10.1f}")
    print(f"  torchtitan.train compiled (tpu)   {compiled:10.1f}   {compiled / eager:.2f}x eager")
    print(
        f"  torchtpu-train (one program/step) {ours:10.1f}   {ours / eager:.2f}x eager, {ours / compiled:.2f}x compiled"
    )


if __name__ == "__main__":
    main()
