"""What a compiled step reads and creates, found while it runs eagerly or is traced.

torchtpu.compile (compile.py) turns these records into the program's inputs and outputs:
the storages a call reads and creates (its state), the optimizers it steps (their
hyperparameters are lifted or guarded), the CPU tensors tpu ops read (program inputs), and
the Python numbers the function reads from its closure and globals (guarded).
"""

from __future__ import annotations

import gc
import warnings
import weakref

import jax
import torch
from torch.optim import optimizer as _optim_hooks

from . import dtypes
from . import random as tpu_random
from .state import observing, tracing
from .tensor import Storage, TpuTensor, new_base, storage_of


class StorageRecorder:
    """Collects the storages an eager call reads."""

    def __init__(self):
        self.seen: dict[int, weakref.ref] = {}

    def __call__(self, st, a):
        ref = self.seen.get(id(st))
        if ref is None or ref() is not st:  # ids of dead temporaries get reused
            self.seen[id(st)] = weakref.ref(st)
        return a


class TraceCapture:
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
        if (
            a is not None
            and not isinstance(a, jax.core.Tracer)
            and id(st) not in self.state_ids
            and id(st) not in self.created_ids
        ):
            self.stray.append(st)
        return a


class OptimizerRecorder:
    """Records the optimizers whose step() runs while it is open."""

    def __init__(self):
        self.seen: dict[int, weakref.ref] = {}
        self.handle = _optim_hooks.register_optimizer_step_pre_hook(self._on_step)

    def _on_step(self, opt, args, kwargs):
        self.seen.setdefault(id(opt), weakref.ref(opt))

    def close(self):
        self.handle.remove()

    def refs(self) -> list[weakref.ref]:
        return [r for r in self.seen.values() if r() is not None]


def optimizer_device_index(opt) -> int:
    for group in opt.param_groups:
        for p in group["params"]:
            if isinstance(p, TpuTensor):
                return storage_of(p).device_index
    return 0


def move_optimizer_host_state(optimizer_refs) -> list[Storage]:
    """Moves the CPU tensors in the state of optimizers that update tpu parameters (the step
    counts of non-capturable optimizers) to tpu, so the compiled program reads and advances
    them instead of freezing the value they had when it was traced. Returns their storages."""
    moved: list[Storage] = []
    names = set()
    for ref in optimizer_refs:
        opt = ref()
        for p, st in opt.state.items():
            if not isinstance(p, TpuTensor):
                continue
            for k, v in list(st.items()):
                if isinstance(v, torch.Tensor) and not isinstance(v, TpuTensor):
                    st[k] = v.to(p.device)
                    moved.append(storage_of(st[k]))
                    names.add(f"{type(opt).__name__} state[{k!r}]")
    if names:
        warnings.warn(
            f"torchtpu.compile: moved {', '.join(sorted(names))} from the CPU to tpu, where the compiled step "
            "advances it (the optimizer runs its capturable form inside the program). Pass capturable=True "
            "to the optimizer to keep that state on tpu from the start.",
            stacklevel=4,
        )
    return moved


def lift_optimizers(optimizers, slots, hyper) -> list:
    """While a step is traced: the lifted hyperparameters become tpu scalars holding the
    program's input values, and each param group takes PyTorch's graph-capture form
    (capturable=True, foreach=True), the form whose every number stays a tensor. Returns
    what to put back afterwards."""
    restore = []
    for i, (group, k, device_index) in enumerate(slots):
        restore.append((group, k, group[k]))
        group[k] = new_base(hyper[i], device_index, torch.float32)
    for opt in optimizers:
        for group in opt.param_groups:
            if group.get("fused") or group.get("differentiable"):
                continue
            for k in ("capturable", "foreach"):
                if k in group and group[k] is not True:
                    restore.append((group, k, group[k]))
                    group[k] = True
    return restore


class NewOptimizer(Exception):
    """An optimizer the warm-up did not see stepped while a step was traced."""

    def __init__(self, optimizer):
        super().__init__(type(optimizer).__name__)
        self.optimizer = optimizer


class OptimizerGraphCapture:
    """While open, `torch.compiler.is_compiling()` is true inside each optimizer.step(): the
    flag torch.optim reads to keep step counts and tensor learning rates as tensors instead of
    reading them to Python numbers (which would freeze them into the program)."""

    def __init__(self, known):
        import torch.compiler as tc

        self.tc = tc
        self.known = {id(o) for o in known}
        self.prev = tc._is_compiling_flag
        self.pre = _optim_hooks.register_optimizer_step_pre_hook(self._enter)
        self.post = _optim_hooks.register_optimizer_step_post_hook(self._exit)

    def _enter(self, opt, args, kwargs):
        if id(opt) not in self.known:
            raise NewOptimizer(opt)  # before it touches any state
        self.tc._is_compiling_flag = True

    def _exit(self, opt, args, kwargs):
        self.tc._is_compiling_flag = self.prev

    def close(self):
        self.pre.remove()
        self.post.remove()
        self.tc._is_compiling_flag = self.prev


class HostWatch:
    """While a step is traced: CPU tensors read by tpu ops. Those the eager warm-up read are
    program inputs (their values are sent with each call); a long-lived one it did not read, or
    one the step modifies in place, would be frozen into the program: an error naming it."""

    def __init__(self, host, host_arrays):
        self.index = {id(t): i for i, t in enumerate(host)}
        self.host = host
        self.arrays = host_arrays
        self.versions = [t._version for t in host]
        self.unknown: list[weakref.ref] = []

    def __call__(self, t):
        i = self.index.get(id(t))
        if i is not None and self.host[i] is t:
            return self.arrays[i]
        self.unknown.append(weakref.ref(t))
        return dtypes.torch_to_numpy(t)

    def check(self):
        collect_if_alive(self.unknown)  # temporaries of the traced step, kept alive only by reference cycles
        frozen = [t for r in self.unknown if (t := r()) is not None]
        if frozen:
            raise RuntimeError(
                "torchtpu.compile: the step read CPU tensors it did not read during its first (eager) call: "
                f"{', '.join(_describe(t) for t in frozen[:5])}. Their values would be frozen into the program. "
                "Move them to tpu (and pass them as arguments, or read them in the first call too)."
            )
        mutated = [t for t, v in zip(self.host, self.versions) if t._version != v]
        if mutated:
            raise RuntimeError(
                "torchtpu.compile: the step modifies CPU tensors in place: "
                f"{', '.join(_describe(t) for t in mutated[:5])}. The change would happen once, when the step "
                "is traced, not on every call. Keep them on tpu."
            )


def collect_if_alive(refs: list[weakref.ref]) -> None:
    """gc.collect() where it can change what `refs` (weak references) show: when one of them is still
    alive, perhaps only through a reference cycle. A full collection costs 0.1-0.5 s in a process
    with a large heap (a vLLM server, a pytest worker), and most traced steps leave nothing alive."""
    if any(r() is not None for r in refs):
        gc.collect()


_NUMBER_TYPES = (int, float, bool)


def function_numbers(fn) -> tuple:
    """The Python numbers `fn` reads from its closure and its module's globals (guarded)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ()
    out = []
    if fn.__closure__:
        for name, cell in zip(code.co_freevars, fn.__closure__):
            try:
                v = cell.cell_contents
            except ValueError:  # not bound yet
                continue
            if type(v) in _NUMBER_TYPES:
                out.append((name, v))
    g = fn.__globals__
    for name in code.co_names:
        v = g.get(name)
        if type(v) in _NUMBER_TYPES:
            out.append((name, v))
    return tuple(out)


def key_change(old, new) -> str:
    """Names what changed between two cache keys of a compiled step (for the recompile log)."""
    if old is None:
        return "new signature"
    reasons = []
    if old[0] != new[0]:
        reasons.append("argument structure changed")
    if old[1] != new[1]:
        reasons.append(f"arguments changed: {old[1]} -> {new[1]}")
    if old[2] != new[2]:
        for i, (a, b) in enumerate(zip(old[2], new[2])):
            if a != b and a is not None and b is not None:
                da, db = dict(a), dict(b)
                for k in db:
                    if da.get(k) != db[k]:
                        reasons.append(f"optimizer param_groups[{i}][{k!r}] changed: {da.get(k)!r} -> {db[k]!r}")
        if not reasons:
            reasons.append("optimizer param_groups changed")
    if old[3] != new[3]:
        da = dict(old[3])
        reasons += [f"{k!r} changed: {da.get(k)!r} -> {v!r}" for k, v in new[3] if da.get(k) != v]
    return "; ".join(reasons) or "unknown"


def _describe(t: torch.Tensor) -> str:
    return f"{t.device.type} tensor {tuple(t.shape)} {t.dtype}"


def abstract_warmup(step, args, kwargs, flat):
    """The eager warm-up of the compiled function `step` on shapes only (inside
    jax.eval_shape): records the state (`step.state`) and optimizers (`step.optimizers`) the
    step reads and creates, then puts every touched storage back as it was. Created
    state (optimizer moments) is left unfilled, with the layout of the tensor it was
    made like. Returns the created storages that outlive the step (they are in `step.state`)."""
    recorder = StorageRecorder()
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
        prev_mt = torch.autograd.is_multithreading_enabled()
        torch._C._set_multithreading_enabled(False)
        try:
            with observing(read=on_read, create=on_create), tracing():
                step.fn(*args, **kwargs)
        finally:
            torch._C._set_multithreading_enabled(prev_mt)
            tpu_random.TRACED = prev_keys
        return None

    key = tpu_random.key_data_for_step(tpu_random.generator(0))
    optimizers = OptimizerRecorder()
    try:
        jax.eval_shape(body, jax.ShapeDtypeStruct(key.shape, key.dtype))
    finally:
        optimizers.close()
        step.optimizers = optimizers.refs()
        for st, a, v in before.values():
            st.array, st.version = a, v
        before.clear()
        st = None
        collect_if_alive(created)  # temporaries of the traced step, kept alive only by reference cycles
        for ref in created:
            st = ref()
            if st is not None:
                st.array = None  # never filled: zeros if it is ever read eagerly
        st = None
    arg_ids = {id(storage_of(x)) for x in flat if isinstance(x, TpuTensor)}
    step.state = [st for sid, ref in recorder.seen.items() if (st := ref()) is not None and sid not in arg_ids]
    kept = {id(st) for st in step.state}
    return [st for ref in created if (st := ref()) is not None and id(st) in kept]
