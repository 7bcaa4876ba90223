"""What the trainer tests share: the repository's debug-model config and the command line of a
short training run of it."""

from __future__ import annotations

import os

from ..processes import cpu_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBUG_TOML = os.path.join(REPO, "train_configs", "debug_model.toml")


def debug_argv(dump, steps, *extra, seq_len=32, local_batch_size=1, log_freq=None, warmup_steps=None):
    """torchtpu-train arguments: the debug model for `steps` steps of `local_batch_size`
    sequences of `seq_len` tokens, writing everything under `dump`, metrics every `log_freq` steps
    and `warmup_steps` of learning-rate warm-up when given; then `extra`."""
    given = {"--metrics.log_freq": log_freq, "--lr_scheduler.warmup_steps": warmup_steps}
    return [
        "--config",
        DEBUG_TOML,
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        str(seq_len),
        "--training.local_batch_size",
        str(local_batch_size),
        "--training.steps",
        str(steps),
        *(a for key, value in given.items() if value is not None for a in (key, str(value))),
        *extra,
    ]


def two_block_process_env() -> dict:
    """The environment of a trainer process a test starts: this checkout, 8 CPU devices, and a
    2-block copy of the debug model (the trainer's TORCHTPU_TEST_N_LAYERS hook, announced on its
    console) where the depth is not what the test checks."""
    return dict(
        os.environ,
        PYTHONPATH=REPO,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=cpu_flags(8),
        TORCHTPU_TEST_N_LAYERS="2",
    )
