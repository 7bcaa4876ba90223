"""Where a run starts: this run's newest readable checkpoint, or [checkpoint] initial_load_path.

    resumed, step = maybe_resume(checkpointer, cfg, state)   # state: a train_state.TrainState

A save that never finished is ignored (and removed); a damaged checkpoint is set aside as
step_N.unreadable and the one before it is used; a final model-only save resumes from the newest
full checkpoint before it. initial_load_path starts from a torchtpu checkpoint's weights (or whole
state) or a Hugging Face folder, and applies only while the run has no checkpoint of its own.
"""

from __future__ import annotations

import time

from ..config.job_config import ConfigError
from ..console import log
from ..fault import attempt_number
from .files import describe_size, folder_size

__all__ = ["maybe_resume"]


def maybe_resume(ck, job_cfg, state) -> tuple[bool, int | None]:
    """Resume from the newest readable checkpoint of this run in `ck` ([checkpoint] load_step: that one);
    without any, start from [checkpoint] initial_load_path when set (not in a dry run). Restores `state`
    (a train_state.TrainState) in place; returns (whether a checkpoint of this run was restored, the step
    the restored state holds, None when no step was restored)."""
    cfg = job_cfg.checkpoint
    if ck is None:
        if cfg.initial_load_path and not job_cfg.tpu.dry_run:
            return False, _initial_load(job_cfg, state)
        return False, None
    from .manager import CorruptCheckpointError, split_step_path

    for partial in ck.partial_saves:
        log(
            f"ignoring {partial}: an incomplete checkpoint (its save never finished, e.g. the job was killed "
            "mid-save); it is removed"
        )
    latest = ck.latest_step()
    while latest is not None:
        try:
            return True, _resume_at(ck, job_cfg, state, latest if cfg.load_step == -1 else cfg.load_step)
        except CorruptCheckpointError as e:
            if cfg.load_step != -1:
                raise  # the step the user asked for, not some other one
            moved = ck.set_aside(split_step_path(e.path)[1])
            latest = ck.latest_step()
            log(
                f"{e} -- set it aside as {moved}; "
                + (
                    f"falling back to the previous checkpoint, step {latest}"
                    if latest is not None
                    else "no older checkpoint: starting this run from the beginning"
                )
            )
    if cfg.initial_load_path:
        return False, _initial_load(job_cfg, state)
    return False, None


def _resume_at(ck, job_cfg, state, step: int) -> int:
    """Resume from checkpoint `step` of this run's folder (or, when it holds only the final model
    weights, from the newest full checkpoint before it); returns the step restored."""
    from .manager import CheckpointError, is_model_only, load_model_weights

    cfg = job_cfg.checkpoint
    if is_model_only(ck.manifest(step)):
        path = ck.step_path(step)
        if step >= job_cfg.training.steps:
            # This run already finished: its final save holds the weights only.
            load_model_weights(ck, step, state.model)
            log(
                f"{path} is this run's final (model-only) save: nothing left to train up to training.steps = "
                f"{job_cfg.training.steps}; raise it to train on"
            )
            return step
        full = [s for s in ck.all_steps() if s < step and not is_model_only(ck.manifest(s))]
        if cfg.load_step != -1 or not full:
            raise CheckpointError(
                f"checkpoint {path} holds only model weights (a final save with checkpoint.last_save_model_only), "
                "so training cannot resume from it: start a new job (another job.dump_folder) with "
                f"--checkpoint.initial_load_path {path} to train on from these weights"
                + (
                    f", or resume the full checkpoint of step {full[-1]} (--checkpoint.load_step {full[-1]})"
                    if full
                    else ""
                )
            )
        log(
            f"{path} holds only model weights (the final save of the previous run); resuming from the newest "
            f"full checkpoint, step {full[-1]}"
        )
        step = full[-1]
    t0 = time.perf_counter()
    step = state.restore(ck, step, cfg.exclude_from_loading)
    path = ck.step_path(step)
    log(
        f"attempt {attempt_number()}: resumed from {path} (step {step}): "
        f"{describe_size(folder_size(path))} read in {time.perf_counter() - t0:.1f} s"
    )
    return step


def _initial_load(job_cfg, state) -> int | None:
    """checkpoint.initial_load_path: start from a torchtpu checkpoint's weights (or whole state); returns
    the step a whole state holds, None for weights."""
    from .manager import CheckpointManager, is_model_only, load_model_weights, split_step_path

    cfg = job_cfg.checkpoint
    where = f"[checkpoint] initial_load_path = {cfg.initial_load_path!r}"
    if cfg.initial_load_in_hf:
        from .hf import HFCheckpointError, load_hf_into_model

        try:
            load_hf_into_model(cfg.initial_load_path, state.model, state.model_args)
        except HFCheckpointError as e:
            raise ConfigError(f"{where} (initial_load_in_hf): {e}") from None
        log(f"initial weights from the Hugging Face folder {cfg.initial_load_path}")
        return None
    folder, step = split_step_path(cfg.initial_load_path)
    src = CheckpointManager(folder, interval=1, async_mode="sync", read_only=True)
    try:
        if step is None:
            step = src.latest_step()
            if step is None:
                raise ConfigError(
                    f"{where}: no checkpoint (step_N folder) in it; point it at a torchtpu-train "
                    "checkpoint folder or one of its step_N folders"
                )
        tree = src.manifest(step)
        if cfg.initial_load_model_only:
            load_model_weights(src, step, state.model)
            log(f"initial weights from {src.step_path(step)}")
            return None
        if is_model_only(tree):
            raise ConfigError(
                f"{where}: {src.step_path(step)} holds only model weights; set "
                "checkpoint.initial_load_model_only = true to start from them"
            )
        restored = state.restore(src, step, cfg.exclude_from_loading)
        log(f"initial state (weights, optimizer, schedule, data position) from {src.step_path(step)} (step {restored})")
        return restored
    finally:
        src.close()
