"""training.mixed_precision_param applies with and without FSDP: the linear layers' matmuls of the compiled
training step (forward and backward) run in bf16 for a tensor-parallel-only job and for a single-device job
(and in fp32 when it is float32). Attention's two matmuls run in f32 either way: torchtpu's SDPA lowering
computes them in f32, like PyTorch's CPU flash attention.

The evidence is the program itself: the compiled step's StableHLO (CompiledFunction.as_text(optimized=False),
what torchtpu hands to XLA; XLA's CPU backend later widens bf16 dots it cannot run natively, a TPU does not).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import torchtpu  # noqa: F401
from torchtpu.train.config.manager import load_config

from ..processes import cpu_flags
from .debug_run import REPO, debug_argv

_DOT = re.compile(r"stablehlo\.dot_general[^\n]*?:\s*\(tensor<([^>]*)>,\s*tensor<([^>]*)>\)")


def dot_operand_types(hlo: str) -> dict[str, int]:
    """How many dot_general ops the program has, by their operands' element types ("bf16,bf16": 40)."""
    counts: dict[str, int] = {}
    for a, b in _DOT.findall(hlo):
        key = f"{a.rsplit('x', 1)[-1]},{b.rsplit('x', 1)[-1]}"
        counts[key] = counts.get(key, 0) + 1
    return counts


# the jobs train a 2-block copy of the debug model: every block is the same code, so 2 show what 6 would
N_LAYERS = 2
# forward, input-gradient and weight-gradient matmuls of every linear layer (N_LAYERS blocks x 7, and the output)
LINEAR_DOTS = 3 * (N_LAYERS * 7 + 1)
# attention scores and values, forward and backward: torchtpu's SDPA lowering (backend/ops/nn.py) computes
# them in float32 whatever the input dtype, as PyTorch's CPU flash attention accumulates
ATTENTION_DOTS = 7 * N_LAYERS


def assert_bf16_matmuls(dots):
    assert set(dots) <= {"bf16,bf16", "f32,f32"}, dots
    assert dots.get("bf16,bf16", 0) == LINEAR_DOTS and dots.get("f32,f32", 0) <= ATTENTION_DOTS, dots


def argv(dump, *extra):
    return debug_argv(dump, 2, "--validation.no-enable", "--training.mixed_precision_param", "bfloat16", *extra)


def compiled_step_dots(cfg):
    from torchtpu.train.trainer import Trainer

    t = Trainer(cfg, n_layers=N_LAYERS)
    t.train()  # every step runs the one compiled program
    assert t.step_fn.stats.traces == 1
    return dot_operand_types(t.step_fn.as_text(optimized=False)), t


# the trainer sets the process's current device mesh
pytestmark = pytest.mark.usefixtures("keep_current_mesh")


def test_tensor_parallel_only_job_computes_in_bf16(tmp_path):
    cfg = load_config(argv(tmp_path, "--parallelism.tensor_parallel_degree", "8"))
    dots, t = compiled_step_dots(cfg)
    assert not t.dims.fsdp_enabled and t.dims.tp == 8
    assert_bf16_matmuls(dots)
    # the parameters (the master copy) stay fp32
    assert {str(p.dtype) for p in t.model.parameters()} == {"torch.float32"}


PRECISIONS = ["bfloat16", "float32"]

SINGLE_DEVICE = """
import json, sys
from torchtpu.train.config.manager import load_config
from tests.train.test_mixed_precision import compiled_step_dots
for args in json.loads(sys.argv[1]):
    dots, t = compiled_step_dots(load_config(args))
    print("RESULT", json.dumps({"dots": dots, "devices": len(t.devices), "fsdp": t.dims.fsdp_enabled}), flush=True)
    del t
"""


@pytest.fixture(scope="module")
def single_device_jobs(tmp_path_factory):
    """A real one-device process (XLA given one CPU device) running the job once per precision, one
    after the other: {precision: its result}."""
    tmp = tmp_path_factory.mktemp("single_device")
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags(1))
    jobs = [argv(tmp / p, "--training.mixed_precision_param", p, "--tpu.xla_flags", "") for p in PRECISIONS]
    p = subprocess.run(
        [sys.executable, "-c", SINGLE_DEVICE, json.dumps(jobs)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == len(PRECISIONS), p.stdout[-3000:]
    return {prec: json.loads(ln.removeprefix("RESULT ")) for prec, ln in zip(PRECISIONS, lines)}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_single_device_job(single_device_jobs, precision):
    """A real one-device job (its own process, XLA given one CPU device)."""
    result = single_device_jobs[precision]
    assert result["devices"] == 1 and not result["fsdp"]
    if precision == "bfloat16":
        assert_bf16_matmuls(result["dots"])
    else:  # the same program in float32: every matmul is
        assert set(result["dots"]) == {"f32,f32"} and result["dots"]["f32,f32"] >= LINEAR_DOTS, result
