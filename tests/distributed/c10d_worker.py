"""One rank of a torch.distributed job on the tpu backend (run by tests/distributed/test_c10d.py with
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set). Every collective runs twice on the same inputs:
on tpu tensors through the "tpu" process group and on CPU tensors through a gloo group, the oracle.
Each check prints "ok <name>"; a mismatch raises. The last line is "checks <n>"."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import torchtpu  # noqa: F401

part = sys.argv[1] if len(sys.argv) > 1 else "all"
INIT = os.environ.get("C10D_INIT")  # e.g. "cpu:gloo,tpu:tpu"
if INIT:
    dist.init_process_group(INIT)
else:
    dist.init_process_group()  # tpu is the default device: the device -> backend map picks "tpu"
rank, world = dist.get_rank(), dist.get_world_size()
DEFAULT = dist.distributed_c10d._get_default_group()
assert type(DEFAULT).__name__ == "TpuProcessGroup", type(DEFAULT)
GLOO = dist.new_group(backend="gloo")
RO = dist.ReduceOp
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
checks = []


def check(name, tpu, cpu):
    tpu = [tpu] if isinstance(tpu, torch.Tensor) else tpu
    cpu = [cpu] if isinstance(cpu, torch.Tensor) else cpu
    assert len(tpu) == len(cpu), (name, len(tpu), len(cpu))
    for a, b in zip(tpu, cpu):
        assert a.device.type == "tpu", (name, a.device)
        a = a.cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f"{name} on rank {rank}:\n tpu {a}\n gloo {b}"
    checks.append(name)


def data(shape, dtype, salt=0):
    """Small integers, different on every rank: sums and products are exact in every dtype, so
    the tpu results must equal gloo's bit for bit whatever the order of the reduction."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randint(-3, 4, shape, generator=g).to(dtype)


def both(x):
    return x.to("tpu"), x.clone()


def contiguous_gloo(collective, view, **kw):
    """The oracle for an in-place collective on a view: gloo on a contiguous copy (gloo itself
    reduces the view's whole memory span, gaps included)."""
    c = view.contiguous()
    collective(c, group=GLOO, **kw)
    return c


def non_contiguous(shape, dtype, salt):
    """A transposed view with a gap: a base of twice the columns, every other column taken, then .t()."""
    base = data((shape[1], 2 * shape[0]), dtype, salt)
    t, c = both(base)
    return (t, t[:, ::2].t()), (c, c[:, ::2].t())


# ----------------------------------------------------------------------------- collectives


def run_collectives():
    for dtype in DTYPES:
        d = str(dtype).split(".")[1]
        ops = [RO.SUM, RO.MAX, RO.MIN, RO.PRODUCT]
        if not dtype.is_floating_point:
            ops += [RO.BAND, RO.BOR, RO.BXOR]
        for op in ops:
            for async_op in (False, True):
                t, c = both(data((3, 5), dtype, 1))
                w = dist.all_reduce(t, op=op, async_op=async_op)
                if async_op:
                    assert w.wait()
                dist.all_reduce(c, op=op, group=GLOO)
                check(f"all_reduce {str(op).split('.')[-1]} {d} async={async_op}", t, c)
        # a view into a base: the result is written through the view, the rest of the base kept
        (tb, tv), (cb, cv) = non_contiguous((4, 3), dtype, 2)
        dist.all_reduce(tv)
        cv.copy_(contiguous_gloo(dist.all_reduce, cv))
        check(f"all_reduce non-contiguous {d}", [tb, tv], [cb, cv])
        if dtype.is_floating_point:  # gloo has no AVG: the oracle is its SUM over world
            t, c = both(data((6,), dtype, 3))
            dist.all_reduce(t, op=RO.AVG)
            dist.all_reduce(c, group=GLOO)
            check(f"all_reduce avg {d}", t, c / world)

        for async_op in (False, True):
            t, c = both(data((2, 3), dtype, 4))
            to = [torch.full((2, 3), 7, dtype=dtype, device="tpu") for _ in range(world)]
            co = [torch.full((2, 3), 7, dtype=dtype) for _ in range(world)]
            w = dist.all_gather(to, t, async_op=async_op)
            if async_op:
                w.wait()
            dist.all_gather(co, c, group=GLOO)
            check(f"all_gather {d} async={async_op}", to, co)

            t, c = both(data((5,), dtype, 5))
            # the stacked output form (gloo only takes the concatenated one)
            to, co = torch.zeros(world, 5, dtype=dtype, device="tpu"), torch.zeros(world * 5, dtype=dtype)
            w = dist.all_gather_into_tensor(to, t, async_op=async_op)
            if async_op:
                w.wait()
            dist.all_gather_into_tensor(co, c, group=GLOO)
            check(f"all_gather_into_tensor {d} async={async_op}", to, co.view(world, 5))

            t, c = both(data((world * 2, 3), dtype, 6))
            to, co = torch.zeros(2, 3, dtype=dtype, device="tpu"), torch.zeros(2, 3, dtype=dtype)
            w = dist.reduce_scatter_tensor(to, t, async_op=async_op)
            if async_op:
                w.wait()
            dist.reduce_scatter_tensor(co, c, group=GLOO)
            check(f"reduce_scatter_tensor {d} async={async_op}", to, co)

            t, c = both(data((4, 2), dtype, 7))
            w = dist.broadcast(t, src=world - 1, async_op=async_op)
            if async_op:
                w.wait()
            dist.broadcast(c, src=world - 1, group=GLOO)
            check(f"broadcast {d} async={async_op}", t, c)

            # all_to_all_single: even, and with split sizes that differ between ranks
            t, c = both(data((world * 2, 3), dtype, 8))
            to, co = torch.zeros_like(t), torch.zeros_like(c)
            w = dist.all_to_all_single(to, t, async_op=async_op)
            if async_op:
                w.wait()
            dist.all_to_all_single(co, c, group=GLOO)
            check(f"all_to_all_single {d} async={async_op}", to, co)
            ins = [(rank + j) % 3 + 1 for j in range(world)]  # rows this rank sends to rank j
            outs = [(j + rank) % 3 + 1 for j in range(world)]  # rows rank j sends here
            t, c = both(data((sum(ins), 2), dtype, 9))
            to = torch.zeros(sum(outs), 2, dtype=dtype, device="tpu")
            co = torch.zeros(sum(outs), 2, dtype=dtype)
            w = dist.all_to_all_single(to, t, outs, ins, async_op=async_op)
            if async_op:
                w.wait()
            dist.all_to_all_single(co, c, outs, ins, group=GLOO)
            check(f"all_to_all_single splits {d} async={async_op}", to, co)

        # non-contiguous inputs and outputs of the other collectives
        (tb, tv), (cb, cv) = non_contiguous((world, 3), dtype, 10)
        to, co = torch.zeros(3, 2 * world, dtype=dtype, device="tpu"), torch.zeros(3, 2 * world, dtype=dtype)
        dist.all_gather_into_tensor(to[:, ::2].t(), tv[0].clone())
        flat = torch.zeros(world * 3, dtype=dtype)
        dist.all_gather_into_tensor(flat, cv[0].clone(), group=GLOO)
        co[:, ::2].t().copy_(flat.view(world, 3))
        check(f"all_gather_into_tensor into a view {d}", to, co)
        dist.broadcast(tv, src=0)
        cv.copy_(contiguous_gloo(dist.broadcast, cv, src=0))
        check(f"broadcast non-contiguous {d}", [tb, tv], [cb, cv])
        to, co = torch.zeros(1, 3, dtype=dtype, device="tpu"), torch.zeros(1, 3, dtype=dtype)
        dist.reduce_scatter_tensor(to, tv)
        dist.reduce_scatter_tensor(co, cv.contiguous(), group=GLOO)  # gloo wants it contiguous
        check(f"reduce_scatter_tensor non-contiguous {d}", to, co)

    # rooted ops
    t, c = both(data((world, 3), torch.float32, 15))
    dist.reduce(t, dst=1, op=RO.MAX)
    dist.reduce(c, dst=1, op=RO.MAX, group=GLOO)
    if rank == 1:
        check("reduce", t, c)
    x, xc = both(data((3,), torch.float32, 16))
    to = [torch.zeros(3, device="tpu") for _ in range(world)] if rank == 0 else None
    co = [torch.zeros(3) for _ in range(world)] if rank == 0 else None
    dist.gather(x, to, dst=0)
    dist.gather(xc, co, dst=0, group=GLOO)
    if rank == 0:
        check("gather", to, co)
    parts = [data((2,), torch.int64, 17 + j) for j in range(world)]
    to, co = torch.zeros(2, dtype=torch.int64, device="tpu"), torch.zeros(2, dtype=torch.int64)
    dist.scatter(to, [p.to("tpu") for p in parts] if rank == 0 else None, src=0)
    dist.scatter(co, parts if rank == 0 else None, src=0, group=GLOO)
    check("scatter", to, co)

    # point to point: a ring with send/recv, and the same exchange as one batch_isend_irecv
    for dtype in DTYPES:
        d = str(dtype).split(".")[1]
        t, c = both(data((3, 2), dtype, 11))
        rt, rc = torch.zeros(3, 2, dtype=dtype, device="tpu"), torch.zeros(3, 2, dtype=dtype)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        for x, r, g in ((t, rt, None), (c, rc, GLOO)):
            if rank % 2 == 0:
                dist.send(x, nxt, group=g)
                dist.recv(r, prv, group=g)
            else:
                dist.recv(r, prv, group=g)
                dist.send(x, nxt, group=g)
        check(f"send/recv ring {d}", rt, rc)
        t, c = both(data((4,), dtype, 12))
        ta, ca = torch.zeros(4, dtype=dtype, device="tpu")[None].expand(2, 4)[0], torch.zeros(4, dtype=dtype)
        tb, cb = torch.zeros(4, dtype=dtype, device="tpu"), torch.zeros(4, dtype=dtype)
        results = []
        for x, a, b, g in ((t, ta, tb, None), (c, ca, cb, GLOO)):
            ops = [
                dist.P2POp(dist.isend, x, nxt, group=g),
                dist.P2POp(dist.isend, x * 2, prv, group=g),
                dist.P2POp(dist.irecv, a, prv, group=g),
                dist.P2POp(dist.irecv, b, nxt, group=g),
            ]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            results.append([a.clone(), b.clone()])
        check(f"batch_isend_irecv both ways {d}", results[0], results[1])

    # a subgroup: every other rank; the ranks outside it run nothing
    members = list(range(0, world, 2)) if world > 2 else [0, 1]
    sub = dist.new_group(members)
    sub_gloo = dist.new_group(members, backend="gloo")
    if rank in members:
        t, c = both(data((5,), torch.float32, 13))
        dist.all_reduce(t, group=sub)
        dist.all_reduce(c, group=sub_gloo)
        check("all_reduce in a subgroup", t, c)
        to = [torch.zeros(5, device="tpu") for _ in members]
        co = [torch.zeros(5) for _ in members]
        dist.all_gather(to, t, group=sub)
        dist.all_gather(co, c, group=sub_gloo)
        check("all_gather in a subgroup", to, co)
        if len(members) == 2:
            peer = members[1 - members.index(rank)]
            x, c = both(data((3,), torch.float32, 14))
            rx, rc = torch.zeros(3, device="tpu"), torch.zeros(3)
            for a, r, g in ((x, rx, sub), (c, rc, sub_gloo)):
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer, g), dist.P2POp(dist.irecv, r, peer, g)])
                for w in reqs:
                    w.wait()
            check("send/recv in a subgroup (global ranks)", rx, rc)
    dist.barrier()
    checks.append("barrier")

    # a CPU tensor given to the default group runs on gloo, a tpu tensor on tpu, in one job
    t, c = both(data((4,), torch.float32, 30))
    cpu = c.clone()
    dist.all_reduce(cpu)
    dist.all_reduce(c, group=GLOO)
    dist.all_reduce(t)
    assert torch.equal(cpu, c) and isinstance(DEFAULT._gloo_group, dist.ProcessGroupGloo), (cpu, c)
    check(f"cpu tensor -> gloo, tpu tensor -> tpu on the default group ({INIT or 'default'})", t, c)


# ----------------------------------------------------------------------------- DDP


def run_ddp():
    """DDP with no_sync and several gradient buckets on tpu against DDP on CPU over gloo."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(6, 6)
            self.b = torch.nn.Linear(6, 3)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(rank)  # different on every rank: DDP broadcasts rank 0's
    base = Branchy()
    results = []
    for device, group in (("tpu", None), ("cpu", GLOO)):
        model = Branchy()
        model.load_state_dict(base.state_dict())
        ddp = DDP(model.to(device), process_group=group, bucket_cap_mb=1e-4)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(50 + rank)
        for _ in range(2):
            with ddp.no_sync():  # gradients accumulate locally
                ddp(torch.randn(4, 6, generator=g).to(device)).square().mean().backward()
            ddp(torch.randn(4, 6, generator=g).to(device)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach().cpu() for p in ddp.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    checks.append("DDP with no_sync, several buckets")

    class SomeSteps(torch.nn.Module):
        """A branch used on odd steps only, and one used on rank 0 only."""

        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(6, 6)
            self.odd = torch.nn.Linear(6, 6)
            self.rank0 = torch.nn.Linear(6, 6)
            self.b = torch.nn.Linear(6, 3)

        def forward(self, x, step):
            h = torch.relu(self.a(x))
            if step % 2:
                h = h + self.odd(h)
            if rank == 0:
                h = h * torch.sigmoid(self.rank0(h))
            return self.b(h)

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {"none": None, "allreduce_hook": default_hooks.allreduce_hook}
    # bf16_compress_hook: DDP accepts it on CUDA and XPU only (gloo on CPU refuses it too)
    hooks["fp16_compress_hook"] = default_hooks.fp16_compress_hook
    hooks["static_graph"] = None  # the same graph every step: a rank-0-only branch, no odd-step one
    base = SomeSteps()
    for hook_name, hook in hooks.items():
        results = []
        static = hook_name == "static_graph"
        for device, group in (("tpu", None), ("cpu", GLOO)):
            model = SomeSteps()
            model.load_state_dict(base.state_dict())
            ddp = DDP(
                model.to(device),
                process_group=group,
                find_unused_parameters=not static,
                static_graph=static,
                bucket_cap_mb=1e-4,
            )
            if hook is not None:
                ddp.register_comm_hook(group if group is not None else DEFAULT, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(60 + rank)
            for step in range(3):
                ddp(torch.randn(4, 6, generator=g).to(device), 0 if static else step).square().mean().backward()
                opt.step()
                opt.zero_grad()
            results.append([p.detach().cpu() for p in ddp.parameters()])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        if static:
            checks.append("DDP static_graph, a branch unused on rank 1")
        else:
            checks.append(f"DDP find_unused_parameters, a branch unused on some steps, comm hook {hook_name}")


# ----------------------------------------------------------------------------- MPMD and failures


def run_mpmd():
    # Rank 0 runs programs of its own between the collectives (other shapes, a matmul, a loop of
    # eager ops); the others go straight to the next collective and wait for it there.
    acc_t, acc_c = both(torch.zeros(4, 4))
    for step in range(3):
        x, xc = both(data((4, 4), torch.float32, 20 + step))
        if rank == 0:
            w = torch.randn(64, 64, device="tpu")
            for _ in range(5):
                w = torch.tanh(w @ w.t() / 64)
            x = x + (w.sum() * 0)  # depends on the extra work, does not change the value
            time.sleep(0.3)
        dist.all_reduce(x)
        dist.all_reduce(xc, group=GLOO)
        acc_t += x
        acc_c += xc
    check("MPMD: rank 0 runs extra programs between collectives", acc_t, acc_c)

    # A collective that only rank 0 calls, in a group with a 5 s timeout: rank 0 raises naming it.
    quick = dist.new_group(timeout=timedelta(seconds=5))
    quick2 = dist.new_group(timeout=timedelta(seconds=3))
    if rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(2, device="tpu"), group=quick)
        except RuntimeError as e:
            took = time.monotonic() - start
            assert "all_reduce" in str(e) and "timed out" in str(e), e
            assert 4 < took < 30, took
            print("timeout message:", e, flush=True)
            checks.append("lone all_reduce times out")
        else:
            raise AssertionError("an all_reduce no peer called returned")
    # ranks that call different collectives: every rank raises, naming both
    mixed = dist.new_group(timeout=timedelta(seconds=10))
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(2, device="tpu"), group=mixed)
        else:
            dist.broadcast(torch.ones(2, device="tpu"), src=0, group=mixed)
    except RuntimeError as e:
        assert "do not match" in str(e) and "all_reduce" in str(e) and "broadcast" in str(e), e
        checks.append("mismatched collectives raise naming both")
    else:
        raise AssertionError("all_reduce against broadcast returned")
    # a recv whose sender never sends
    if rank == 1:
        try:
            dist.recv(torch.zeros(2, device="tpu"), 0, group=quick2)
        except RuntimeError as e:
            assert "recv" in str(e) and "timed out" in str(e), e
            checks.append("lone recv times out")
        else:
            raise AssertionError("a recv with no sender returned")
    dist.barrier()


def run_pg_mesh():
    """PyTorch's own DeviceMesh over the tpu process group: DTensor's collectives (funcol ops
    addressed to the c10d group) run as the group's eager collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import distribute_tensor as dt

    mesh = init_device_mesh("tpu", (world,))
    x = torch.arange(world * 6, dtype=torch.float32).reshape(world * 2, 3)
    d = dt(x.to("tpu"), mesh, [Shard(0)])
    check("torch DeviceMesh over the tpu group: Shard(0) local piece", d.to_local(), x[2 * rank : 2 * rank + 2])
    check("torch DeviceMesh over the tpu group: full_tensor", d.full_tensor(), x)
    check("torch DeviceMesh over the tpu group: sum of a sharded dim", (d * 2).sum(0).full_tensor(), (x * 2).sum(0))
    r = d.redistribute(mesh, [Replicate()]).to_local()
    check("torch DeviceMesh over the tpu group: redistribute to Replicate", r, x)
    run_torch_fsdp2(mesh)


def run_torch_fsdp2(mesh):
    """PyTorch's own FSDP2 on the tpu process-group mesh against the same script on CPU tensors
    over a gloo mesh: losses and final weights equal (5 output rows: padded shards on 2 and 4 ranks)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    results = {}
    for device, m in (("tpu", mesh), ("cpu", DeviceMesh.from_group(GLOO, "cpu"))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5)).to(device)
        for layer in (model[0], model[2], model):
            torch_fully_shard(layer, mesh=m)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for step in range(3):
            x = data((4, 6), torch.float32, 40 + step).to(device) / 3
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        if device == "tpu":  # resharded after backward: the all-gather buffers' arrays are dropped
            param = model[2]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
            assert param.all_gather_outputs[0]._st.array is None
        results[device] = (torch.stack(losses), [p.full_tensor() for p in model.parameters()])
    (lt, wt), (lc, wc) = results["tpu"], results["cpu"]
    assert lt.device.type == "tpu" and wt[0].device.type == "tpu"
    torch.testing.assert_close(lt.cpu(), lc, rtol=1e-6, atol=1e-6)
    for a, b in zip(wt, wc):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-6, atol=1e-6)
    checks.append("torch FSDP2 over the tpu group mesh = FSDP2 over gloo on CPU")


def run_dead_peer():
    """The last rank exits; the others' next collective raises within the timeout, naming it."""
    quick = dist.new_group(timeout=timedelta(seconds=5))
    dist.barrier()
    if rank == world - 1:
        for c in checks:
            print("ok", c)
        print(f"checks {len(checks) + 1}", flush=True)
        print("ok dead peer: this rank exits", flush=True)
        os._exit(0)
    try:
        dist.all_reduce(torch.ones(2, device="tpu"), group=quick)
    except RuntimeError as e:
        assert "all_reduce" in str(e) and f"ranks [{world - 1}]" in str(e), e
        checks.append("a dead peer: the next all_reduce times out naming it")
    else:
        raise AssertionError("an all_reduce with a dead peer returned")


def run_dead_rank_0():
    """Rank 0 (the host of the store and of JAX's coordination service) exits; the others' next
    collective must not wait: the process ends (JAX aborts it) or the op raises."""
    dist.barrier()
    if rank == 0:
        print("rank 0 exits", flush=True)
        os._exit(0)
    time.sleep(0.5)
    try:
        dist.all_reduce(torch.ones(2, device="tpu"))
    except RuntimeError as e:
        print("raised:", e, flush=True)
        os._exit(3)
    print("an all_reduce with rank 0 gone returned", flush=True)
    os._exit(0)


def run_global_mesh():
    """After init_process_group("tpu"), torchtpu's global mesh spans every rank's device: FSDP's
    fully_shard and distribute_tensor over it give the single-device results."""
    import jax
    from torch.distributed.tensor import Shard

    from torchtpu.distributed import distribute_tensor, fully_shard, init_device_mesh

    devices = jax.device_count()  # every device of every rank (a rank may own several)
    mesh = init_device_mesh("tpu", (devices,), mesh_dim_names=("dp_shard",))
    x = torch.arange(devices * 6, dtype=torch.float32).reshape(devices * 2, 3)
    d = distribute_tensor(x, mesh, [Shard(0)])
    check("distribute_tensor over the process-group mesh", (d * 2).sum(0), (x * 2).sum(0))
    torch.manual_seed(0)
    lin = torch.nn.Linear(3 * devices, 4)
    ref = torch.nn.Linear(3 * devices, 4)
    ref.load_state_dict(lin.state_dict())
    fully_shard(lin, mesh=mesh)
    inp = torch.randn(8, 3 * devices, generator=torch.Generator().manual_seed(3))
    lin(distribute_tensor(inp, mesh, [Shard(0)])).square().sum().backward()
    ref(inp).square().sum().backward()
    for p, q in zip(lin.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor().cpu(), q.grad, rtol=1e-5, atol=1e-5)
    checks.append("fully_shard over the process-group mesh = one device")


def check_devices_of_ranks():
    """A rank that owns several local devices (XLA_FLAGS' host device count) runs its collectives
    on its first: the group's mesh holds each rank's first device, in rank order."""
    import jax

    local = jax.local_devices()
    assert DEFAULT._device == local[0], (DEFAULT._device, local)
    firsts = [
        d for d in jax.devices() if d.id == min(e.id for e in jax.devices() if e.process_index == d.process_index)
    ]
    assert list(DEFAULT._mesh.devices) == firsts, (DEFAULT._mesh.devices, firsts)
    checks.append(
        f"a rank with {len(local)} local device{'s' if len(local) > 1 else ''} runs the collectives on its first"
    )


if part in ("all", "collectives"):
    check_devices_of_ranks()
    run_collectives()
if part in ("all", "ddp") and world == 2:
    run_ddp()
if part in ("all", "mpmd"):
    run_mpmd()
if part in ("all", "pipeline"):
    from tests.distributed.c10d_pipeline import run_pipeline

    checks += run_pipeline(rank, world)
if part in ("all", "mesh"):
    run_pg_mesh()
    run_global_mesh()  # late: the global mesh makes every eager op wait for its result
if part == "dead rank 0":
    run_dead_rank_0()
if part in ("all", "dead") and world > 2:
    run_dead_peer()  # last: a rank leaves
for c in checks:
    print("ok", c)
print(f"checks {len(checks)}", flush=True)
dist.destroy_process_group()
os._exit(0)
