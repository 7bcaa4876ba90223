"""The suite's recorded per-test durations (tests/durations.json) and the run order made from them.

`make test` runs `pytest -n 2 --dist loadgroup --no-loadscope-reorder`: pytest-xdist then hands out
its work units (a module-scoped fixture's group, or a single test) in collection order, one at a time
to whichever worker is free. tests/conftest.py sorts the collection longest unit first, by these
recorded seconds, which is the longest-processing-time rule: the two workers end within about one short
test of each other instead of one of them running a multi-minute job alone at the end.

The file holds each test's wall seconds (setup to teardown) from a whole-suite run on an otherwise idle
2-core machine with an empty compilation cache, as CI runs it: how long a test keeps its worker is what
the order needs. SUITE_CPU_TIMES records the CPU seconds too (the worker's and its child processes'),
which say what a test costs whatever else loads the machine: the measure for making the suite cheaper.
A test absent from the file counts the `UNKNOWN` seconds of its directory. Re-record after adding slow
tests:

    XDG_CACHE_HOME=$(mktemp -d) SUITE_CPU_TIMES=/tmp/suite.jsonl python -m pytest -n 2 --dist loadgroup \\
        --no-loadscope-reorder -p no:cacheprovider tests
    python -m tests.durations /tmp/suite.jsonl
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

FILE = Path(__file__).with_name("durations.json")
KEEP = 1.0  # seconds: shorter tests are left out of the file
# seconds counted for a test the file does not name, by its directory under tests/: a new test in the
# process-launching and TPU-compiling directories is likelier to be long than one among the OpInfo tests
UNKNOWN = {"launch": 30.0, "train": 10.0, "distributed": 10.0, "serve": 10.0, "opinfo": 0.5}
UNKNOWN_ELSEWHERE = 2.0


def load(path: Path = FILE) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def base_id(nodeid: str) -> str:
    """A test's id without pytest-xdist's '@group' suffix."""
    return nodeid.split("@", 1)[0]


def guess(test: str) -> float:
    """The seconds counted for a test the file does not name."""
    parts = test.split("/")
    return UNKNOWN.get(parts[1], UNKNOWN_ELSEWHERE) if len(parts) > 2 else UNKNOWN_ELSEWHERE


def run_order(units: list[tuple[str, str]], seconds: dict[str, float]) -> list[int]:
    """`units` is (unit, test id) per collected test in collection order, where a unit is what xdist
    schedules as one (a group's name, or the test's own id). Returns the collection's indices with each
    unit's tests kept together in their order, units by recorded total seconds, longest first."""
    total: dict[str, float] = defaultdict(float)
    first: dict[str, int] = {}
    for i, (unit, test) in enumerate(units):
        total[unit] += seconds[test] if test in seconds else guess(test)
        first.setdefault(unit, i)
    return sorted(range(len(units)), key=lambda i: (-total[units[i][0]], first[units[i][0]], i))


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and of its children that ended."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuTimes:
    """A pytest plugin (on when SUITE_CPU_TIMES names a file): each test's wall seconds and CPU
    seconds (this worker's and its child processes', setup to teardown) appended to that file as a
    JSON line. On 2 busy cores, a test's CPU seconds say what it costs the suite whatever the load;
    its wall seconds do not."""

    def __init__(self, path: str):
        self.path = path

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        cpu, wall = cpu_seconds(), time.monotonic()
        yield
        record = {"test": base_id(item.nodeid), "cpu": round(cpu_seconds() - cpu, 2)}
        record["wall"] = round(time.monotonic() - wall, 2)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def register(config) -> None:
    path = os.environ.get("SUITE_CPU_TIMES")
    if path:
        config.pluginmanager.register(CpuTimes(os.path.abspath(path)), "suite-cpu-times")


def from_records(paths: list[str]) -> dict[str, float]:
    """Per-test wall seconds from SUITE_CPU_TIMES files (the most seen where a test ran more than once)."""
    seconds: dict[str, float] = {}
    for path in paths:
        for line in open(path):
            record = json.loads(line)
            if record["wall"] >= KEEP:
                seconds[record["test"]] = max(record["wall"], seconds.get(record["test"], 0.0))
    return dict(sorted(seconds.items()))


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.durations FILE [...]  (files that SUITE_CPU_TIMES wrote)", file=sys.stderr)
        return 2
    seconds = from_records(argv)
    FILE.write_text(json.dumps(seconds, indent=0, sort_keys=True) + "\n")
    print(f"{FILE}: {len(seconds)} tests of {KEEP:g} s or more, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
