"""The pieces the configuration schema (job_config.py) declares its keys with: a key's field (default,
help text, allowed choices, a check of its value) and the checks themselves.

    steps: int = option(10000, "Optimizer steps to train for.", check=positive)

A check takes the value and returns None when it is allowed, else what is allowed instead (the
config manager puts that in its one-line error). Standard library only, like the schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import field
from typing import Any

from .schema import fmt

Check = Callable[[Any], "str | None"]  # returns None if fine, else what is allowed


def option(default: Any, help: str, *, choices: tuple | None = None, check: Check | None = None):
    meta = {"help": help, "choices": choices, "check": check}
    if isinstance(default, list):
        return field(default_factory=lambda d=tuple(default): list(d), metadata=meta)
    return field(default=default, metadata=meta)


def section_field(cls, help: str):
    return field(default_factory=cls, metadata={"help": help, "section": True})


def positive(v):
    return None if v > 0 else "must be > 0"


def non_negative(v):
    return None if v >= 0 else "must be >= 0"


def minus_one_or_positive(v):
    return None if v == -1 or v > 0 else "must be -1 or > 0"


def minus_one_or_non_negative(v):
    return None if v >= -1 else "must be -1 or >= 0"


def fraction(v):
    return None if 0.0 <= v <= 1.0 else "must be between 0 and 1"


def beta(v):
    return None if 0.0 <= v < 1.0 else "must be in [0, 1)"


def only_one(what: str) -> Check:
    def check(v):
        return None if v == 1 else f"allowed: 1 (torchtpu does not support {what} yet)"

    return check


def not_supported(default: Any, why: str) -> Check:
    """Only the default value is allowed: the key exists for torchtitan configs, the feature does not yet."""

    def check(v):
        return None if v == default else f"not supported by torchtpu yet ({why}); leave it at {fmt(default)}"

    return check


def state_parts(v):
    bad = [c for c in v if c not in ("optimizer", "lr_scheduler", "dataloader")]
    return (
        None
        if not bad
        else (
            f"cannot exclude {bad[0]!r}; allowed: optimizer, lr_scheduler, dataloader (the "
            "model weights and the step are always restored)"
        )
    )


def selective_ac_option(v):
    if v == "op" or (v.isdigit() and int(v) > 0):
        return None
    return 'allowed: a positive integer as a string (checkpoint every n-th block, e.g. "2") or "op"'


def json_object(v):
    if v == "":
        return None
    try:
        value = json.loads(v)
    except ValueError as e:
        return f"not valid JSON ({e}); allowed: a JSON object of fields, e.g. '{{\"dim\": 64}}'"
    return None if isinstance(value, dict) else "allowed: a JSON object of fields, e.g. '{\"dim\": 64}'"


_STALL_RE = re.compile(r"^(\d+):(\d+):(\d+(?:\.\d*)?)$")


def stall_spec(v):
    return None if v == "" or _STALL_RE.match(v) else 'allowed: "" (none) or "HOST:STEP:SECONDS", e.g. "1:4:600"'


def model_family(v):
    """A registered model family: the built-in ones or one that `[experimental] custom_import` registered
    (the registry is read when the value is checked, after that import)."""
    from ...models.registry import model_flavors

    names = list(model_flavors())
    if v in names:
        return None
    return f"allowed: {', '.join(names)} (or a family that [experimental] custom_import registers)"


def known_components(v):
    bad = [c for c in v if c not in ("model", "loss")]
    return None if not bad else f"unknown component {bad[0]!r}; allowed: model, loss"
