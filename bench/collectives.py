"""all_reduce and all_gather bus bandwidth: torch.distributed's "tpu" backend against gloo on the
same processes, float32 tensors of 1 MiB to 256 MiB, side by side.

    python -m bench.collectives --procs 2                 # starts 2 local processes, 1 XLA CPU device each
    python -m bench.collectives --procs 2 --max-mib 64    # a shorter run
    python -m bench.collectives --procs 2 --dims 2        # 2-d tensors (rows of 256 floats)

Bus bandwidth follows nccl-tests: all_reduce moves 2(n-1)/n of the tensor per rank, all_gather
(n-1)/n of the gathered output. Each figure is the median of --steps timed calls after a warm-up
call; a tpu call counts until its result is computed (Work.wait() and block_until_ready). The
"XLA alone" column calls the backend's compiled XLA program directly on the same data (no store
meeting, no torch dispatch, no write-back): the difference from the tpu column is what the
process-group layer costs, the rest is XLA:CPU's own cross-process collective."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def _rank_main(sizes_mib: list[int], steps: int, dims: int) -> None:
    import statistics

    import torch
    import torch.distributed as dist

    import torchtpu  # noqa: F401

    dist.init_process_group("tpu")
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    rows = []
    for mib in sizes_mib:
        numel = mib * 2**20 // 4
        for op in ("all_reduce", "all_gather"):
            figures = {}
            for backend in ("tpu", "xla", "gloo"):
                device, group = ("cpu", gloo) if backend == "gloo" else ("tpu", None)
                if op == "all_reduce":
                    x = torch.ones(_shape(numel, dims), device=device)
                    out = None
                else:
                    x = torch.ones(_shape(numel // n, dims), device=device)
                    out = torch.empty(_shape(numel // n * n, dims), device=device)
                call = _call(op, x, out, group) if backend != "xla" else _bare_program(op, x)
                _sync(call())
                times = []
                for _ in range(steps):
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    _sync(call())
                    times.append(time.perf_counter() - t0)
                seconds = statistics.median(times)
                factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
                figures[backend] = numel * 4 * factor / seconds / 1e9
                del x, out
            rows.append((op, mib, figures["tpu"], figures["xla"], figures["gloo"]))
    if rank == 0:
        print(f"{'op':<11} {'MiB':>5} {'tpu GB/s':>9} {'XLA alone':>10} {'gloo GB/s':>10} {'tpu/gloo':>9}")
        for op, mib, tpu, xla, gl in rows:
            print(f"{op:<11} {mib:>5} {tpu:>9.3f} {xla:>10.3f} {gl:>10.3f} {tpu / gl:>8.2f}x", flush=True)
    dist.destroy_process_group()


def _shape(numel: int, dims: int) -> tuple:
    return (numel,) if dims == 1 else (numel // 256, 256)


def _call(op, x, out, group):
    import torch.distributed as dist

    def call():
        if op == "all_reduce":
            dist.all_reduce(x, group=group)
            return x
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    return call


def _bare_program(op, x):
    """The backend's own XLA program for `op` on its global array, called directly: no store
    meeting, no torch dispatch, no copy into the tensor (what XLA's collective costs alone)."""
    import torch.distributed as dist

    from torchtpu.distributed import pg_programs as pg

    group = dist.distributed_c10d._get_default_group()
    kind = "all_reduce" if op == "all_reduce" else "all_gather"
    program = pg.collective_program(group._mesh, kind, "sum" if op == "all_reduce" else None)
    glob = pg.global_array(group._mesh, pg.local_array(x, group._device), group.size())

    def call():
        out = program(glob)
        out.block_until_ready()
        return x

    return call


def _sync(t) -> None:
    import torch

    if t.device.type == "tpu":
        torch.tpu.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--min-mib", type=int, default=1)
    p.add_argument("--max-mib", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dims", type=int, choices=(1, 2), default=1, help="tensors of 1 or 2 dims")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes, s = [], a.min_mib
    while s <= a.max_mib:
        sizes.append(s)
        s *= 4
    if a.rank is not None:
        _rank_main(sizes, a.steps, a.dims)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    print(f"{a.procs} processes x 1 XLA CPU device, float32, {a.dims}-d, median of {a.steps}", flush=True)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(a.procs),
    )
    argv = [sys.executable, "-m", "bench.collectives", *sys.argv[1:]]
    procs = [subprocess.Popen(argv + ["--rank", str(r)], env=dict(env, RANK=str(r))) for r in range(a.procs)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
