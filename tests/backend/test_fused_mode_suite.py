"""Backend test files run again with TORCHTPU_EAGER_MODE=fused: every test passes when the ops are
recorded and run as fused programs, and the run shows that they were (ops recorded, programs run).

Two groups, each one inner pytest session: the files that hold PyTorch's semantics (views and
in-place ops, autograd, factories, RNG streams), and the ones that run code nobody here wrote
(transformers' model families and their KV-cache generation, PyTorch's tutorial loops and modules,
autocast, gradient checkpointing with dropout, torch.distributions). Their compiled variants are left
out: under torchtpu.compile or torch.compile the eager mode does not apply."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# group: (files, -k expression, floor on ops recorded, floor on programs run). The floors sit well
# under what a run measures (comments) and far above strict mode's 0.
GROUPS = {
    "semantics": (
        ["test_views.py", "test_autograd.py", "test_factory.py", "test_random.py"],
        None,
        400,
        50,
    ),  # measured: 900 ops recorded into 120 programs
    "foreign_code": (
        [
            "test_hf_models.py",
            "test_training.py",
            "test_modules.py",
            "test_autocast.py",
            "test_checkpoint_rng.py",
            "test_activation_checkpoint.py",
            "test_sequence_and_distribution_ops.py",
        ],
        "not compile",  # measured: 16,674 ops recorded into 338 programs
        8000,
        150,
    ),
}

# A plugin for the inner session: what fused mode did over all its tests, counted per test (a test
# may reset the counters), printed at the end.
PLUGIN = """
import pytest

import torchtpu

TOTAL = {"fused_ops_recorded": 0, "fused_programs": 0}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = torchtpu.cache_stats()
    try:
        return (yield)
    finally:
        after = torchtpu.cache_stats()
        for k in TOTAL:
            TOTAL[k] += after[k] - before[k] if after[k] >= before[k] else after[k]


def pytest_unconfigure(config):
    print(f"\\nFUSED recorded={TOTAL['fused_ops_recorded']} programs={TOTAL['fused_programs']}")
"""


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_backend_files_pass_in_fused_mode(group, tmp_path):
    files, select, min_recorded, min_programs = GROUPS[group]
    (tmp_path / "fused_report.py").write_text(PLUGIN)
    env = dict(
        os.environ,
        TORCHTPU_EAGER_MODE="fused",
        PYTHONPATH=os.pathsep.join(filter(None, [REPO, str(tmp_path), os.environ.get("PYTHONPATH")])),
    )
    paths = [os.path.join(REPO, "tests", "backend", f) for f in files]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "fused_report", *paths]
    if select:
        cmd += ["-k", select]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert not re.search(r"\d+ (failed|error)", out), out[-4000:]
    m = re.search(r"FUSED recorded=(\d+) programs=(\d+)", out)
    assert m, out[-4000:]
    recorded, programs = int(m.group(1)), int(m.group(2))
    assert recorded > min_recorded and programs > min_programs, (recorded, programs)
