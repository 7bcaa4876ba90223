"""The session's OpInfo pass-rate check (tests/opinfo/pass_rate.py) under pytest-xdist: a session of
stand-in tests that record results the way the OpInfo tests do, split over 2 workers, fails below the
bar and passes at it; a session that runs part of the tests is not judged on them."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.opinfo.pass_rate import BARS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# plugins the stand-in sessions do not use, left out for a faster start of each of their processes
NO_PLUGINS = ["-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:anyio"]
CONFTEST = "from tests.opinfo.pass_rate import register as pytest_configure  # noqa: F401\n"

# 100 stand-in OpInfos; the first FAILING of them fail as a listed OpInfo does (a strict expected failure)
STAND_INS = """
import os

import pytest

from tests.opinfo.pass_rate import record

FAILING = int(os.environ["FAILING"])


@pytest.mark.parametrize("i", range(100))
def test_op(i, request):
    record(request.node, "forward", f"op{i}", i >= FAILING, 100)
    if i < FAILING:
        pytest.xfail("listed")
"""


def _session(tmp_path, failing, *args):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_stand_ins.py").write_text(STAND_INS)
    env = dict(
        os.environ, FAILING=str(failing), PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", *NO_PLUGINS, "-q", *(args or [str(tmp_path)])],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_session_pass_rate_under_two_workers(tmp_path):
    assert BARS["forward"] == 0.99  # 98 of 100 is below the bar, 99 of 100 meets it
    below = _session(tmp_path, 2, "-n", "2", str(tmp_path))
    assert below.returncode == 1, below.stdout[-3000:]
    assert "98 passed, 2 xfailed" in below.stdout, below.stdout[-3000:]
    assert (
        "FAILED forward: 98/100 OpInfos pass every sample (98.0%; the bar is 99.0%): failing ['op0', 'op1']"
        in below.stdout
    ), below.stdout[-3000:]
    at = _session(tmp_path, 1, "-n", "2", str(tmp_path))
    assert at.returncode == 0, at.stdout[-3000:]
    assert "forward: 99/100 OpInfos pass every sample (99.0%; the bar is 99.0%)" in at.stdout, at.stdout[-3000:]
    part = _session(tmp_path, 3, *(f"test_stand_ins.py::test_op[{i}]" for i in range(3)))
    assert part.returncode == 0, part.stdout[-3000:]
    assert "forward: 3 of 100 OpInfo tests ran; the pass rate is checked when all of them run" in part.stdout
