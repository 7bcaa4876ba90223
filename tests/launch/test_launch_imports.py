"""The torchtpu-launch processes (the launcher, a host's agent) only start and watch processes: they
import neither JAX nor the backend (torchtpu/__init__.py tells them by their command line). A job
of N hosts starts N + 1 of them, and each would otherwise spend about 2 CPU seconds starting JAX."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from torchtpu._platform import launch_process

REPO = pathlib.Path(__file__).resolve().parents[2]


def _imported(*argv: str) -> set[str]:
    """The modules `python ARGV` imports (from -X importtime's report)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {ln.rsplit("|", 1)[1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}


def test_launcher_and_agent_import_neither_torch_nor_jax():
    launcher = _imported(
        *"-m torchtpu.launch local --num-hosts 2 --devices-per-host 4 --dry-run --".split(),
        *"torchtpu-train --config train_configs/debug_model.toml".split(),
    )
    agent = _imported("-m", "torchtpu.launch.agent", "--help")
    # the reports hold what the processes read: the launcher the training configuration, the agent the exit codes
    assert {"torchtpu.launch.local", "torchtpu.train.config.manager"} <= launcher
    assert "torchtpu.train.fault" in agent
    for name, modules in (("launcher", launcher), ("agent", agent)):
        heavy = sorted(m for m in modules if m.split(".")[0] in ("jax", "torch") or m.startswith("torchtpu.backend"))
        assert not heavy, f"the {name} imports {heavy[:5]}"


@pytest.mark.parametrize(
    "argv, launches",
    [
        (["python", "-m", "torchtpu.launch", "local"], True),
        (["python", "-m", "torchtpu.launch.agent", "--nnodes", "2"], True),
        (["python", "-X", "importtime", "-W", "ignore", "-m", "torchtpu.launch"], True),
        (["python", "-um", "torchtpu.launch"], True),
        (["python", "-mtorchtpu.launch.agent"], True),
        (["/venv/bin/python", "/venv/bin/torchtpu-launch", "local"], True),
        (["python", "-m", "torchtpu.train", "--config", "x.toml"], False),
        (["/venv/bin/python", "/venv/bin/torchtpu-train", "--config", "x.toml"], False),
        (["python", "-m", "torchtpu.launcher"], False),
        (["python", "-c", "import torchtpu.launch.local"], False),
        (["python", "train.py", "-m", "torchtpu.launch"], False),
        (["python", "-m", "pytest", "-m", "torchtpu.launch"], False),
        (["python"], False),
    ],
)
def test_launch_process_is_told_by_the_command_line(argv, launches):
    assert launch_process(argv) is launches


def test_agent_refuses_a_host_index_that_is_not_a_number_in_one_line():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtpu.launch.agent",
            "--nnodes",
            "2",
            "--host-index",
            "x",
            "--rdzv-endpoint",
            "127.0.0.1:1",
            "--run-id",
            "r",
            "--",
            "true",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "torchtpu-launch agent: --host-index 'x' is not a host number; pass --host-index N (0, 1, ...) or auto"
    ], proc.stderr[-2000:]
