"""The trainer's console lines: `[torchtpu-train] ...`, printed by the first process only."""

from __future__ import annotations

__all__ = ["log"]


def log(msg: str) -> None:
    import jax

    if jax.process_index() == 0:
        print(f"[torchtpu-train] {msg}", flush=True)
