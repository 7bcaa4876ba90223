"""Whole-step compilation: `torchtpu.compile(fn)` turns a Python function over tpu tensors
(forward, backward, clipping, optimizer.step()) into one XLA program.

How it works:
1. The first call runs eagerly. It creates lazily built state (optimizer moments, .grad) and
   records every tpu storage the step reads. Those that are still alive afterwards are the
   step's state: parameters, gradients, optimizer state, buffers. With `warmup="abstract"` the
   first call finds them on shapes only (compile_capture.abstract_warmup) and goes on to step 2;
   a storage that call would create and keep is refused (it has no value to start from).
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

No frozen values. Every value the step reads that can change between calls is either an input
of the program or guarded (a change traces the step again, counted in
`torchtpu.cache_stats()["compiled_step_retraces"]` and printed with its cause under
`TORCHTPU_LOG_RECOMPILES=1`); what can be neither is an error that names it:
- Optimizers. The warm-up records every optimizer whose `step()` runs in the function (a global
  optimizer step pre-hook). On each call their `param_groups` are read:
  - `lr` (what LR schedulers change, as a Python float assigned between calls) is lifted: its
    current value is sent with the call as a program input, and while the step is traced the
    group holds a tpu scalar standing for it. A scheduler stepping every iteration never
    recompiles. A tpu-tensor `lr` (the trainer's) is program state like any parameter.
  - every other entry (betas, weight_decay, momentum, eps, flags) is part of the cache key: a
    change traces once more, visibly.
  - while traced, each group takes PyTorch's graph-capture form, the one `torch.compile`
    traces: capturable=True, foreach=True, and `torch.compiler.is_compiling()` true inside
    `optimizer.step()`. In that form torch.optim keeps step counts and tensor learning rates
    as tensors instead of reading them into Python numbers. The user's flags are put back
    afterwards; the math is the same (XLA fuses the whole step either way).
  - CPU tensors in their state (non-capturable optimizers' `step` counts) are moved to tpu
    once, after the warm-up, with a warning, and become program state.
  - an optimizer first stepped after the warm-up (gradient accumulation) is caught before its
    step changes anything: that call runs eagerly, as a second warm-up, and later calls trace
    with it adopted.
- CPU tensors read by tpu ops (a CPU scalar the user keeps): those the warm-up read are program
  inputs, their current values sent with each call. A long-lived CPU tensor first read after
  the warm-up, or one the step modifies in place, is an error naming it.
- tpu tensors the step reads are its state or arguments; one first read after the warm-up is
  an error (its value would be frozen).
- A host `.item()` inside the step is an error (transfer.py).
- Python numbers (int, float, bool) the function reads from its closure variables or module
  globals are guarded.
Known limit: a program assumes the tensors in each role are the objects it was traced with. A
`.grad` that is None at the start of one traced path and a tensor at the start of another
(`zero_grad()` at the end of a step that runs every k calls) breaks that; use
`zero_grad(set_to_none=False)` there, or zero the gradients at the start of the step. Numbers reached deeper (attributes of objects, other functions' globals)
  are constants of the trace, as under `jax.jit`: pass values that change as tensor arguments.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import weakref

import jax
import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import dtypes, fused
from . import random as tpu_random
from .aot import (
    abstract_storage,
    aot_compile,
    committed,
    current_compiler_options,
    keep_sharding,
    program_mesh,
    replicated,
    storage_sharding_hint,
    unique_arrays,
)
from .compile_capture import (
    HostWatch,
    NewOptimizer,
    OptimizerGraphCapture,
    OptimizerRecorder,
    StorageRecorder,
    TraceCapture,
    abstract_warmup,
    function_numbers,
    key_change,
    lift_optimizers,
    move_optimizer_host_state,
)
from .compile_inputs import CallInputs, call_inputs
from .state import CONFIG, observing, tracing
from .tensor import Storage, TpuTensor, new_base, storage_of
from .views import array_of, storage_array


class CompileStats:
    def __init__(self):
        self.traces = 0
        self.executions = 0

    def snapshot(self):
        return {"traces": self.traces, "executions": self.executions}


class GlobalCompileStats:
    """Process-wide counters of compiled steps, reported by `torchtpu.cache_stats()`."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.traces = 0  # steps traced into an XLA program (first traces and re-traces)
        self.retraces = 0  # of which: a step traced again because a guarded value changed

    def snapshot(self) -> dict:
        return {"compiled_step_traces": self.traces, "compiled_step_retraces": self.retraces}


STATS = GlobalCompileStats()


class ProgramBuilds:
    """Whether torchtpu.compile is building a program now (eager warm-up, trace, lower, XLA compile).

    A step watchdog reads this: a step that builds its program is slow because the compiler
    works, not because a host is stuck, so it is held to the first-step limit instead."""

    def __init__(self):
        self.active = 0
        self.started = 0.0  # time.monotonic() when the outermost build began
        self.last_end = 0.0  # time.monotonic() when the last build ended

    @contextlib.contextmanager
    def building(self):
        if self.active == 0:
            self.started = time.monotonic()
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self.last_end = time.monotonic()


BUILDS = ProgramBuilds()


def _log_enabled() -> bool:
    return bool(os.environ.get("TORCHTPU_LOG_RECOMPILES"))


class _Entry:
    __slots__ = (
        "executable",
        "jitted",
        "lowered_text",
        "state",
        "created",
        "out_tree",
        "out_kinds",
        "n_random",
        "arg_storages",
        "state_shardings",
        "mesh",
        "host",
        "written",
    )


class CompiledFunction:
    def __init__(self, fn, donate: bool = True, warmup: str = "eager"):
        if warmup not in ("eager", "abstract"):
            raise ValueError(f"torchtpu.compile: warmup={warmup!r}; choose 'eager' or 'abstract'")
        self.fn = fn
        self.donate = donate
        self.warmup = warmup
        self.state: list[Storage] | None = None
        self.entries: dict = {}
        self.stats = CompileStats()
        self.optimizers: list[weakref.ref] = []  # optimizers stepped by the eager warm-up
        self.host: list[weakref.ref] = []  # CPU tensors read by tpu ops in the eager warm-up
        self.last_key = None
        functools.update_wrapper(self, fn)

    # -- signature of a call: tensor shapes/dtypes + everything else by value
    @staticmethod
    def _signature(flat):
        sig = []
        for x in flat:
            if isinstance(x, TpuTensor):
                sig.append(("T", tuple(x.shape), x.dtype, storage_of(x).device_index))
            elif isinstance(x, torch.Tensor):
                raise TypeError(
                    f"torchtpu.compile: argument on {x.device}; move it to the tpu device first (.to('tpu'))"
                )
            else:
                sig.append(x)
        return tuple(sig)

    def __call__(self, *args, **kwargs):
        # fused eager mode: what was recorded before this call runs now, not when the trace of the
        # step reads it (a program launched inside a trace would hand tracers to the tensors)
        fused.flush()
        flat, tree = tree_flatten((args, kwargs))
        if self.state is None:
            with BUILDS.building():
                if self.warmup == "eager":
                    return self._warmup(args, kwargs, flat)
                self._abstract_warmup(args, kwargs, flat)
        while True:
            inputs = call_inputs(self.optimizers, self.host)
            key = (tree, self._signature(flat), inputs.guard, function_numbers(self.fn))
            entry = self.entries.get(key)
            if entry is not None:
                self.last_key = key
                return self._run(entry, flat, inputs)
            if self.entries:
                STATS.retraces += 1
                if _log_enabled():
                    print(
                        f"[torchtpu] torchtpu.compile({getattr(self.fn, '__qualname__', self.fn)}): traced again: "
                        f"{key_change(self.last_key, key)}",
                        file=sys.stderr,
                    )
            try:
                with BUILDS.building():
                    entry, holder = self._trace(flat, tree, inputs)
                    out = self._run(entry, flat, inputs, first_holder=holder)
            except NewOptimizer:
                # An optimizer that did not step in the warm-up (one stepped every k calls):
                # this call runs eagerly, as a second warm-up that creates its state and adds
                # it to the step's; later calls trace with its hyperparameters lifted and guarded.
                with BUILDS.building():
                    return self._warmup(args, kwargs, flat)
            self.entries[key] = entry
            self.last_key = key
            return out

    # -- 1. eager warm-up
    def _warmup(self, args, kwargs, flat):
        recorder = StorageRecorder()
        host: dict[int, weakref.ref] = {}

        def on_host(t):
            ref = host.get(id(t))
            if ref is None or ref() is not t:  # ids of dead temporaries get reused
                host[id(t)] = weakref.ref(t)
            return dtypes.torch_to_numpy(t)

        optimizers = OptimizerRecorder()
        try:
            # storages created by the call that outlive it (a first .grad) are state too
            with observing(read=recorder, host=on_host, create=lambda st: recorder(st, None)):
                out = self.fn(*args, **kwargs)
        finally:
            optimizers.close()
        arg_ids = {id(storage_of(x)) for x in flat if isinstance(x, TpuTensor)}
        # a second warm-up (an optimizer first stepped later) adds to what the first found
        state = list(self.state or [])
        known = {id(st) for st in state}
        for sid, ref in recorder.seen.items():
            st = ref()
            if st is not None and sid not in arg_ids and sid not in known:
                state.append(st)
        known_opts = {id(r()) for r in self.optimizers}
        new_opts = [r for r in optimizers.refs() if id(r()) not in known_opts]
        self.optimizers = self.optimizers + new_opts
        state.extend(move_optimizer_host_state(new_opts))
        known_host = {id(r()) for r in self.host}
        self.host = self.host + [r for r in host.values() if r() is not None and id(r()) not in known_host]
        self.state = state
        return out

    def _abstract_warmup(self, args, kwargs, flat):
        """warmup='abstract': find the step's state by running it on shapes only, so that the first
        call already runs the compiled program. Only for steps whose state all exists before the
        first call: a storage the step creates and keeps (lazily made optimizer moments, a .grad
        kept between calls) has no value to start the program from, and guessing one (zeros) would
        be wrong for some optimizers (SGD's momentum starts as the first gradient)."""
        created = abstract_warmup(self, args, kwargs, flat)
        if created:
            shapes = ", ".join(str(tuple(st.shape)) for st in created[:4])
            _forget_created(self.optimizers, {id(st) for st in created})
            self.state = None
            self.optimizers = []
            raise RuntimeError(
                f"torchtpu.compile(warmup='abstract'): the step creates {len(created)} tensor(s) on its first "
                f"call and keeps them (shapes {shapes}{', ...' if len(created) > 4 else ''}: optimizer state "
                "made lazily, or a .grad kept between calls); create them before the first call (for Adam(W), "
                "torchtpu.train.optimizer.init_optimizer_state; zero_grad(set_to_none=True) in the step) or "
                "use warmup='eager'"
            )
        self.state.extend(move_optimizer_host_state([r for r in self.optimizers if r() is not None]))

    # -- 2. trace + compile
    def _trace(self, flat, tree, inputs: CallInputs):
        entry = _Entry()
        entry.state_shardings = [None] * len(self.state)
        entry.mesh = None
        state = [st for st in self.state]
        entry.state = state
        entry.host = [weakref.ref(t) for t in inputs.host]
        tensor_pos = [i for i, x in enumerate(flat) if isinstance(x, TpuTensor)]
        holder = {}
        slots = inputs.slots
        optimizers = [opt for ref in self.optimizers if (opt := ref()) is not None]

        def step(state_arrays, arg_arrays, key_data, hyper, host_arrays):
            self.stats.traces += 1
            STATS.traces += 1
            capture = TraceCapture(state)
            host_watch = HostWatch(inputs.host, host_arrays)
            restore = lift_optimizers(optimizers, slots, hyper)
            saved = [(st.array, st.version) for st in state]
            for st, a in zip(state, state_arrays):
                st.array = a
                st.version += 1
            new_flat = list(flat)
            for i, a in zip(tensor_pos, arg_arrays):
                t = new_base(a, storage_of(flat[i]).device_index, flat[i].dtype)
                t.requires_grad_(flat[i].requires_grad)
                new_flat[i] = t
            targs, tkwargs = tree_unflatten(new_flat, tree)
            created = capture.created
            prev_keys = tpu_random.TRACED
            tpu_random.TRACED = tpu_random.TracedKeys(key_data)
            prev_mt = torch.autograd.is_multithreading_enabled()
            torch._C._set_multithreading_enabled(False)
            graph_capture = OptimizerGraphCapture(optimizers)
            try:
                with observing(read=capture, host=host_watch, create=capture.on_create):
                    with tracing():
                        out = self.fn(*targs, **tkwargs)
                    out_flat, out_tree = tree_flatten(out)
                    out_arrays = []
                    out_kinds = []
                    for o in out_flat:
                        if isinstance(o, TpuTensor):
                            out_arrays.append(array_of(o))
                            out_kinds.append(("T", o.dtype, storage_of(o).device_index))
                        else:
                            out_kinds.append(("V", o))
                    written = {j for j, st in enumerate(state) if st.array is not state_arrays[j]}
                    new_state = [keep_sharding(st.array, sh) for st, sh in zip(state, entry.state_shardings)]
                    del out, targs, tkwargs, new_flat, out_flat
                    alive = [r() for r in created]
                    alive = [st for st in alive if st is not None and st.array is not None]
            finally:
                graph_capture.close()
                for group, k, v in reversed(restore):
                    group[k] = v
                torch._C._set_multithreading_enabled(prev_mt)
                n_random = tpu_random.TRACED.count
                tpu_random.TRACED = prev_keys
                for st, (a, v) in zip(state, saved):
                    st.array, st.version = a, v + 2
            host_watch.check()
            if capture.stray:
                names = ", ".join(f"{tuple(st.shape)} {st.dtype}" for st in capture.stray[:5])
                raise RuntimeError(
                    "torchtpu.compile: the function read tpu tensors it did not read during its first "
                    f"(eager) call: {names}. Their values would be frozen into the program. Pass them as "
                    "arguments, or make the first call take the same path as later calls."
                )
            holder.update(created=alive, out_tree=out_tree, out_kinds=out_kinds, n_random=n_random, written=written)
            return out_arrays, new_state, [st.array for st in alive]

        donate = (0,) if self.donate else ()
        entry.executable = None
        entry.jitted = jax.jit(step, donate_argnums=donate)
        entry.arg_storages = tensor_pos
        return entry, holder

    # -- 3. execution (the first one also lowers and compiles)
    def _run(self, entry, flat, inputs: CallInputs, first_holder=None):
        state_arrays = unique_arrays([st.array if st.array is not None else storage_array(st) for st in entry.state])
        arg_arrays = [array_of(flat[i]) for i in entry.arg_storages]
        # current values of the lifted hyperparameters and of the CPU tensors the step reads
        hyper = np.asarray(inputs.values, np.float32) if inputs.values else None
        host_arrays = [np.array(dtypes.torch_to_numpy(t)) for t in inputs.host]
        if first_holder is not None:
            # Commit eager-made arrays to their device (or, in a program over a device mesh,
            # replicate them over the mesh): later calls feed the executable's committed
            # outputs back, and a committedness change would compile it again.
            mesh = program_mesh(state_arrays + arg_arrays)
            state_arrays = [committed(a, st.device_index, mesh) for a, st in zip(state_arrays, entry.state)]
            # Parameters and optimizer state keep their layout from step to step.
            entry.state_shardings = [a.sharding for a in state_arrays]
            entry.mesh = mesh
        if entry.mesh is not None:
            arg_arrays = [committed(a, 0, entry.mesh) for a in arg_arrays]
        if hyper is not None or host_arrays:
            target = (
                replicated(entry.mesh)
                if entry.mesh is not None
                else state_arrays[0].sharding
                if state_arrays
                else jax.devices()[0]
            )
            hyper = jax.device_put(hyper, target) if hyper is not None else None
            host_arrays = [jax.device_put(a, target) for a in host_arrays]
        # An argument that is also state (`h = step(h)` where the warm-up saw h's storage made,
        # or a parameter passed in) is read from its own buffer: XLA refuses a buffer donated
        # and read in the same call. Which state the step writes is known once it is traced.
        state_index = {id(st): j for j, st in enumerate(entry.state)}
        aliased = [(n, state_index.get(id(storage_of(flat[i])))) for n, i in enumerate(entry.arg_storages)]
        aliased = [(n, j) for n, j in aliased if j is not None]
        arg_arrays = list(arg_arrays)
        for n, _ in aliased:
            arg_arrays[n] = jax.numpy.copy(arg_arrays[n])
        gen = tpu_random.generator(0)
        key_data = tpu_random.key_data_for_step(gen)
        if entry.executable is None:
            # Ahead-of-time lower + compile, so the executable's memory and cost analyses
            # are available (CompiledFunction.memory_analysis / cost_analysis / as_text).
            lowered = entry.jitted.lower(state_arrays, arg_arrays, key_data, hyper, host_arrays)
            entry.executable = lowered.compile(current_compiler_options() or None)
            entry.lowered_text = lowered.as_text()
            self.last = entry
        if first_holder is not None:
            entry.written = first_holder["written"]
        for n, j in aliased:
            if j in (entry.written or ()):
                t = flat[entry.arg_storages[n]]
                raise RuntimeError(
                    f"torchtpu.compile: tensor argument {n} of the step (a {tuple(t.shape)} {t.dtype} tensor) is "
                    "also state the step writes in place (a parameter, buffer or optimizer state): in eager "
                    "mode the argument would see the writes, inside one program it cannot. Pass a copy "
                    "(`.clone()`), or let the step read that tensor where it lives instead of passing it."
                )
        out_arrays, new_state, created_arrays = entry.executable(state_arrays, arg_arrays, key_data, hyper, host_arrays)
        if entry.mesh is not None and CONFIG.sync_dispatch:
            # every output: a program that changes no state (an evaluation step) must also be done
            # before the next program with collectives starts (backend.state.Config)
            jax.block_until_ready((out_arrays, new_state, created_arrays))
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
        entry, holder, lowered = self._lower_for(args, kwargs)
        entry.executable = aot_compile(lowered)
        entry.lowered_text = lowered.as_text()
        for k in ("created", "out_tree", "out_kinds", "n_random", "written"):
            setattr(entry, k, holder.get(k))
        self.last = entry
        return entry.executable

    def lower_for(self, *args, **kwargs):
        """Trace and lower the step for these arguments as `compile_for` does, without compiling;
        returns the `jax.stages.Lowered` (its text identifies the program: the dry run's cache of
        compile reports is keyed by it)."""
        return self._lower_for(args, kwargs)[2]

    def _lower_for(self, args, kwargs):
        flat, tree = tree_flatten((args, kwargs))
        if self.state is None:
            abstract_warmup(self, args, kwargs, flat)
        inputs = call_inputs(self.optimizers, self.host)
        entry, holder = self._trace(flat, tree, inputs)
        tensors = [flat[i] for i in entry.arg_storages]
        mesh = program_mesh(
            [storage_sharding_hint(st) for st in entry.state] + [storage_sharding_hint(storage_of(t)) for t in tensors]
        )
        state_sds = [abstract_storage(st, mesh) for st in entry.state]
        arg_sds = [abstract_storage(storage_of(t), mesh) for t in tensors]
        key = tpu_random.key_data_for_step(tpu_random.generator(0))
        key_sds = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated(mesh) if mesh is not None else None)
        entry.state_shardings = [a.sharding for a in state_sds]
        entry.mesh = mesh
        whole = replicated(mesh) if mesh is not None else None
        hyper_sds = jax.ShapeDtypeStruct((len(inputs.values),), np.float32, sharding=whole) if inputs.values else None
        host_sds = [jax.ShapeDtypeStruct(t.shape, dtypes.torch_to_numpy(t).dtype, sharding=whole) for t in inputs.host]
        lowered = entry.jitted.lower(state_sds, arg_sds, key_sds, hyper_sds, host_sds)
        return entry, holder, lowered

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


def _forget_created(optimizer_refs, created: set) -> None:
    """Undo what a refused abstract warm-up left behind: optimizer state entries and .grad
    tensors made of storages it created (they hold no values)."""
    for ref in optimizer_refs:
        opt = ref()
        if opt is None:
            continue
        for p, st in list(opt.state.items()):
            if any(isinstance(v, TpuTensor) and id(storage_of(v)) in created for v in st.values()):
                del opt.state[p]
        for group in opt.param_groups:
            for p in group["params"]:
                if isinstance(p.grad, TpuTensor) and id(storage_of(p.grad)) in created:
                    p.grad = None


def compile(fn=None, *, donate: bool = True, warmup: str = "eager"):
    """Compile a whole training/inference step over tpu tensors into one XLA program.

        step = torchtpu.compile(train_step)
        loss = step(batch)   # first call eager, second traces+compiles, then cached

    Parameters, gradients and optimizer state that the step updates are updated in place,
    with their buffers donated (`donate=True`).

    `warmup="abstract"`: the first call finds the step's state on shapes only and already runs
    the compiled program (no op-by-op first call). For steps whose state all exists before the
    first call (optimizer state created up front, gradients set to None at the end of the step);
    a step that creates and keeps a tensor in its first call is refused with an error naming it.
    """
    if fn is None:
        return lambda f: CompiledFunction(f, donate=donate, warmup=warmup)
    return CompiledFunction(fn, donate=donate, warmup=warmup)
