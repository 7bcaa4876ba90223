"""Where the trainer's compiled step does its work: every chip computes on its own tokens.

With one sequence per data-parallel rank under tensor parallelism, XLA's partitioner used to keep
FSDP's weights split and instead all-gather the activations of the whole global batch over the
data-parallel axis for the row-parallel matmuls (attention `wo`, feed-forward `w2`): every chip
multiplied all the tokens of the step, then all-reduced and sliced out its own rows (8x the work
at 70B on v5p:4x4x4, and 2 GiB buffers). FSDP now asks for the gathered parameter explicitly
(torchtpu/distributed/fsdp.py, `_gathered`), so the all-gather is of the weight, as FSDP's is.
"""

from __future__ import annotations

import re

import pytest

from tests.processes import DEFAULT_CPU_PIPELINE
from torchtpu.backend.aot import compiler_options
from torchtpu.train.config.manager import load_config
from torchtpu.train.dry_run.estimate import compile_step, unrolled
from torchtpu.train.trainer import Trainer

from .debug_run import DEBUG_TOML

pytestmark = pytest.mark.usefixtures("keep_current_mesh")

_DOT = re.compile(r"= (\w+)\[([0-9,]*)\]\{[0-9,]*\} dot\(([^)]*)\)")
_DEF = re.compile(r"%([\w.\-]+) = (\w+)\[([0-9,]*)\]")


def _dot_dims(hlo: str) -> list[tuple[int, ...]]:
    """The dims of every dot's result and operands in the partitioned (per-chip) program."""
    shapes = {m.group(1): tuple(int(d) for d in m.group(3).split(",") if d) for m in _DEF.finditer(hlo)}
    out = []
    for m in _DOT.finditer(hlo):
        out.append(tuple(int(d) for d in m.group(2).split(",") if d))
        for operand in m.group(3).split(","):
            out.append(shapes.get(operand.strip().lstrip("%"), ()))
    return out


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_one_sequence_per_rank_under_tp_computes_only_its_own_tokens(scan):
    seq, dp, tp = 80, 4, 2
    cfg = load_config(
        [
            "--config", DEBUG_TOML,
            "--parallelism.tensor_parallel_degree", str(tp),
            "--training.local_batch_size", "1",
            "--training.seq_len", str(seq),
            "--activation_checkpoint.mode", "full",
        ]
    )  # fmt: skip
    trainer = Trainer(cfg if scan else unrolled(cfg), n_layers=2)
    assert trainer.dims.dp == dp and trainer.dims.tp == tp
    with compiler_options(DEFAULT_CPU_PIPELINE):  # a while loop here is the scan's
        hlo = compile_step(trainer.built_step()).as_text()
    assert (" while(" in hlo) == scan
    dims = _dot_dims(hlo)
    assert any(seq in d for d in dims), "no dot over the chip's own tokens: the parser found no dots"
    global_tokens = dp * seq
    over_batch = [d for d in dims if global_tokens in d]
    assert not over_batch, f"dots over the whole global batch ({global_tokens} tokens) on one chip: {over_batch}"
