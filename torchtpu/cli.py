"""Console entry points declared in pyproject.toml.

The trainer (`torchtpu-train`) and the launcher (`torchtpu-launch`) are not built yet; until
they are, the commands say so and exit non-zero instead of failing on a missing module.
"""
from __future__ import annotations

import sys


def _not_yet(command: str) -> int:
    print(
        f"{command}: not available in torchtpu {__import__('torchtpu').__version__} yet. "
        "The tpu device, torchtpu.compile and activation checkpointing are; see README.md.",
        file=sys.stderr,
    )
    return 2


def train_main() -> int:
    return _not_yet("torchtpu-train")


def launch_main() -> int:
    return _not_yet("torchtpu-launch")
