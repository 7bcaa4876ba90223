"""Starting a training job, in one place: who holds the dump folder and when, joining the job's other
processes, the saved configuration and the step watchdog.

    lock_before_start(cfg)            # torchtpu-train, before the slow part of starting
    with joined_job(cfg) as watchdog: # the trainer: join, hold the folder, save the config, watch the steps
        ...

The dump folder (dump_lock.py) is held by one name per job. A job of one process, and a torchelastic
job (its run id names it on every host), take it before starting, so a second job on the folder is
refused at once; the processes of a TPU slice joined by JAX's own discovery have no shared name, so
process 0 holds it for them once the job is joined. Taking it again in the same process returns the
same hold. The exit statuses a job ends with are fault.py's.
"""

from __future__ import annotations

import contextlib
import os

from .config.job_config import JobConfig
from .config.manager import save_resolved_config
from .console import log
from .dump_lock import RUN_ID_ENV, hold_dump_folder
from .fault import StepWatchdog, attempt_number

__all__ = ["joined_job", "lock_before_start"]


def _one_process_or_elastic() -> bool:
    """This job is one process, or a torchelastic job (its run id names it on every host)."""
    from torchtpu._platform import has_tpu_chips

    return RUN_ID_ENV in os.environ or (not has_tpu_chips() and int(os.environ.get("WORLD_SIZE", "1") or 1) == 1)


def lock_before_start(cfg: JobConfig) -> None:
    """Refuse a second job on this dump folder before the slow part of starting (a ConfigError naming the
    job that holds it), where this process can hold it for its job already."""
    if not cfg.tpu.dry_run and _one_process_or_elastic():
        hold_dump_folder(cfg)


def _lock_after_join(cfg: JobConfig):
    """This process's hold on the dump folder for its joined job, or None where process 0 holds it."""
    import jax

    if RUN_ID_ENV not in os.environ and jax.process_index() != 0:
        return None
    return hold_dump_folder(cfg)


@contextlib.contextmanager
def joined_job(cfg: JobConfig):
    """Join the job (coordinator from torchrun / the TPU slice) before any device work, hold the dump
    folder before anything is written there, save the resolved configuration, and watch the steps;
    yields the fault.StepWatchdog (None in a dry run, which joins no job). Releases both at the end."""
    watchdog = None
    lock = None
    if not cfg.tpu.dry_run:
        from torchtpu.distributed import initialize

        initialize(init_timeout_seconds=cfg.comm.init_timeout_seconds)
        lock = _lock_after_join(cfg)
    try:
        save_resolved_config(cfg)
        if not cfg.tpu.dry_run:
            if RUN_ID_ENV in os.environ:
                log(
                    f"attempt {attempt_number()} (torchelastic restarts allowed: "
                    f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '0')})"
                )
            watchdog = StepWatchdog(cfg.comm.init_timeout_seconds, cfg.comm.train_timeout_seconds)
        yield watchdog
    finally:
        if watchdog is not None:
            watchdog.close()
        if lock is not None:
            lock.release()
