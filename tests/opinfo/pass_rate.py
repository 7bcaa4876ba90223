"""The OpInfo pass-rate check over the whole session, however pytest-xdist splits it between workers.

Each OpInfo test (tests/opinfo/test_opinfo.py) records what its OpInfo did as a user property of its
test report, `("opinfo_result", (direction, opinfo_id, passed, total))`. pytest-xdist sends every
report from the worker that ran the test to the controller, so the process that runs the session
(the controller, or the only process without `-n`) sees all of them in `pytest_runtest_logreport`.
When the test loop has finished, a direction of which every OpInfo test ran is held to its bar: at
least BARS[direction] of its OpInfos pass every sample. Below the bar the session fails (exit status
1) and the terminal summary names the rate, the bar and the failing OpInfos; with `-k` or a part of
the file, the summary says how many ran and the rate is not checked.

tests/conftest.py registers the check (`register`) in the controlling process only. This module imports pytest
alone, so the controller, which collects nothing under xdist, stays light.
"""

from __future__ import annotations

import pytest

# At least this fraction of OpInfos pass every sample: float32 OpInfos forward, autograd ones backward.
BARS = {"forward": 0.99, "backward": 0.98}
PROPERTY = "opinfo_result"


class PassRate:
    """The session's OpInfo results, gathered from the test reports, and the check against BARS."""

    def __init__(self):
        self.results: dict[str, dict[str, bool]] = {d: {} for d in BARS}
        self.totals: dict[str, int] = {}
        self.lines: list[str] = []
        self.failed = False

    def pytest_runtest_logreport(self, report):
        if report.when != "call":
            return
        for name, value in report.user_properties:
            if name == PROPERTY:
                direction, oid, passed, total = value
                self.results[direction][oid] = bool(passed)
                self.totals[direction] = total

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session):
        result = yield
        for direction, bar in BARS.items():
            self._check(direction, bar)
        if self.failed:
            session.testsfailed += 1  # pytest's exit status: tests failed
        return result

    def _check(self, direction, bar):
        results, total = self.results[direction], self.totals.get(direction)
        if total is None:
            return  # no OpInfo test of this direction ran
        if len(results) < total:
            self.lines.append(
                f"{direction}: {len(results)} of {total} OpInfo tests ran; the pass rate is checked when all of them run"
            )
            return
        passed = sum(results.values())
        rate = passed / total
        line = (
            f"{direction}: {passed}/{total} OpInfos pass every sample ({100 * rate:.1f}%; the bar is {100 * bar:.1f}%)"
        )
        if rate < bar:
            self.failed = True
            failing = sorted(k for k, v in results.items() if not v)
            line = f"FAILED {line}: failing {failing}"
        self.lines.append(line)

    def pytest_terminal_summary(self, terminalreporter):
        if not self.lines:
            return
        terminalreporter.section("OpInfo pass rate", red=self.failed, green=not self.failed)
        for line in self.lines:
            terminalreporter.line(line, red=line.startswith("FAILED"))


def register(config) -> None:
    """Register the check in the process that runs the session: the pytest-xdist controller, or the
    only process without `-n` (a worker sees only its own tests)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(PassRate(), "opinfo-pass-rate")


def record(node, direction: str, oid: str, passed: bool, total: int) -> None:
    """Attach one OpInfo test's result to its report (called by the test itself)."""
    node.user_properties.append((PROPERTY, (direction, oid, passed, total)))
