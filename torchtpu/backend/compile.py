"""Whole-step compilation: `torchtpu.compile(fn)` turns a Python function over tpu tensors
(forward, backward, clipping, optimizer.step()) into one XLA program.

How it works:
1. The first call runs eagerly. It creates lazily built state (optimizer moments, .grad) and
   records every tpu storage the step reads. Those that are still alive afterwards are the
   step's state: parameters, gradients, optimizer state, buffers.
2. The next call traces the function under `jax.jit`. The state storages hold tracers instead
   of arrays, so they become explicit inputs rather than baked-in constants; the positional
   tensor arguments are inputs too. What the function writes to the state, and the storages it
   creates that outlive it (a fresh `.grad`), become outputs. State inputs are donated, so
   parameters and optimizer state are never held twice.
3. Later calls with the same argument shapes run the cached executable: no Python op
   dispatch at all, one XLA launch, and the new arrays are swapped into the storages, so the
   user sees parameters, gradients and optimizer state updated in place.

Random ops inside the step draw from keys derived from the device generator's state, which is
an input of the program, and the generator advances after each call as eager mode would.
"""
from __future__ import annotations

import functools
import gc
import weakref

import jax
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import random as tpu_random
from .dispatch import CONFIG, HOOKS, STATE, _Tracing, array_of, write
from .tensor import Storage, TpuTensor, new_base


class CompileStats:
    def __init__(self):
        self.traces = 0
        self.executions = 0

    def snapshot(self):
        return {"traces": self.traces, "executions": self.executions}


class _Recorder:
    """Collects the storages an eager call reads."""

    def __init__(self):
        self.seen: dict[int, weakref.ref] = {}

    def __call__(self, st, a):
        ref = self.seen.get(id(st))
        if ref is None or ref() is not st:  # ids of dead temporaries get reused
            self.seen[id(st)] = weakref.ref(st)
        return a


class _Capture:
    """State of one trace: which storages are inputs, which were created."""

    def __init__(self, state):
        self.state_ids = {id(st) for st in state}
        self.created: list[weakref.ref] = []
        self.created_ids: set[int] = set()
        self.stray: list[Storage] = []

    def on_create(self, st):
        self.created.append(weakref.ref(st))
        self.created_ids.add(id(st))

    def __call__(self, st, a):
        if (a is not None and not isinstance(a, jax.core.Tracer) and id(st) not in self.state_ids
                and id(st) not in self.created_ids):
            self.stray.append(st)
        return a


class _Entry:
    __slots__ = ("executable", "jitted", "lowered_text", "state", "created", "out_tree", "out_kinds", "n_random", "arg_storages",
                 "state_shardings", "mesh")


class CompiledFunction:
    def __init__(self, fn, donate: bool = True):
        self.fn = fn
        self.donate = donate
        self.state: list[Storage] | None = None
        self.entries: dict = {}
        self.stats = CompileStats()
        functools.update_wrapper(self, fn)

    # -- signature of a call: tensor shapes/dtypes + everything else by value
    @staticmethod
    def _signature(flat):
        sig = []
        for x in flat:
            if isinstance(x, TpuTensor):
                sig.append(("T", tuple(x.shape), x.dtype, x._st.device_index))
            elif isinstance(x, torch.Tensor):
                raise TypeError(
                    f"torchtpu.compile: argument on {x.device}; move it to the tpu device first (.to('tpu'))"
                )
            else:
                sig.append(x)
        return tuple(sig)

    def __call__(self, *args, **kwargs):
        flat, tree = tree_flatten((args, kwargs))
        if self.state is None:
            return self._warmup(args, kwargs, flat)
        key = (tree, self._signature(flat))
        entry = self.entries.get(key)
        if entry is None:
            entry, holder = self._trace(flat, tree)
            self.entries[key] = entry
            return self._run(entry, flat, first_holder=holder)
        return self._run(entry, flat)

    # -- 1. eager warm-up
    def _warmup(self, args, kwargs, flat):
        recorder = _Recorder()
        HOOKS.read = recorder
        # storages created by the call that outlive it (a first .grad) are state too
        prev_create = Storage.on_create
        Storage.on_create = lambda st: recorder(st, None)
        try:
            out = self.fn(*args, **kwargs)
        finally:
            HOOKS.read = None
            Storage.on_create = prev_create
        arg_ids = {id(x._st) for x in flat if isinstance(x, TpuTensor)}
        state = []
        for sid, ref in recorder.seen.items():
            st = ref()
            if st is not None and sid not in arg_ids:
                state.append(st)
        self.state = state
        return out

    # -- 2. trace + compile
    def _trace(self, flat, tree):
        entry = _Entry()
        entry.state_shardings = [None] * len(self.state)
        entry.mesh = None
        state = [st for st in self.state]
        entry.state = state
        tensor_pos = [i for i, x in enumerate(flat) if isinstance(x, TpuTensor)]
        holder = {}

        def step(state_arrays, arg_arrays, key_data):
            self.stats.traces += 1
            capture = _Capture(state)
            saved = [(st.array, st.version) for st in state]
            for st, a in zip(state, state_arrays):
                st.array = a
                st.version += 1
            new_flat = list(flat)
            for i, a in zip(tensor_pos, arg_arrays):
                t = new_base(a, flat[i]._st.device_index, flat[i].dtype)
                t.requires_grad_(flat[i].requires_grad)
                new_flat[i] = t
            targs, tkwargs = tree_unflatten(new_flat, tree)
            created = capture.created
            prev_create = Storage.on_create
            Storage.on_create = capture.on_create
            prev_keys = tpu_random.TRACED
            tpu_random.TRACED = tpu_random.TracedKeys(key_data)
            prev_mt = torch.autograd.is_multithreading_enabled()
            torch._C._set_multithreading_enabled(False)
            HOOKS.read = capture
            try:
                with _Tracing():
                    out = self.fn(*targs, **tkwargs)
                out_flat, out_tree = tree_flatten(out)
                out_arrays = []
                out_kinds = []
                for o in out_flat:
                    if isinstance(o, TpuTensor):
                        out_arrays.append(array_of(o))
                        out_kinds.append(("T", o.dtype, o._st.device_index))
                    else:
                        out_kinds.append(("V", o))
                new_state = [_keep_sharding(st.array, sh) for st, sh in zip(state, entry.state_shardings)]
                del out, targs, tkwargs, new_flat, out_flat
                alive = [r() for r in created]
                alive = [st for st in alive if st is not None and st.array is not None]
            finally:
                HOOKS.read = None
                torch._C._set_multithreading_enabled(prev_mt)
                Storage.on_create = prev_create
                n_random = tpu_random.TRACED.count
                tpu_random.TRACED = prev_keys
                for st, (a, v) in zip(state, saved):
                    st.array, st.version = a, v + 2
            if capture.stray:
                names = ", ".join(f"{tuple(st.shape)} {st.dtype}" for st in capture.stray[:5])
                raise RuntimeError(
                    "torchtpu.compile: the function read tpu tensors it did not read during its first "
                    f"(eager) call: {names}. Their values would be frozen into the program. Pass them as "
                    "arguments, or make the first call take the same path as later calls."
                )
            holder.update(created=alive, out_tree=out_tree, out_kinds=out_kinds, n_random=n_random)
            return out_arrays, new_state, [st.array for st in alive]

        donate = (0,) if self.donate else ()
        entry.executable = None
        entry.jitted = jax.jit(step, donate_argnums=donate)
        entry.arg_storages = tensor_pos
        return entry, holder

    # -- 3. execution (the first one also lowers and compiles)
    def _run(self, entry, flat, first_holder=None):
        state_arrays = _unique_arrays([st.array if st.array is not None else array_of_storage(st) for st in entry.state])
        arg_arrays = [array_of(flat[i]) for i in entry.arg_storages]
        if first_holder is not None:
            # Commit eager-made arrays to their device (or, in a program over a device mesh,
            # replicate them over the mesh): later calls feed the executable's committed
            # outputs back, and a committedness change would compile it again.
            mesh = _program_mesh(state_arrays + arg_arrays)
            state_arrays = [_committed(a, st.device_index, mesh) for a, st in zip(state_arrays, entry.state)]
            # Parameters and optimizer state keep their layout from step to step.
            entry.state_shardings = [a.sharding for a in state_arrays]
            entry.mesh = mesh
        if entry.mesh is not None:
            arg_arrays = [_committed(a, 0, entry.mesh) for a in arg_arrays]
        gen = tpu_random.generator(0)
        key_data = tpu_random.key_data_for_step(gen)
        if entry.executable is None:
            # Ahead-of-time lower + compile, so the executable's memory and cost analyses
            # are available (CompiledFunction.memory_analysis / cost_analysis / as_text).
            lowered = entry.jitted.lower(state_arrays, arg_arrays, key_data)
            entry.executable = lowered.compile()
            entry.lowered_text = lowered.as_text()
            self.last = entry
        out_arrays, new_state, created_arrays = entry.executable(state_arrays, arg_arrays, key_data)
        if entry.mesh is not None and CONFIG.sync_dispatch:
            jax.block_until_ready(new_state)
        self.stats.executions += 1
        if first_holder is not None:
            entry.created = first_holder["created"]
            entry.out_tree = first_holder["out_tree"]
            entry.out_kinds = first_holder["out_kinds"]
            entry.n_random = first_holder["n_random"]
        gen.offset += max(entry.n_random, 0)
        for st, a in zip(entry.state, new_state):
            st.array = a
            st.version += 1
        for st, a in zip(entry.created, created_arrays):
            st.array = a
            st.version += 1
        outs = []
        it = iter(out_arrays)
        for kind in entry.out_kinds:
            if kind[0] == "T":
                outs.append(new_base(next(it), kind[2], kind[1]))
            else:
                outs.append(kind[1])
        return tree_unflatten(outs, entry.out_tree)

    # -- ahead-of-time compilation without running anything
    def compile_for(self, *args, **kwargs):
        """Trace and compile the step for these arguments without running it; returns the
        `jax.stages.Compiled` (memory_analysis, cost_analysis, as_text).

        Arguments and state may be lazy tensors that were never filled (parameters made by
        `torchtpu.distributed.materialize`, inputs made by `torchtpu.distributed.empty`),
        laid out over a mesh of any devices, including a TPU topology's devices on a machine
        without TPUs. If the step never ran, its state (optimizer moments, ...) is discovered
        by an abstract warm-up that runs the function on shapes only.
        """
        flat, tree = tree_flatten((args, kwargs))
        if self.state is None:
            self._abstract_warmup(args, kwargs, flat)
        entry, holder = self._trace(flat, tree)
        tensors = [flat[i] for i in entry.arg_storages]
        mesh = _program_mesh([_storage_sharding_hint(st) for st in entry.state] + [_storage_sharding_hint(t._st) for t in tensors])
        state_sds = [_abstract(st, mesh) for st in entry.state]
        arg_sds = [_abstract(t._st, mesh) for t in tensors]
        key = tpu_random.key_data_for_step(tpu_random.generator(0))
        key_sds = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=_replicated(mesh) if mesh is not None else None)
        entry.state_shardings = [a.sharding for a in state_sds]
        entry.mesh = mesh
        lowered = entry.jitted.lower(state_sds, arg_sds, key_sds)
        from ..distributed.topology import aot_compile

        entry.executable = aot_compile(lowered)
        entry.lowered_text = lowered.as_text()
        for k in ("created", "out_tree", "out_kinds", "n_random"):
            setattr(entry, k, holder.get(k))
        self.last = entry
        self.compiled_for = entry
        return entry.executable

    def _abstract_warmup(self, args, kwargs, flat):
        """The eager warm-up on shapes only (inside jax.eval_shape): records the state the
        step reads and creates, then puts every touched storage back as it was. Created
        state (optimizer moments) is left unfilled, with the layout of the tensor it was
        made like."""
        recorder = _Recorder()
        before: dict[int, tuple] = {}
        created: list[weakref.ref] = []

        def on_read(st, a):
            recorder(st, a)
            if id(st) not in before:
                before[id(st)] = (st, st.array, st.version)
            return a

        def on_create(st):
            created.append(weakref.ref(st))
            recorder(st, None)

        def body(key_data):
            prev_keys = tpu_random.TRACED
            tpu_random.TRACED = tpu_random.TracedKeys(key_data)
            HOOKS.read = on_read
            prev_create = Storage.on_create
            Storage.on_create = on_create
            prev_mt = torch.autograd.is_multithreading_enabled()
            torch._C._set_multithreading_enabled(False)
            try:
                with _Tracing():
                    self.fn(*args, **kwargs)
            finally:
                torch._C._set_multithreading_enabled(prev_mt)
                HOOKS.read = None
                Storage.on_create = prev_create
                tpu_random.TRACED = prev_keys
            return None

        key = tpu_random.key_data_for_step(tpu_random.generator(0))
        try:
            jax.eval_shape(body, jax.ShapeDtypeStruct(key.shape, key.dtype))
        finally:
            for st, a, v in before.values():
                st.array, st.version = a, v
            before.clear()
            st = None
            gc.collect()  # temporaries of the traced step, kept alive only by reference cycles
            for ref in created:
                st = ref()
                if st is not None:
                    st.array = None  # never filled: zeros if it is ever read eagerly
            st = None
        arg_ids = {id(x._st) for x in flat if isinstance(x, TpuTensor)}
        self.state = [st for sid, ref in recorder.seen.items() if (st := ref()) is not None and sid not in arg_ids]

    # -- inspection of the most recently compiled program
    def _compiled(self):
        entry = getattr(self, "last", None)
        if entry is None or entry.executable is None:
            raise RuntimeError("torchtpu.compile: nothing compiled yet (the second call compiles the step)")
        return entry.executable

    def memory_analysis(self):
        """XLA's memory analysis of the compiled step (argument/output/temp bytes)."""
        return self._compiled().memory_analysis()

    def cost_analysis(self):
        """XLA's cost analysis of the compiled step (flops, bytes accessed, ...)."""
        return self._compiled().cost_analysis()

    def as_text(self, optimized: bool = True) -> str:
        """The compiled step's HLO: XLA-optimized, or as lowered (StableHLO) before XLA passes."""
        self._compiled()
        return self.last.executable.as_text() if optimized else self.last.lowered_text


def array_of_storage(st):
    from .dispatch import storage_array

    return storage_array(st)


def _storage_sharding_hint(st):
    if st.array is not None and not isinstance(st.array, jax.core.Tracer):
        return st.array
    if st.dist is not None:
        return jax.ShapeDtypeStruct(st.shape, jax.numpy.float32, sharding=st.dist[2])
    return None


def _replicated(mesh):
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _abstract(st, mesh):
    from . import dtypes

    if st.array is not None and not isinstance(st.array, jax.core.Tracer):
        sharding = st.array.sharding
        if mesh is not None and not isinstance(sharding, jax.sharding.NamedSharding):
            sharding = _replicated(mesh)
        return jax.ShapeDtypeStruct(st.array.shape, st.array.dtype, sharding=sharding)
    if st.dist is not None:
        sharding = st.dist[2]
    elif mesh is not None:
        sharding = _replicated(mesh)
    else:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[st.device_index])
    return jax.ShapeDtypeStruct(tuple(st.shape), dtypes.to_jax_dtype(st.dtype), sharding=sharding)


def _program_mesh(arrays):
    """The device mesh of a program whose inputs include arrays laid out over one (else None)."""
    for a in arrays:
        s = getattr(a, "sharding", None)
        if isinstance(s, jax.sharding.NamedSharding) and s.mesh.size > 1:
            return s.mesh
    return None


def _committed(a, device_index, mesh=None):
    if getattr(a, "_committed", True):
        return a
    if mesh is not None:
        return jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return jax.device_put(a, jax.devices()[device_index])


def _keep_sharding(a, sharding):
    if a is None or not isinstance(sharding, jax.sharding.NamedSharding) or sharding.mesh.size == 1:
        return a
    from ..distributed.mesh import jax_mesh_for

    target = jax_mesh_for(sharding.mesh)
    if target is not sharding.mesh:
        sharding = jax.sharding.NamedSharding(target, sharding.spec)
    return jax.lax.with_sharding_constraint(a, sharding)


def _unique_arrays(arrays):
    # The same buffer passed twice cannot be donated twice: copy duplicates.
    seen = set()
    out = []
    for a in arrays:
        if id(a) in seen:
            a = jax.numpy.copy(a)
        seen.add(id(a))
        out.append(a)
    return out


def compile(fn=None, *, donate: bool = True):
    """Compile a whole training/inference step over tpu tensors into one XLA program.

        step = torchtpu.compile(train_step)
        loss = step(batch)   # first call eager, second traces+compiles, then cached

    Parameters, gradients and optimizer state that the step updates are updated in place,
    with their buffers donated (`donate=True`).
    """
    if fn is None:
        return lambda f: CompiledFunction(f, donate=donate)
    return CompiledFunction(fn, donate=donate)
