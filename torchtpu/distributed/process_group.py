"""`torch.distributed` on tpu: the c10d process-group backend named "tpu".

    import torch.distributed as dist, torchtpu
    dist.init_process_group("tpu")            # or init_process_group(), or "cpu:gloo,tpu:tpu"
    dist.all_reduce(torch.ones(4, device="tpu"))

Each process is one rank and runs on one local JAX device: the current tpu device when the group
is made (the first, unless set), whatever number of devices it owns. The processes join one
`jax.distributed` job when the default group is made (the coordinator's port is agreed through
the env:// store), and a group's collectives are XLA programs over a one-axis mesh with one device
per member: `jax.shard_map` with psum / all_gather / psum_scatter / all_to_all / ppermute. Point to
point is a program over the two devices of the sender and the receiver.

Before every program the members meet in the group's store and compare what they are about to
run: a member whose peers never come raises a timeout naming the op within the group's timeout,
and members that call different ops raise naming both, instead of an XLA program waiting forever.
One collective program runs at a time in a process (XLA:CPU's cross-process collectives share one
gloo communicator; see docs/DESIGN_NOTES.md). CPU tensors go to a gloo group made beside it.
"""

from __future__ import annotations

import json
import math
import os
from datetime import timedelta

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch._C._distributed_c10d as _c10d
import torch.distributed as dist
from jax.sharding import Mesh

from ..backend import internal_index, torch_device, write
from .pg_programs import (
    AXIS,
    IN_FLIGHT,
    Work,
    collective_program,
    global_array,
    local_array,
    local_flat_array,
    one_at_a_time,
    own_block,
    pair_mesh,
    shaped,
)

__all__ = ["BACKEND_NAME", "TpuProcessGroup"]

BACKEND_NAME = "tpu"
_RO = dist.ReduceOp
_JOIN_TIMEOUT = timedelta(minutes=5)


# ----------------------------------------------------------------------------- the process group


def _reduce_op_name(op) -> str:
    names = {
        _RO.SUM: "sum",
        _RO.AVG: "avg",
        _RO.PRODUCT: "product",
        _RO.MIN: "min",
        _RO.MAX: "max",
        _RO.BAND: "band",
        _RO.BOR: "bor",
        _RO.BXOR: "bxor",
    }
    if isinstance(op, _RO):
        op = op.op if hasattr(op, "op") else op
    for k, v in names.items():
        if op == k:
            return v
    raise ValueError(f"reduce op {op} is not supported by the tpu backend; use one of {sorted(names.values())}")


def _premul(op, tensor):
    """The reduction's name and the input it reduces: PREMUL_SUM (FSDP2's gradient reduce-scatter
    divides by its factor this way) multiplies every rank's input by its factor, then sums."""
    if isinstance(op, _RO) and getattr(op, "op", None) == _RO.PREMUL_SUM:
        return "sum", tensor * op.factor
    return _reduce_op_name(op), tensor


class TpuProcessGroup(dist.ProcessGroup):
    """A c10d process group whose collectives on tpu tensors are XLA programs (see the module doc)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, global_ranks, group_name: str):
        super().__init__(rank, size)
        # A group made again under the same name (init_process_group after destroy_process_group,
        # in one job) meets in the same store: its keys carry the how-manieth instance it is.
        generation = (store.add("instances", 1) - 1) // size
        store = dist.PrefixStore(f"{generation}/", store)
        self._store = store
        self._inner_store = store  # the TCPStore (or other) under the prefixes: its timeout
        while isinstance(self._inner_store, dist.PrefixStore):
            self._inner_store = self._inner_store.underlying_store
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._global_ranks = list(global_ranks) or list(range(size))
        self._group_name = group_name
        self._seq = 0
        self._stale: list[str] = []  # store keys of finished meetings, to delete
        self._p2p_seq: dict[tuple[int, int], int] = {}
        self._pending: list = []  # queued point-to-point ops: (src, dst, tensor)
        if self._global_ranks == list(range(size)) and size > 1:
            _join_jax(store, rank, size, timeout)
        # the rank's device: the current tpu device (torch.accelerator.set_device_index), tpu:0
        self._index = internal_index(torch.accelerator.current_device_index())
        me = jax.local_devices()[self._index]
        store.set(f"device/{rank}", str(me.id))
        keys = [f"device/{r}" for r in range(size)]
        # making a group is not an op: a short timeout for the group's ops is no limit here
        store.wait(keys, max(timeout, _JOIN_TIMEOUT))
        by_id = {d.id: d for d in jax.devices()}
        self._devices = [by_id[int(v)] for v in store.multi_get(keys)]
        self._device = me
        self._mesh = Mesh(np.array(self._devices), (AXIS,))
        self._gloo_group = None

    @property
    def _gloo(self):
        """A gloo group over the same ranks for CPU tensors, made by the first op on CPU tensors
        (which every member calls)."""
        if self._gloo_group is None:
            store = dist.PrefixStore("gloo/", self._store)
            self._gloo_group = dist.ProcessGroupGloo(store, self._rank, self._size, self._timeout)
        return self._gloo_group

    # -- identity
    def size(self):
        return self._size

    def getBackendName(self):
        return BACKEND_NAME

    @property
    def group_name(self):
        return self._group_name

    def __repr__(self):
        return f"TpuProcessGroup(rank={self._rank}, size={self._size})"

    # -- meeting the peers
    def _meet(self, op: str, signature, extra=None) -> list:
        """Wait for every member to reach this op; returns their `extra`s. Raises on a timeout or
        on members that called something else."""
        self._flush_p2p()
        seq = self._seq
        self._seq += 1
        mine = json.dumps([op, signature, extra])
        self._store.set(f"op/{seq}/{self._rank}", mine)
        keys = [f"op/{seq}/{r}" for r in range(self._size)]
        try:
            if self._inner_store.timeout == self._timeout:
                # multi_get waits for the keys itself, under the store's timeout: one round trip
                # to the store less on every op when that is the group's
                values = self._store.multi_get(keys)
            else:
                self._store.wait(keys, self._timeout)
                values = self._store.multi_get(keys)
        except Exception as e:  # the store's own timeout error says nothing about the op
            head = f"torch.distributed {op} on the tpu backend"
            where = f"(group {self._group_name!r}, collective #{seq})"
            try:
                missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            except Exception:  # the store itself is gone: rank 0, which serves it, died
                raise RuntimeError(
                    f"{head} failed {where}: the job's store is unreachable, its host (rank 0) is gone"
                ) from e
            raise RuntimeError(
                f"{head} timed out after {self._timeout.total_seconds():.0f} s {where}: "
                f"ranks {missing} of the group never called it"
            ) from e
        seen = [json.loads(v) for v in values]
        for r, (o, s, _) in enumerate(seen):
            if [o, s] != [op, json.loads(json.dumps(signature))]:
                raise RuntimeError(
                    f"torch.distributed collectives do not match in group {self._group_name!r} (collective #{seq}): "
                    f"rank {self._rank} called {op} {signature}, rank {r} called {o} {s}"
                )
        if seq >= 2:  # deleted once this op's program is on its way (_tidy): one store round trip less before it
            self._stale.append(f"op/{seq - 2}/{self._rank}")
        return [x for _, _, x in seen]

    def _tidy(self):
        while self._stale:
            self._store.delete_key(self._stale.pop())

    def _run(self, kind: str, static, local):
        one_at_a_time()
        out = collective_program(self._mesh, kind, static)(global_array(self._mesh, local, self._size))
        IN_FLIGHT.append(out)
        self._tidy()
        return own_block(out)

    def _cpu(self, tensors) -> bool:
        devs = {t.device.type for t in tensors}
        if devs == {"cpu"}:
            return True
        if devs != {"tpu"}:
            raise ValueError(f"the tpu process group got tensors on {sorted(devs)}; pass tpu tensors (or cpu ones)")
        local = len(jax.local_devices())
        mine = torch_device(self._index).index
        for t in tensors:
            # an index past this process's devices is no other device: PyTorch's C++ (DDP's
            # parameter check) labels tensors it makes with the rank's number
            if t.device.index not in (None, mine) and t.device.index < local:
                raise ValueError(
                    f"the tpu process group runs rank {self._rank} on tpu:{mine} (one device per rank), "
                    f"got a tensor on {t.device}: move it to tpu:{mine}, or use torchtpu's global mesh "
                    "(torchtpu.distributed.init_device_mesh) for several devices per process"
                )
        return False

    # -- collectives
    def allreduce(self, tensors, opts=None):
        if isinstance(opts, dist.ReduceOp) or opts is None:
            opts_op = opts if opts is not None else _RO.SUM
            o = dist.AllreduceOptions()
            o.reduceOp = opts_op
            opts = o
        if self._cpu(tensors):
            return self._gloo.allreduce(tensors, opts)
        outs = []
        for t in tensors:
            op, x = _premul(opts.reduceOp, t)
            if op == "avg" and not t.is_floating_point():
                raise ValueError(f"all_reduce with ReduceOp.AVG needs a floating-point tensor, got {t.dtype}")
            self._meet("all_reduce", [op, list(t.shape), str(t.dtype)])
            out = self._run("all_reduce", op, local_array(x, self._device))
            write(t, shaped(out, t.shape))
            outs.append(out)
        return Work(outs, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        if self._cpu(tensors):
            return self._gloo.broadcast(tensors, opts)
        outs = []
        for t in tensors:
            self._meet("broadcast", [opts.rootRank, list(t.shape), str(t.dtype)])
            out = self._run("broadcast", opts.rootRank, local_array(t, self._device))
            write(t, shaped(out, t.shape))
            outs.append(out)
        return Work(outs, tensors)

    def _gather_flat(self, t, op="all_gather", shape=None):
        """Every member's `t`, concatenated: flat (size * numel,), or in `shape`. The program gives
        a concatenation along dim 0 and a stack along a new dim 0 in their shape as they are."""
        n = self._size
        if shape is not None and tuple(shape) == (n, *t.shape):
            how = "stack"
        elif shape is not None and t.dim() > 0 and tuple(shape) == (n * t.shape[0], *t.shape[1:]):
            how = "dim 0"
        else:
            how = "flat"
        # the members run one program: how they gather is part of what they compare
        self._meet(op, [list(t.shape), str(t.dtype), how])
        out = self._run("all_gather", how == "stack", local_array(t, self._device, flat=how == "flat"))
        return out if shape is None else shaped(out, shape)

    def allgather(self, output_lists, inputs, opts=None):
        if self._cpu(list(inputs) + [o for lst in output_lists for o in lst]):
            return self._gloo.allgather(output_lists, inputs, opts or _c10d.AllgatherOptions())
        outs = []
        for lst, t in zip(output_lists, inputs):
            if len(lst) != self._size:
                raise ValueError(f"all_gather needs {self._size} output tensors (one per rank), got {len(lst)}")
            every = self._gather_flat(t)
            for r, o in enumerate(lst):
                write(o, every[r * t.numel() : (r + 1) * t.numel()].reshape(o.shape).astype(every.dtype))
            outs.append(every)
        return Work(outs, output_lists)

    def _allgather_base(self, output, input, opts=None):
        if self._cpu([output, input]):
            return self._gloo._allgather_base(output, input, opts or _c10d.AllgatherOptions())
        if output.numel() != input.numel() * self._size:
            raise ValueError(
                f"all_gather_into_tensor: output has {output.numel()} elements, needs {self._size} x {input.numel()}"
            )
        every = self._gather_flat(input, "all_gather_into_tensor", tuple(output.shape))
        write(output, every)
        return Work([every], [output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return Work([a for w in works for a in w._arrays], outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        if self._cpu([output, input]):
            return self._gloo._reduce_scatter_base(output, input, opts or dist.ReduceScatterOptions())
        op, x = _premul(opts.reduceOp if opts is not None else _RO.SUM, input)
        if input.numel() != output.numel() * self._size:
            raise ValueError(
                f"reduce_scatter_tensor: input has {input.numel()} elements, needs {self._size} x {output.numel()}"
            )
        self._meet("reduce_scatter_tensor", [op, list(input.shape), str(input.dtype)])
        out = self._run("reduce_scatter", (op, self._size), local_flat_array(x, self._device))
        write(output, out.reshape(output.shape))
        return Work([out], [output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return Work([a for w in works for a in w._arrays], outputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        if self._cpu(list(outputs) + [i for lst in input_lists for i in lst]):
            return self._gloo.reduce_scatter(outputs, input_lists, opts or dist.ReduceScatterOptions())
        outs = []
        for o, lst in zip(outputs, input_lists):
            flat = torch.cat([i.reshape(-1) for i in lst])
            w = self._reduce_scatter_base(o, flat, opts)
            outs += w._arrays
        return Work(outs, outputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if self._cpu([output, input]):
            return self._gloo.alltoall_base(
                output, input, output_split_sizes, input_split_sizes, opts or dist.AllToAllOptions()
            )
        n = self._size
        rows_in = input.shape[0] if input.dim() else 1
        inner = math.prod(input.shape[1:])
        sends = list(input_split_sizes) or [rows_in // n] * n
        receives = list(output_split_sizes) or [(output.shape[0] if output.dim() else 1) // n] * n
        if sum(sends) != rows_in:
            raise ValueError(f"all_to_all_single: input_split_sizes {sends} do not add up to {rows_in} rows")
        every = self._meet("all_to_all_single", [list(input.shape[1:]), str(input.dtype)], [sends, receives])
        table_s = tuple(tuple(e[0]) for e in every)
        table_r = tuple(tuple(e[1]) for e in every)
        for r in range(n):
            for j in range(n):
                if table_s[r][j] != table_r[j][r]:
                    raise ValueError(
                        f"all_to_all_single: rank {r} sends {table_s[r][j]} rows to rank {j}, "
                        f"which expects {table_r[j][r]}"
                    )
        pad = max(1, max(max(row) for row in table_s))
        # every rank's block of the global array has the same size: the longest input, padded
        width = max(max(sum(row) for row in table_s), 1) * inner
        local = local_flat_array(input, self._device)
        if local.shape[0] < width:
            local = jax.device_put(jnp.pad(local, (0, width - local.shape[0])), self._device)
        out = self._run("all_to_all", (inner, table_s, table_r, pad), local)
        write(output, out[: output.numel()].reshape(output.shape))
        return Work([out], [output])

    def alltoall(self, outputs, inputs, opts=None):
        if self._cpu(list(outputs) + list(inputs)):
            return self._gloo.alltoall(outputs, inputs, opts or dist.AllToAllOptions())
        flat_in = torch.cat([t.reshape(-1) for t in inputs])
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=outputs[0].dtype, device=outputs[0].device)
        w = self.alltoall_base(flat_out, flat_in, [t.numel() for t in outputs], [t.numel() for t in inputs], opts)
        start = 0
        for t in outputs:
            t.copy_(flat_out[start : start + t.numel()].reshape(t.shape))
            start += t.numel()
        return Work(w._arrays, outputs)

    def barrier(self, opts=None):
        self._meet("barrier", [])
        self._tidy()
        one_at_a_time()
        return Work()

    # the names torch.distributed's Python functions call (the C++ names above are the ones DDP calls)
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # rooted ops, through the collectives above
    def reduce(self, tensors, opts=None):
        if self._cpu(tensors):
            return self._gloo.reduce(tensors, opts)
        o = dist.AllreduceOptions()
        o.reduceOp = opts.reduceOp
        keep = [t.clone() for t in tensors]
        w = self.allreduce(tensors, o)
        if self._rank != opts.rootRank:
            for t, k in zip(tensors, keep):
                t.copy_(k)
        return w

    def gather(self, output_lists, inputs, opts=None):
        if self._cpu(list(inputs)):
            return self._gloo.gather(output_lists, inputs, opts)
        t = inputs[0]
        every = self._gather_flat(t, "gather")
        if self._rank == opts.rootRank:
            for r, o in enumerate(output_lists[0]):
                write(o, every[r * t.numel() : (r + 1) * t.numel()].reshape(o.shape))
        return Work([every], output_lists)

    def scatter(self, outputs, input_lists, opts=None):
        if self._cpu(list(outputs)):
            return self._gloo.scatter(outputs, input_lists, opts)
        out = outputs[0]
        if self._rank == opts.rootRank:
            flat = torch.cat([i.reshape(-1) for i in input_lists[0]])
        else:
            flat = torch.zeros(out.numel() * self._size, dtype=out.dtype, device=out.device)
        o = dist.BroadcastOptions()
        o.rootRank = opts.rootRank
        w = self.broadcast([flat], o)
        out.copy_(flat[self._rank * out.numel() : (self._rank + 1) * out.numel()].reshape(out.shape))
        return w

    # -- point to point: queued, run in one order on both ends (see _flush_p2p)
    def send(self, tensors, dst: int, tag: int = 0):
        if self._cpu(tensors):
            return self._gloo.send(tensors, dst, tag)
        for t in tensors:
            self._pending.append((self._rank, dst, t))
        return Work(tensors=tensors, before=self._flush_p2p)

    def recv(self, tensors, src: int, tag: int = 0):
        if self._cpu(tensors):
            return self._gloo.recv(tensors, src, tag)
        for t in tensors:
            self._pending.append((src, self._rank, t))
        return Work(tensors=tensors, before=self._flush_p2p)

    def _flush_p2p(self):
        """Run the queued sends and receives. Each is a program over two devices that both ends run;
        both ends run their queues sorted by (sender, receiver), which keeps the order of the
        messages between two ranks and lets no two ranks wait on each other in a cycle."""
        pending, self._pending = self._pending, []
        for src, dst, t in sorted(pending, key=lambda p: (p[0], p[1])):
            self._p2p(src, dst, t)

    def _p2p(self, src: int, dst: int, t):
        n = self._p2p_seq.get((src, dst), 0)
        self._p2p_seq[(src, dst)] = n + 1
        what = "send" if src == self._rank else "recv"
        peer = dst if what == "send" else src
        key = f"p2p/{src}/{dst}/{n}"
        self._store.set(f"{key}/{what}", json.dumps([list(t.shape), str(t.dtype)]))
        other = f"{key}/{'recv' if what == 'send' else 'send'}"
        try:
            self._store.wait([other], self._timeout)
        except Exception as e:
            raise RuntimeError(
                f"torch.distributed {what} on the tpu backend timed out after {self._timeout.total_seconds():.0f} s: "
                f"rank {peer} of group {self._group_name!r} never called the matching "
                f"{'recv' if what == 'send' else 'send'} (message #{n} from rank {src} to rank {dst})"
            ) from e
        theirs = json.loads(self._store.get(other))
        if theirs != [list(t.shape), str(t.dtype)]:
            raise RuntimeError(
                f"torch.distributed send/recv do not match: rank {src} sends {theirs if what == 'recv' else ''}"
                f"{[list(t.shape), str(t.dtype)] if what == 'send' else ''} and rank {dst} receives into "
                f"{[list(t.shape), str(t.dtype)] if what == 'recv' else theirs}"
            )
        mesh = pair_mesh(self._devices[src], self._devices[dst])
        local = local_flat_array(t, self._device)
        if what == "recv":
            local = jnp.zeros_like(local, device=self._device)
        one_at_a_time()
        out = collective_program(mesh, "p2p", None)(global_array(mesh, local, 2))
        IN_FLIGHT.append(out)
        if what == "recv":
            write(t, own_block(out).reshape(t.shape))
        self._store.delete_key(f"{key}/{'recv' if what == 'send' else 'send'}")


# ----------------------------------------------------------------------------- joining the job


def _join_jax(store, rank: int, size: int, timeout: timedelta) -> None:
    """Join this process to the job's jax.distributed (process `rank` of `size`), with the
    coordinator's port chosen by rank 0 and handed to the others through `store`."""
    from jax._src import distributed

    from .mesh import free_port, initialize

    if distributed.global_state.client is not None:
        if jax.process_count() != size or jax.process_index() != rank:
            raise RuntimeError(
                f"this process joined a JAX job as process {jax.process_index()} of {jax.process_count()}, "
                f"but init_process_group made it rank {rank} of {size}"
            )
        return
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if rank == 0:
        store.set("jax_coordinator_port", str(free_port()))
    port = int(store.get("jax_coordinator_port").decode())
    initialize(f"{host}:{port}", size, rank, init_timeout_seconds=int(timeout.total_seconds()))


def _create(opts, _backend_options=None) -> TpuProcessGroup:
    return TpuProcessGroup(
        opts.store, opts.group_rank, opts.group_size, opts.timeout, opts.global_ranks_in_group, opts.group_id
    )


def register() -> None:
    """Make "tpu" a torch.distributed backend, and the default one for tpu tensors."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    from . import ddp, pg_functional, torch_fsdp

    ddp.install()
    pg_functional.install()
    torch_fsdp.install()
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=[BACKEND_NAME])


register()
