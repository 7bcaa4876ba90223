"""PyTorch's OpInfo database on tpu, checked against CPU.

Every sample of a float32 OpInfo (up to TORCHTPU_OPINFO_MAX_SAMPLES, default 10: 4,705 samples, 92%
of the 5,124 that 12 gave) runs on tpu and its outputs are compared with CPU's (forward); for an
OpInfo with autograd the same tpu run's
input gradients are compared too (backward), in one test, test_forward_and_backward, which
compiles each forward program once for both checks; test_forward covers the OpInfos without
autograd. OpInfos listed in tests/opinfo/opinfo_known_failures.py are strict expected failures
(per direction), so a fixed op must leave the list; those listed in CRASHES (their failure aborts
the process) run that direction in a subprocess, also as strict expected failures. The bar, at least 99% of OpInfos pass forward and 98% backward, is held twice:
test_pass_rate checks it on the known-failure lists (which the strict xfails keep exact), and
tests/opinfo/pass_rate.py on the results the OpInfo tests had in this session, gathered from their
test reports on whichever pytest-xdist workers ran them.

A sample that raises fails only its own OpInfo; one that hangs is stopped after
TORCHTPU_OPINFO_TIMEOUT seconds (default 600).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.opinfo import opinfo_harness as harness
from tests.opinfo import pass_rate
from tests.opinfo.opinfo_known_failures import BACKWARD, CRASHES, FORWARD

TIMEOUT_S = int(os.environ.get("TORCHTPU_OPINFO_TIMEOUT", "600"))
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ALL = harness.float32_opinfos()
_FORWARD_OPS = _ALL
_BACKWARD_OPS = [o for o in _ALL if o.supports_autograd]
_FORWARD_ONLY_OPS = [o for o in _ALL if not o.supports_autograd]
_DIRECTIONS = ("forward", "backward")
_TOTALS = {"forward": len(_FORWARD_OPS), "backward": len(_BACKWARD_OPS)}


def _params(ops, known, direction):
    params = []
    for o in ops:
        oid = harness.opinfo_id(o)
        marks = [pytest.mark.xfail(strict=True, reason=known[oid])] if oid in known else []
        params.append(pytest.param(o, id=oid, marks=marks))
    return params


def _run_recorded(direction, check, op, node):
    """Run the check (in a subprocess for an OpInfo listed in CRASHES) and record its result on the
    test's report, for the session's pass-rate check (tests/opinfo/pass_rate.py)."""
    oid = harness.opinfo_id(op)
    crash = CRASHES.get(f"{direction}:{oid}")
    passed = False
    try:
        if crash is not None:
            passed = _passes_in_subprocess(direction, oid)
            if passed:
                pytest.fail(
                    f"{direction}:{oid} is listed in CRASHES ({crash}) but now passes: remove it from "
                    "tests/opinfo/opinfo_known_failures.py",
                    pytrace=False,
                )
            pytest.xfail(f"listed in CRASHES: {crash}")
        _run_bounded(check, op)
        passed = True
    finally:
        pass_rate.record(node, direction, oid, passed, _TOTALS[direction])


def _passes_in_subprocess(direction, oid) -> bool:
    """The harness on one OpInfo in a child process: a process abort fails only the child."""
    cmd = [
        sys.executable,
        "-m",
        "tests.opinfo.opinfo_harness",
        *(["--backward"] if direction == "backward" else []),
        oid,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run(
            cmd, cwd=_REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S if TIMEOUT_S > 0 else None
        )
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0 and f"PASS {oid}\n" in proc.stdout


class OpInfoTimeout(BaseException):  # not swallowed by the harness's `except Exception`
    pass


def _run_bounded(check, op):
    """Run `check(op)`; a sample stuck longer than TIMEOUT_S fails this OpInfo only."""
    if TIMEOUT_S <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        return check(op)

    def on_alarm(signum, frame):
        raise OpInfoTimeout(f"{harness.opinfo_id(op)} took more than {TIMEOUT_S}s (TORCHTPU_OPINFO_TIMEOUT)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(TIMEOUT_S)
    try:
        return check(op)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("op", _params(_FORWARD_ONLY_OPS, FORWARD, "forward"))
def test_forward(op, request):
    _run_recorded("forward", harness.check_forward, op, request.node)


@pytest.mark.parametrize("op", [pytest.param(o, id=harness.opinfo_id(o)) for o in _BACKWARD_OPS])
def test_forward_and_backward(op, request):
    """Forward values and input gradients of one autograd OpInfo, each direction held to its own
    known-failure list and recorded for its own pass rate."""
    oid = harness.opinfo_id(op)
    errors = _errors_by_direction(op, oid, request.node)
    known = {d: (FORWARD if d == "forward" else BACKWARD).get(oid) or CRASHES.get(f"{d}:{oid}") for d in _DIRECTIONS}
    fixed = [d for d in _DIRECTIONS if known[d] and errors[d] is None]
    if fixed:
        pytest.fail(
            f"{', '.join(fixed)}:{oid} is listed in tests/opinfo/opinfo_known_failures.py but now passes: "
            "remove it from the list",
            pytrace=False,
        )
    for d in _DIRECTIONS:
        if not known[d] and errors[d] is not None:
            errors[d].add_note(f"({d} check of {oid})")
            raise errors[d]
    if any(known.values()):
        pytest.xfail("; ".join(f"{d}: {known[d]}" for d in _DIRECTIONS if known[d]))


def _errors_by_direction(op, oid, node) -> dict:
    """Each direction's first failing sample's error (None: it passes), recorded on the test's report
    for the session's pass rate. A direction listed in CRASHES runs in a subprocess."""
    apart = {d for d in _DIRECTIONS if f"{d}:{oid}" in CRASHES}
    errors = {d: None if _passes_in_subprocess(d, oid) else RuntimeError(f"{d}:{oid} fails") for d in apart}
    try:
        if not apart:
            try:
                errors.update(_run_bounded(harness.check_both, op))
            except Exception as e:  # outside any one sample: both directions fail with it
                errors.update(forward=e, backward=e)
        for d in set(_DIRECTIONS) - apart - set(errors):
            errors[d] = _error_of(d, op)
    finally:
        for d in _DIRECTIONS:
            pass_rate.record(node, d, oid, d in errors and errors[d] is None, _TOTALS[d])
    return errors


def _error_of(direction, op):
    check = harness.check_forward if direction == "forward" else harness.check_backward
    try:
        _run_bounded(check, op)
    except Exception as e:
        return e
    return None


def test_known_failures_name_real_opinfos():
    fwd_ids = {harness.opinfo_id(o) for o in _FORWARD_OPS}
    bwd_ids = {harness.opinfo_id(o) for o in _BACKWARD_OPS}
    assert not set(FORWARD) - fwd_ids, f"unknown forward OpInfos: {sorted(set(FORWARD) - fwd_ids)}"
    assert not set(BACKWARD) - bwd_ids, f"unknown backward OpInfos: {sorted(set(BACKWARD) - bwd_ids)}"
    for known in (FORWARD, BACKWARD):
        assert all(isinstance(r, str) and r.strip() for r in known.values()), "every known failure needs a reason"
    for key, reason in CRASHES.items():
        direction, _, oid = key.partition(":")
        assert oid in {"forward": fwd_ids, "backward": bwd_ids}.get(direction, ()), f"unknown CRASHES entry {key}"
        assert (FORWARD if direction == "forward" else BACKWARD).get(oid) is None, f"{key} is listed twice"
        assert isinstance(reason, str) and reason.strip(), "every crash needs a reason"


@pytest.mark.parametrize(
    "direction,ops,minimum",
    [
        ("forward", _FORWARD_OPS, 600),
        ("backward", _BACKWARD_OPS, 450),
    ],
)
def test_pass_rate(direction, ops, minimum):
    """The fraction of OpInfos not listed as failing, against the bar.

    Each OpInfo listed in opinfo_known_failures.py (FORWARD/BACKWARD, CRASHES) is a strict expected
    failure and each other one must pass its own test, so when this file's tests pass, the OpInfos
    that pass are exactly the unlisted ones: the rate follows from the lists, and this test checks it
    in any session, even one that runs none of the OpInfo tests. The rate the OpInfo tests actually
    had is checked once the session's tests have all run (tests/opinfo/pass_rate.py)."""
    bar = pass_rate.BARS[direction]
    total = len(ops)
    assert total > minimum, f"only {total} {direction} OpInfos found"
    known = FORWARD if direction == "forward" else BACKWARD
    listed = sorted(
        oid for oid in (harness.opinfo_id(o) for o in ops) if oid in known or f"{direction}:{oid}" in CRASHES
    )
    rate = (total - len(listed)) / total
    print(f"{direction}: {total - len(listed)}/{total} OpInfos are not listed as failing ({100 * rate:.1f}%)")
    assert rate >= bar, (
        f"{len(listed)} of {total} {direction} OpInfos are listed as failing in tests/opinfo/opinfo_known_failures.py, "
        f"a pass rate of {100 * rate:.1f}%; the bar is {100 * bar:.1f}%: {listed}"
    )
