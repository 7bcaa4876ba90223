"""torchtitan's own trainer in a test: `torchrun ... -m torchtitan.train --job.config_file ...` as its
README launches it, with no wrapper and no added import (torchtpu reaches it through PyTorch's device
autoload), in a working directory laid out as torchtitan's repository is: `tests/assets/c4_test`
(its `c4_test` dataset: JSON lines of {"text": ...}, here made from torchtpu's bundled corpus) and
`tests/assets/tokenizer/tokenizer.json` (torchtpu's bundled tokenizer)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .processes import cpu_flags, free_port

ASSETS = Path(__file__).parent / "assets" / "torchtitan"
BUNDLED = Path(__file__).parent.parent / "torchtpu" / "train" / "assets"
_STEP = re.compile(r"step:\s*(\d+)\s+loss:")
_FIELD = re.compile(r"(\w+):\s*([0-9][0-9.,]*)")


def workdir(root: Path) -> Path:
    """A folder with torchtitan's relative asset paths and the configs of tests/assets/torchtitan."""
    data = root / "tests" / "assets" / "c4_test"
    tok = root / "tests" / "assets" / "tokenizer"
    data.mkdir(parents=True, exist_ok=True)
    tok.mkdir(parents=True, exist_ok=True)
    shutil.copy(BUNDLED / "tokenizer.json", tok / "tokenizer.json")
    paragraphs = [p.strip() for p in (BUNDLED / "corpus.txt").read_text().split("\n\n") if p.strip()]
    with open(data / "data.json", "w") as f:
        for p in paragraphs:
            f.write(json.dumps({"text": p}) + "\n")
    for config in ASSETS.glob("*.toml"):
        shutil.copy(config, root / config.name)
    return root


def run(root: Path, config: str, *overrides: str, nproc: int = 1, timeout: int = 900) -> str:
    """Run torchtitan.train under torchrun in `root` (its own logging, rank 0's lines only); return
    the output with colour codes removed."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags(1))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        "--tee",
        "3",
        "--local-ranks-filter",
        "0",
        "-m",
        "torchtitan.train",
        "--job.config_file",
        config,
        *overrides,
    ]
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    out = re.sub(r"\x1b\[[0-9;]*m", "", p.stdout + p.stderr)
    assert p.returncode == 0, out[-6000:]
    return out


def steps(out: str) -> dict[int, dict]:
    """torchtitan's per-step log lines: {step: {"loss": ..., "tps": ..., ...}}."""
    found = {}
    for line in out.splitlines():
        m = _STEP.search(line)
        if m:
            record = {k: float(v.replace(",", "")) for k, v in _FIELD.findall(line[m.start() :])}
            found[int(m.group(1))] = record
    return found


def train(root: Path, config: str, *overrides: str, nproc: int = 1, timeout: int = 900) -> dict[int, float]:
    """Run torchtitan.train under torchrun in `root`; return rank 0's loss per step."""
    out = run(root, config, *overrides, nproc=nproc, timeout=timeout)
    losses = {s: r["loss"] for s, r in steps(out).items()}
    assert losses, out[-6000:]
    return losses
