"""A real multi-host job on one machine: 2 processes x 4 XLA CPU devices joined by
jax.distributed over loopback (gloo collectives), against the same training on one device."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401

from ..processes import cpu_flags, free_port, run_together

WORKER = Path(__file__).with_name("multihost_worker.py")
# The debugmodel with 2 of its 6 blocks at dim 64 (of 256), in the job and in its reference: each
# collective of a step is a loopback TCP exchange whose time grows with the number and size of the
# tensors; FSDP across processes is the subject, not the depth or the width.
MODEL = {"n_layers": 2, "dim": 64, "n_heads": 4}


def _one_device_losses():
    from torchtitan.models.llama3 import Transformer, llama3_args

    torch.manual_seed(0)
    m = Transformer(dataclasses.replace(llama3_args["debugmodel"], **MODEL))
    with torch.no_grad():
        m.init_weights()
    m = m.to("tpu")
    opt = torch.optim.AdamW(m.parameters(), lr=8e-4, capturable=True, foreach=True)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        b = torch.randint(0, 2048, (8, 33), generator=g).to("tpu")
        loss = F.cross_entropy(m(b[:, :-1]).flatten(0, 1).float(), b[:, 1:].flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_two_processes_fsdp_matches_one_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags(4))
    port = free_port()
    outs = run_together(
        [[sys.executable, str(WORKER), str(port), str(i), "2", json.dumps(MODEL)] for i in range(2)], env
    )
    losses = []
    for out in outs:
        m = re.search(r"^losses (\[.*\])$", out, re.M)
        assert m, out[-3000:]
        losses.append(eval(m.group(1)))
    assert losses[0] == losses[1]  # every process sees the same global loss
    np.testing.assert_allclose(losses[0], _one_device_losses(), rtol=1e-5)


CACHE_PROGRAM = """
import sys
import numpy as np
import torchtpu
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
jax.distributed.initialize("127.0.0.1:" + sys.argv[1], 2, int(sys.argv[2]))
local = jax.jit(lambda a: a * 3 + 1)(jax.numpy.arange(4.0))
sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
both = jax.make_array_from_process_local_data(sharding, np.full(2, 1.0 + jax.process_index()))
total = jax.jit(lambda a: (a * 2).sum(), out_shardings=NamedSharding(sharding.mesh, P()))(both)
print("values", local.tolist(), float(total))
s = torchtpu.persistent_cache_stats()  # JAX counts a miss when it writes the compiled program
print(f"cache hits {s['hits']} written {s['misses']}")
"""


def test_every_process_of_a_cpu_job_reuses_its_compiled_programs(tmp_path):
    # JAX writes the persistent cache from process 0 only, while on the CPU backend the other
    # processes' keys differ from process 0's: torchtpu lets them write their own, so a second run
    # of the same job (a resume, a restart) loads every program from the cache on every process.
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=cpu_flags(1),
        TORCHTPU_CACHE_DIR=str(tmp_path / "xla"),
    )
    runs = []
    for _ in range(2):
        port = free_port()
        runs.append(run_together([[sys.executable, "-c", CACHE_PROGRAM, str(port), str(i)] for i in range(2)], env))
    for i in range(2):
        first, second = (re.search(r"^cache hits (\d+) written (\d+)$", run[i], re.M) for run in runs)
        assert first and second, runs[0][i][-3000:] + runs[1][i][-3000:]
        assert int(first.group(1)) == 0 and int(first.group(2)) >= 2, (f"process {i}, first run", first.group(0))
        assert int(second.group(2)) == 0 and int(second.group(1)) == int(first.group(2)), (
            f"process {i}, second run",
            second.group(0),
        )
        for run in runs:  # the programs loaded from the cache compute what the compiled ones did
            assert re.search(r"^values \[1\.0, 4\.0, 7\.0, 10\.0\] 12\.0$", run[i], re.M), run[i][-3000:]
