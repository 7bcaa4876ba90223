"""The step watchdog: a stuck step ends the process with 42, a step that builds a program does not."""

import subprocess
import sys

import pytest

PROGRAM = """
import sys, time
from torchtpu.backend.compile import BUILDS
from torchtpu.train.fault import StepWatchdog

dog = StepWatchdog(first_step_seconds=30, step_seconds=1)
dog.step_done()                      # the first step is over: 1 s per step from here
if sys.argv[1] == "build":
    with BUILDS.building():          # a step that traces and compiles its program
        time.sleep(3)
    dog.step_done()
    time.sleep(0.5)                  # the next step is quick again
    dog.step_done()
else:
    time.sleep(3)                    # a step that is just stuck
print("finished", flush=True)
"""


@pytest.mark.parametrize("mode, code", [("build", 0), ("stuck", 42)])
def test_watchdog_holds_building_steps_to_the_first_step_limit(mode, code):
    r = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == code, r.stderr[-3000:]
    if code == 42:
        assert "step watchdog: no training step finished" in r.stderr
        assert "[comm] train_timeout_seconds" in r.stderr
    else:
        assert "finished" in r.stdout
