"""Checkpoint saving during training, side by side in one run: blocking save vs asynchronous save, and the
training step's time while an asynchronous save is being written vs a normal step (goal <= 1.2x).

    python -m bench.checkpoint_save                       # debug model, FSDP over 8 XLA CPU devices
    python -m bench.checkpoint_save --seq-len 256 --local-batch-size 4 --rounds 3

The job is torchtpu-train's own (train_configs/debug_model.toml through Trainer): the state saved is the
full resumable state (parameters, AdamW moments, schedule, data position), with the trainer's
CheckpointManager (Orbax) into a temporary folder. Each step is timed to completion (the loss is read
back), so step times include any slow-down the background writer causes.

Reported:
  normal step           median step time with no save in flight
  blocking save         CheckpointManager(async_mode="disabled").save: training waits for all of it
  async save, blocking  the part of an asynchronous save training waits for (copying off the devices)
  async save, total     until the files are complete on disk
  step during save      median (and max) time of the steps that ran while the asynchronous save was
                        still being written; ratio = that / normal step
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(REPO, "train_configs", "debug_model.toml"))
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--local-batch-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="saves of each kind")
    ap.add_argument("--steps", type=int, default=5, help="normal steps timed per round")
    args = ap.parse_args()

    import jax

    import torchtpu
    from torchtpu.train.checkpoint.manager import CheckpointManager
    from torchtpu.train.config.manager import load_config
    from torchtpu.train.trainer import Trainer

    dump = tempfile.mkdtemp(prefix="torchtpu-bench-ckpt-")
    cfg = load_config(
        [
            "--config",
            args.config,
            "--job.dump_folder",
            dump,
            "--training.seq_len",
            str(args.seq_len),
            "--training.local_batch_size",
            str(args.local_batch_size),
            "--validation.no-enable",
            "--training.steps",
            "100000",
            "--debug.seed",
            "0",
        ]
    )
    t = Trainer(cfg)

    def step() -> float:
        t0 = time.perf_counter()
        loss, _ = t.step_fn(t.next_batch())
        t.lr_scheduler.step()
        t.step += 1
        jax.block_until_ready(torchtpu.to_jax(loss))
        return time.perf_counter() - t0

    for _ in range(3):  # eager warm-up, compile, one more
        step()
    state_bytes = sum(
        a.nbytes
        for a in jax.tree_util.tree_leaves(
            jax.tree_util.tree_map(
                lambda x: torchtpu.to_jax(x) if hasattr(x, "device") and x.device.type == "tpu" else None, t.state()
            )
        )
    )

    blocking = CheckpointManager(os.path.join(dump, "blocking"), interval=1, async_mode="disabled")
    background = CheckpointManager(os.path.join(dump, "async"), interval=1, async_mode="async")
    normal, block_save, async_block, async_total, during = [], [], [], [], []
    for _ in range(args.rounds):
        normal += [step() for _ in range(args.steps)]
        t0 = time.perf_counter()
        blocking.save(t.step, t.state())
        blocking.wait()
        block_save.append(time.perf_counter() - t0)
        step()
        t0 = time.perf_counter()
        background.save(t.step, t.state())
        async_block.append(time.perf_counter() - t0)
        mgr = background._mgr
        while mgr.is_saving_in_progress():
            during.append(step())  # a step started while the files were being written
        background.wait()
        async_total.append(time.perf_counter() - t0)
    blocking.close()
    background.close()

    med = statistics.median
    n = med(normal)
    print(
        f"config {os.path.relpath(args.config, REPO)}, seq_len {args.seq_len}, local batch {args.local_batch_size}, "
        f"{len(t.devices)} {t.devices[0].platform} devices, state {state_bytes / 2**20:.1f} MiB, "
        f"{args.rounds} saves of each kind"
    )
    print(f"normal step            {n * 1e3:8.1f} ms (median of {len(normal)})")
    print(f"blocking save          {med(block_save) * 1e3:8.1f} ms  ({med(block_save) / n:.1f} steps)")
    print(
        f"async save, blocking   {med(async_block) * 1e3:8.1f} ms  ({med(async_block) / n:.2f} steps; "
        f"{med(block_save) / med(async_block):.1f}x less than a blocking save)"
    )
    print(f"async save, total      {med(async_total) * 1e3:8.1f} ms")
    print(
        f"step during async save {med(during) * 1e3:8.1f} ms median, {max(during) * 1e3:.1f} ms max over "
        f"{len(during)} steps: {med(during) / n:.2f}x a normal step (goal <= 1.2x)"
    )


if __name__ == "__main__":
    main()
