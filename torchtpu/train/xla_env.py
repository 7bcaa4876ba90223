"""The process environment a configuration asks for: [tpu] xla_flags and libtpu_init_args become
XLA_FLAGS and LIBTPU_INIT_ARGS, which must be set before the XLA backend starts (cli.py applies them
and re-executes itself). Standard library only."""

from __future__ import annotations

import os

from .config.job_config import JobConfig

__all__ = ["xla_env_updates"]


def _merge_flags(env_value: str, extra: str) -> str:
    have = env_value.split()
    names = {tok.split("=", 1)[0] for tok in have}
    add = [tok for tok in extra.split() if tok.split("=", 1)[0] not in names]
    return " ".join(have + add)


def xla_env_updates(cfg: JobConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables to change so tpu.xla_flags / tpu.libtpu_init_args take effect.

    Flags already in the environment win over the config's. Empty dict: nothing to change.
    Must be applied before the XLA backend starts.
    """
    environ = os.environ if environ is None else environ
    updates = {}
    for var, extra in (("XLA_FLAGS", cfg.tpu.xla_flags), ("LIBTPU_INIT_ARGS", cfg.tpu.libtpu_init_args)):
        current = environ.get(var, "")
        merged = _merge_flags(current, extra)
        if merged != " ".join(current.split()) and extra.split():
            updates[var] = merged
    return updates
