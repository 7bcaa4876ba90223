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


# A 2-block copy of the debug model ([model] n_layers), for the runs whose subject is not the depth.
TWO_BLOCKS = ("--model.n_layers", "2")


def process_env() -> dict:
    """The environment of a trainer process a test starts: this checkout and 8 CPU devices."""
    return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags(8))
