"""Learning-rate schedule: linear warmup, a flat stretch, then decay to a floor (torchtitan 0.2.2's
warmup-stable-decay semantics, reimplemented).

With `total = training_steps`, `warmup = min(warmup_steps, total)`,
`decay = round(total * decay_ratio)` (or `total - warmup` when decay_ratio is None; capped at
`total - warmup`) and one extra virtual step so the last real step never reaches zero learning rate,
the multiplier for 0-indexed scheduler step s is:

    s < warmup                      (s + 1) / warmup
    s < total + 1 - decay           1
    otherwise                       p = (s + 1 - (total + 1 - decay)) / decay
                                    f = 1 - p (linear) | 1 - sqrt(p) (sqrt) | (1 + cos(pi p)) / 2 (cosine)
                                    min_lr_factor + (1 - min_lr_factor) * f

LambdaLR applies it to each param group's initial lr; when that lr is a tensor (optimizers built with
capturable=True and lr=torch.tensor(...)) LambdaLR writes it in place with fill_, so a compiled step
that reads the tensor sees the new value without recompiling.
"""

from __future__ import annotations

import functools
import math
import warnings

from torch.optim.lr_scheduler import LambdaLR

from .config.job_config import JobConfig

DECAY_TYPES = ("linear", "sqrt", "cosine")


def schedule_phases(warmup_steps: int, decay_ratio: float | None, training_steps: int) -> tuple[int, int, int]:
    """(warmup, stable, decay) step counts; stable includes the virtual extra step."""
    total = int(training_steps)
    warmup = int(warmup_steps)
    if warmup > total:
        warnings.warn(
            f"lr warmup_steps ({warmup}) is more than the {total} training steps; using {total}", stacklevel=2
        )
        warmup = total
    if decay_ratio is None:
        decay = total - warmup
    else:
        decay = round(total * decay_ratio)
        if warmup + decay > total:
            warnings.warn(
                f"lr warmup ({warmup}) + decay ({decay}) steps exceed the {total} training steps; "
                f"decaying over {total - warmup}",
                stacklevel=2,
            )
            decay = total - warmup
    stable = total + 1 - warmup - decay
    return warmup, stable, decay


def lr_multiplier(
    step: int,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
    training_steps: int,
) -> float:
    """The factor multiplying the base learning rate at 0-indexed scheduler step `step`."""
    warmup, stable, decay = schedule_phases(warmup_steps, decay_ratio, training_steps)
    return _multiplier(step, warmup, stable, decay, decay_type, min_lr_factor)


def _multiplier(step: int, warmup: int, stable: int, decay: int, decay_type: str, min_lr_factor: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    decay_start = warmup + stable
    if step < decay_start:
        return 1.0
    if decay <= 0:
        return 1.0  # past a schedule with no decay phase: stay at the peak
    progress = min((step + 1 - decay_start) / decay, 1.0)  # past the end: stay at the floor
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr decay_type {decay_type!r}; use one of {', '.join(DECAY_TYPES)}")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(
    optimizer,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
    training_steps: int,
) -> LambdaLR:
    """A LambdaLR over `optimizer` following `lr_multiplier`. Call `.step()` once per train step."""
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"unknown lr decay_type {decay_type!r}; use one of {', '.join(DECAY_TYPES)}")
    if not 0.0 <= min_lr_factor <= 1.0:
        raise ValueError(f"min_lr_factor must be in [0, 1], got {min_lr_factor}")
    if decay_ratio is not None and not 0.0 <= decay_ratio <= 1.0:
        raise ValueError(f"decay_ratio must be in [0, 1] or None, got {decay_ratio}")
    warmup, stable, decay = schedule_phases(warmup_steps, decay_ratio, training_steps)
    fn = functools.partial(
        _multiplier, warmup=warmup, stable=stable, decay=decay, decay_type=decay_type, min_lr_factor=min_lr_factor
    )
    return LambdaLR(optimizer, fn)


def build_schedule(optimizer, cfg: JobConfig):
    """The LambdaLR of [lr_scheduler] over lr_scheduler.total_steps (unset: training.steps)."""
    ls = cfg.lr_scheduler
    return build_lr_scheduler(
        optimizer,
        ls.warmup_steps,
        ls.decay_ratio,
        ls.decay_type,
        ls.min_lr_factor,
        ls.total_steps or cfg.training.steps,
    )
