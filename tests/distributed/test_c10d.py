"""torch.distributed on tpu (the "tpu" c10d backend), in real jobs of 2 processes with two XLA CPU
devices each (a rank runs on its first) and of 4 processes with one each, gloo on CPU as the oracle:

- every collective, sync and async, float32 / bfloat16 / int64, views; point to point; subgroups;
  CPU tensors on the default group (and "cpu:gloo,tpu:tpu"); MPMD; a lone collective and a lone
  recv time out naming the op, mismatched collectives raise naming both, a dead peer makes the
  next collective time out; DDP with no_sync, find_unused_parameters and comm hooks; PyTorch's
  DeviceMesh over the group (DTensor; PyTorch's FSDP2 against FSDP2 over gloo on CPU) and
  torchtpu's global mesh (fully_shard, distribute_tensor) after init_process_group (c10d_worker.py, which also runs GPipe and 1F1B pipelines over 2 and 4
  stages against one process: c10d_pipeline.py);
- PyTorch's DDP tutorial under torchtpu-launch local with 2 hosts (ddp_tutorial.py), one rank in
  strict eager mode and one in fused eager mode (the replicas stay equal: fused equals strict);
- a dead rank 0 (the host of the store and of JAX's coordination service) ends its peer's process.

Each launch checks many things: a process launch costs seconds, so there are five."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from ..processes import cpu_flags, free_port, run_together

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
WORKER = HERE / "c10d_worker.py"
CUDA_SCRIPT = HERE / "ddp_cuda_script.py"
TUTORIAL = HERE / "ddp_tutorial.py"


def _env(**extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags(1))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def _workers(n: int, part: str, **extra) -> list[str]:
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n), **extra)
    cmds = [["env", f"RANK={i}", f"LOCAL_RANK={i}", sys.executable, str(WORKER), part] for i in range(n)]
    return run_together(cmds, env, timeout=600)


def _checked(outs: list[str]) -> list[set[str]]:
    done = []
    for out in outs:
        m = re.search(r"^checks (\d+)$", out, re.M)
        assert m, out[-3000:]
        names = set(re.findall(r"^ok (.*)$", out, re.M))
        assert len(names) == int(m.group(1)), out[-3000:]
        done.append(names)
    return done


EVERY_RANK = [
    "all_reduce PRODUCT bfloat16 async=True",
    "all_reduce BXOR int64 async=False",
    "all_reduce MIN float32 async=True",
    "all_reduce non-contiguous int64",
    "all_reduce avg bfloat16",
    "all_gather float32 async=True",
    "all_gather_into_tensor into a view bfloat16",
    "reduce_scatter_tensor non-contiguous float32",
    "broadcast int64 async=True",
    "all_to_all_single splits bfloat16 async=True",
    "send/recv ring int64",
    "batch_isend_irecv both ways bfloat16",
    "MPMD: rank 0 runs extra programs between collectives",
    "scatter",
    "barrier",
    "distribute_tensor over the process-group mesh",
    "fully_shard over the process-group mesh = one device",
    "mismatched collectives raise naming both",
    "torch DeviceMesh over the tpu group: full_tensor",
    "torch DeviceMesh over the tpu group: sum of a sharded dim",
    "torch DeviceMesh over the tpu group: redistribute to Replicate",
    "torch FSDP2 over the tpu group mesh = FSDP2 over gloo on CPU",
]
DDP = (
    ["DDP with no_sync, several buckets"]
    + [
        f"DDP find_unused_parameters, a branch unused on some steps, comm hook {h}"
        for h in ("none", "allreduce_hook", "fp16_compress_hook")
    ]
    + ["DDP static_graph, a branch unused on rank 1"]
)


def test_every_collective_on_2_processes_ddp_and_pipelines():
    # each rank owns 2 XLA CPU devices and runs on its first
    done = _checked(_workers(2, "all", XLA_FLAGS=cpu_flags(2)))
    for names in done:
        assert "a rank with 2 local devices runs the collectives on its first" in names
        assert set(EVERY_RANK + DDP) <= names, set(EVERY_RANK + DDP) - names
        assert "all_reduce in a subgroup" in names and "send/recv in a subgroup (global ranks)" in names
        assert "cpu tensor -> gloo, tpu tensor -> tpu on the default group (default)" in names
        assert len(names) >= 90
    assert "lone all_reduce times out" in done[0]
    assert "lone recv times out" in done[1]
    assert "gather" in done[0] and "reduce" in done[1]
    assert {f"{s} over 2 stages, 4 micro-batches = one process" for s in ("GPipe", "1F1B")} <= done[1]


def test_every_collective_on_4_processes_pipelines_and_a_dead_peer():
    # the device-backend string: CPU tensors to gloo, tpu tensors to tpu
    done = _checked(_workers(4, "all", C10D_INIT="cpu:gloo,tpu:tpu"))
    for r, names in enumerate(done):
        assert set(EVERY_RANK) <= names, set(EVERY_RANK) - names
        assert "a rank with 1 local device runs the collectives on its first" in names
        assert ("all_reduce in a subgroup" in names) == (r in (0, 2))
        assert "cpu tensor -> gloo, tpu tensor -> tpu on the default group (cpu:gloo,tpu:tpu)" in names
        dead = "a dead peer: the next all_reduce times out naming it"
        assert (dead in names) == (r < 3) and ("dead peer: this rank exits" in names) == (r == 3)
    assert "lone all_reduce times out" in done[0]
    assert "lone recv times out" in done[1]
    assert {f"{s} over 4 stages, 4 micro-batches = one process" for s in ("GPipe", "1F1B")} <= done[3]


def test_a_dead_rank_0_ends_its_peers():
    # rank 0 hosts the store and JAX's coordination service: when it exits, the other rank's next
    # collective neither returns nor waits out the timeout; its process ends
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    cmds = [["env", f"RANK={i}", sys.executable, str(WORKER), "dead rank 0"] for i in range(2)]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0 and "rank 0 exits" in outs[0], outs[0][-3000:]
    assert procs[1].returncode != 0, outs[1][-3000:]
    assert "returned" not in outs[1], outs[1][-3000:]
    assert "JAX distributed service detected fatal errors" in outs[1] or "store is unreachable" in outs[1], outs[1][
        -3000:
    ]


_LINE = r"^(?:\[[^\]]*\]:? ?)?(basic|checkpoint) (tpu|cpu) rank (\d+) "  # after a launcher's prefix


def _tutorial_results(out: str):
    """{(demo, device, rank): (loss, weights)} from the tutorial's printed lines."""
    params = {}
    for demo, device, rank, i, values in re.findall(_LINE + r"param (\d+) (\[.*\])$", out, re.M):
        params.setdefault((demo, device, int(rank)), {})[int(i)] = np.array(eval(values))
    found = {}
    for demo, device, rank, loss in re.findall(_LINE + r"loss (\S+)$", out, re.M):
        key = (demo, device, int(rank))
        assert sorted(params.get(key, {})) == [0, 1, 2, 3], (key, sorted(params.get(key, {})))
        found[key] = (float(loss), np.concatenate([params[key][i] for i in range(4)]))
    return found


def _assert_tutorial_matches(found, world: int):
    assert len(found) == 2 * 2 * world, sorted(found)
    for demo in ("basic", "checkpoint"):
        for r in range(world):
            (lt, wt), (lc, wc) = found[(demo, "tpu", r)], found[(demo, "cpu", r)]
            np.testing.assert_allclose(lt, lc, rtol=0, atol=1e-6, err_msg=f"{demo} rank {r} loss")
            np.testing.assert_allclose(wt, wc, rtol=0, atol=1e-6, err_msg=f"{demo} rank {r} weights")
            # DDP kept the replicas equal
            np.testing.assert_array_equal(wt, found[(demo, "tpu", 0)][1])


def _run(cmd, env, timeout=600, cwd=None) -> str:
    p = subprocess.run(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    assert p.returncode == 0, p.stdout[-4000:]
    return p.stdout


def test_ddp_script_written_for_cuda_under_torchrun_matches_gloo_on_cpu():
    """tests/distributed/ddp_cuda_script.py: `tpu:{LOCAL_RANK}`, `torch.tpu.set_device`, a
    DistributedSampler, `DDP(model, device_ids=[local_rank])`, a checkpoint with a map_location; each rank
    owns one XLA CPU device, whose index is its LOCAL_RANK (the torchrun rule, docs/process-groups.md).
    4 ranks: the 2-rank case adds no path (the collectives' 2-process runs are the test above)."""
    nproc = 4
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--tee", "3"]
    out = _run(torchrun + ["--master-port", str(free_port()), str(CUDA_SCRIPT)], _env())
    lines = re.findall(r"(epoch \d|weights) (tpu|cpu) rank (\d+) (?:loss )?(.+)$", out, re.M)
    found = {(what, dev, int(rank)): np.array(eval(value), ndmin=1) for what, dev, rank, value in lines}
    assert len(found) == 3 * 2 * nproc, sorted(found)
    for what in ("epoch 0", "epoch 1", "weights"):
        for r in range(nproc):
            np.testing.assert_allclose(
                found[(what, "tpu", r)], found[(what, "cpu", r)], rtol=0, atol=1e-5, err_msg=f"{what} rank {r}"
            )
    for r in range(nproc):  # DDP kept the replicas equal; the ranks saw other batches
        np.testing.assert_array_equal(found[("weights", "tpu", r)], found[("weights", "tpu", 0)])
    assert len({float(found[("epoch 1", "tpu", r)][0]) for r in range(nproc)}) > 1


def test_ddp_tutorial_under_torchtpu_launch_with_2_hosts_matches_gloo_on_cpu(tmp_path):
    # 2 hosts (4 DDP ranks: the CUDA script above), rank 1 in fused eager, rank 0 strict
    launch = [sys.executable, "-m", "torchtpu.launch", "local", "--num-hosts", "2", "--devices-per-host", "1"]
    # a plain script's host logs go to ./torchtpu_logs: run it from a scratch folder
    out = _run(launch + ["--", sys.executable, str(TUTORIAL)], _env(DDP_TUTORIAL_FUSED_RANKS="1"), cwd=tmp_path)
    modes = {
        (demo, int(rank)): (mode, int(flushes))
        for demo, rank, mode, flushes in re.findall(
            _LINE.replace("(tpu|cpu)", "tpu") + r"mode (\w+) flushes (\d+)$", out, re.M
        )
    }
    for (demo, rank), (mode, flushes) in modes.items():  # rank 1 recorded its steps, rank 0 ran strictly
        assert (mode, flushes > 0) == (("fused", True) if rank == 1 else ("strict", False)), (
            demo,
            rank,
            mode,
            flushes,
        )
    assert len(modes) == 4, modes
    # equal to gloo on CPU, and the fused rank's replica equals the strict rank's (rank 0's) to the bit
    _assert_tutorial_matches(_tutorial_results(out), 2)
