"""Fused eager mode: ops on tpu tensors are recorded, and run later as one XLA program.

In fused mode (`torchtpu.set_eager_mode("fused")`) an op whose executable is a `jax.jit`
function does not launch it: the dispatcher records the call (the executable and its
inputs) in a graph and gets back `Deferred` values, placeholders with the shape and dtype
of the outputs and no device memory. Tensors hold them in their storages as they would hold
arrays. The graph runs (`flush`) when Python needs a value: anything that reads a storage's
array outside the recording path (`.item()`, `.cpu()`, printing, `bool()`, `torch.save`, a
CPU op, an op without a jitted executable) forces the Deferred it finds, and forcing one
runs the whole graph. It also runs once it holds `MAX_OPS` ops, and once the input arrays that only
the graph still references, and that no output can reuse, pass `MAX_HELD_BYTES` (`_check_held`).

A flush traces one function that inlines the recorded executables' jaxprs in order on tracers and
returns the values still referenced from Python (a Deferred nobody holds any more is an
intermediate: XLA fuses it away). Input arrays that nothing but the graph references any more
(the old values of what the graph overwrote) are donated to the program. The program is cached under the graph's structure: the
executables, how their inputs connect, and which values are returned. A loop that repeats
the same ops therefore builds its program once; from then on each flush is a dictionary
lookup and one launch. JAX specialises the program per input shapes and dtypes as it does
any jitted function.

A flush made by reading one value runs in two programs when that pays (`_plan`): first the ops
the value needs, then the others, which the read does not wait for. A loop that reads
`loss.item()` after its optimizer step waits for the forward alone; the backward and the
optimizer step run while Python records the next step.

The executables are the strict path's own (`execute.run`), so a fused program computes what
strict eager computes, op by op: the same lowerings, the same dtype rules, the same random
keys (drawn on the host when the op is recorded). What this module does not record runs
strictly, after forcing its inputs.

Over a device mesh the program takes its inputs' shardings as any jitted function does, and XLA
propagates them through the program. Where strict eager places a value by hand (an in-place
write keeps a sharded tensor's layout, `zeros_like` of a sharded tensor has its layout), the
recorded value is constrained to that layout instead (`constrain`), so what a flush writes
back is laid out as strict eager lays it out.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
import weakref

import jax
import numpy as np
from jax._src.array import ArrayImpl as _ArrayImpl  # the concrete jax.Array type
from jax.sharding import NamedSharding

from .state import CONFIG, EAGER_MODES

MAX_OPS = int(os.environ.get("TORCHTPU_FUSED_MAX_OPS", "4000"))
MAX_HELD_BYTES = int(float(os.environ.get("TORCHTPU_FUSED_MAX_HELD_MB", "64")) * 2**20)
_LOG_FLUSHES = bool(os.environ.get("TORCHTPU_LOG_FLUSHES"))


class FusedStats:
    """Fused-mode counters: ops recorded, graphs run (flushes), programs run (`runs`: one or two a
    flush, `_plan`), programs built for a new graph structure (each such program is traced and
    compiled on its first run), and input buffers donated to the programs run (`_dead_inputs`)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.recorded = 0
        self.flushes = 0
        self.runs = 0
        self.programs = 0
        self.donated = 0

    def snapshot(self) -> dict:
        return {
            "fused_ops_recorded": self.recorded,
            "fused_flushes": self.flushes,
            "fused_runs": self.runs,
            "fused_programs": self.programs,
            "fused_donated": self.donated,
        }


FUSED_STATS = FusedStats()


class Deferred:
    """A value an op will produce when the graph it was recorded in runs."""

    __slots__ = ("shape", "dtype", "weak_type", "value", "slot", "epoch", "error", "sharding", "__weakref__")

    def __init__(self, shape, dtype, weak_type, slot, epoch):
        self.shape = shape
        self.dtype = dtype
        self.weak_type = weak_type
        self.value = None
        self.slot = slot
        self.epoch = epoch
        self.error = None
        # the layout over a device mesh the value is constrained to (`constrain`), None when the
        # program's sharding propagation chooses it
        self.sharding = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def get(self):
        """The array: runs the pending graph if this value is still to be computed."""
        if self.value is None:
            if self.error is not None:
                raise self.error
            if self.epoch != _GRAPH.epoch:
                raise RuntimeError("torchtpu fused mode internal error: a deferred value outlived its graph")
            flush(self)
            if self.value is None:
                raise RuntimeError("torchtpu fused mode internal error: a referenced value was not computed")
        return self.value

    def __repr__(self):
        return f"Deferred({self.shape}, {self.dtype})"


def force(x):
    """`x` itself, or the array a Deferred `x` stands for."""
    return x.get() if type(x) is Deferred else x


class _Graph:
    """The ops recorded since the last flush. Values (inputs and op outputs) are numbered in the
    order they appear; a node is (executable, numbers of its inputs, number of its first output,
    how many outputs)."""

    def __init__(self, epoch):
        self.epoch = epoch
        self.inputs = []
        self.input_slots = []
        self.input_ids = {}  # id of an input array -> (its value number, its aval)
        self.nodes = []
        self.outputs = {}  # value number -> weakref to its Deferred
        self.n = 0
        # the devices of the program, in jit's order: those of the first committed input or layout
        # constraint (`record`, `constrain`); None while every input may go anywhere
        self.devices = None
        self.input_bytes = 0  # bytes of the inputs
        self.check_at = 0  # input bytes at which `_check_held` runs next


_GRAPH = _Graph(0)
_SHAPES: dict = {}  # (executable, input avals) -> (output treedef, output avals)
_PROGRAMS: dict = {}  # graph structure -> jitted program
# One output (the smallest) of the last program each recent flush ran, oldest first: XLA completes
# all of a program's outputs at once, and a device's programs in order, so once it is ready that
# flush's programs and all earlier ones are done (`_wait_for_earlier_flushes`).
_IN_FLIGHT: list = []
_MAX_PROGRAMS = 256


def _aval(x):
    """(shape, dtype, weak type, layout over a device mesh or None) of a graph input: an op's
    output shapes are computed, and its errors raised, with the layout the program will see (a
    torchtpu.jax_op checks its input specs against the mesh the inputs lie on)."""
    t = type(x)
    if t is Deferred:
        return (x.shape, x.dtype, x.weak_type, x.sharding)
    if t is np.ndarray:
        return (x.shape, x.dtype, False, None)
    sharding = x.sharding
    return (x.shape, x.dtype, x.weak_type, sharding if type(sharding) is NamedSharding else None)


def recordable(x) -> bool:
    t = type(x)
    if t is Deferred or t is _ArrayImpl or t is np.ndarray:
        return True
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def record(fn, leaves):
    """Record `fn(*leaves)` (`fn` a jitted function of arrays) and return its outputs as
    Deferred values, in the structure `fn` returns them."""
    g = _GRAPH
    refs = []
    avals = []
    input_ids = g.input_ids
    for x in leaves:
        if type(x) is Deferred:
            if x.value is None:
                if x.epoch != g.epoch:
                    x.get()  # raises the error of the flush that lost it
                refs.append(x.slot)
                avals.append((x.shape, x.dtype, x.weak_type, x.sharding))
                continue
            x = x.value
        seen = input_ids.get(id(x))
        if seen is None:
            if type(x) is _ArrayImpl and x._committed:
                devices = x.sharding._device_assignment
                if g.devices is None:
                    g.devices = devices
                elif devices != g.devices:
                    return _record_apart(fn, leaves)
            seen = input_ids[id(x)] = (g.n, _aval(x))
            g.n += 1
            g.inputs.append(x)
            g.input_slots.append(seen[0])
            g.input_bytes += x.nbytes
        refs.append(seen[0])
        avals.append(seen[1])
    key = (fn, tuple(avals))
    shapes = _SHAPES.get(key)
    if shapes is None:
        structs = [jax.ShapeDtypeStruct(s, d, weak_type=w, sharding=sh) for s, d, w, sh in avals]
        out = jax.eval_shape(fn, *structs)
        flat, treedef = jax.tree_util.tree_flatten(out)
        if treedef == jax.tree_util.tree_structure(0):
            treedef = None  # one array: no structure to rebuild
        shapes = _SHAPES[key] = (treedef, tuple((tuple(o.shape), o.dtype, o.weak_type) for o in flat))
    treedef, out_avals = shapes
    first = n = g.n
    epoch = g.epoch
    outputs = g.outputs
    outs = []
    for s, d, w in out_avals:
        v = Deferred(s, d, w, n, epoch)
        outputs[n] = weakref.ref(v)
        n += 1
        outs.append(v)
    g.n = n
    g.nodes.append((fn, tuple(refs), first, len(out_avals)))
    FUSED_STATS.recorded += 1
    if len(g.nodes) >= MAX_OPS or (g.input_bytes >= g.check_at and _check_held(g)):
        flush(queued=0)  # no read is coming to wait for what runs: let no earlier graph's programs queue
    return outs[0] if treedef is None else jax.tree_util.tree_unflatten(treedef, outs)


def _check_held(g) -> bool:
    """Whether the graph holds too much memory that strict eager would have freed: input arrays
    that nothing but the graph references any more (`_dead_inputs`: a batch a loop moved to the
    device and dropped before reading anything) and that no output of the same shape and dtype can
    reuse (donated, as an optimizer step's old parameters are), past `MAX_HELD_BYTES`. Runs when
    the graph's inputs have grown by a quarter of that or of their size, whichever is more, so a
    graph is checked a few times, however large its inputs."""
    g.check_at = g.input_bytes + max(MAX_HELD_BYTES, g.input_bytes) // 4
    dead = _dead_inputs(g.inputs)
    if sum(g.inputs[i].nbytes for i in dead) < MAX_HELD_BYTES:
        return False
    free = _slots_by_type(d for d in (ref() for ref in g.outputs.values()) if d is not None)
    held = 0
    for i in dead:
        x = g.inputs[i]
        k = (x.shape, x.dtype)
        if free.get(k):
            free[k] -= 1
        else:
            held += x.nbytes
    return held >= MAX_HELD_BYTES


def _record_apart(fn, leaves):
    """`record` of an op with an input that jit would not move (committed: placed on one device,
    or laid out over a mesh) on other devices than the graph's committed inputs: one jitted program
    cannot hold both (jit's device assignment), so the graph runs first and the op starts a new
    one. An op whose own inputs lie on different devices runs as strict eager runs it, and raises
    jit's error naming them, at the call."""
    global _GRAPH
    g = _GRAPH
    flush()
    if _GRAPH is g:
        # nothing recorded yet, only inputs of this op (or of one that ran strictly), which set the
        # graph's devices: the op starts a new graph all the same
        _GRAPH = _Graph(g.epoch + 1)
    arrays = [force(x) for x in leaves]
    devices = None
    for x in arrays:
        if type(x) is _ArrayImpl and x._committed:
            if devices is None:
                devices = x.sharding._device_assignment
            elif x.sharding._device_assignment != devices:
                return fn(*arrays)
    return record(fn, arrays)


@functools.cache
def _constraint_fn(sharding):
    return jax.jit(functools.partial(jax.lax.with_sharding_constraint, shardings=sharding))


def constrain(x: Deferred, sharding):
    """`x` laid out by `sharding` over a device mesh, recorded: the program places the value as
    `jax.device_put` would place `x`'s array in strict mode, without running the graph. Where the
    graph's inputs lie on other devices (a value made on one device written into a parameter laid
    out over the mesh) one program cannot do both: the graph runs, and the array is moved
    (`reshard`)."""
    if x.sharding == sharding:
        return x
    g = _GRAPH
    mine = sharding._device_assignment
    v = x.value  # set when the graph `x` was recorded in has run
    if (g.devices is not None and g.devices != mine) or (
        type(v) is _ArrayImpl and v._committed and v.sharding._device_assignment != mine
    ):
        return reshard(x.get(), sharding)
    g.devices = mine
    out = record(_constraint_fn(sharding), (x,))
    if type(out) is Deferred:
        out.sharding = sharding
    return out


def reshard(a, sharding):
    """`a` laid out by `sharding` (jax.device_put). A change of layout over several devices is a
    program with collectives; on the CPU platform with a mesh (CONFIG.sync_dispatch) it is waited
    for, as every eager op is, so that no two such programs are in flight at once (backend.state.Config)."""
    out = jax.device_put(a, sharding)
    return jax.block_until_ready(out) if CONFIG.sync_dispatch else out


def layout_of(x):
    """The sharding of an array, or the one a Deferred value is constrained to (None if unknown)."""
    return x.sharding if type(x) is Deferred else getattr(x, "sharding", None)


def _program(nodes, reads, outs, n, *inputs):
    env = [None] * n
    for slot, x in zip(reads, inputs):
        env[slot] = x
    for fn, refs, first, count in nodes:
        args = [env[r] for r in refs]
        # the jaxpr the executable traced for these input types (cached by jit: recording the op
        # traced it for its output shapes), inlined: the program computes what strict eager runs,
        # without running the op's Python again; a nested jit call would stay a call in the
        # program, and XLA:CPU ran the LM loop's step 1.7x slower with them
        closed = fn.trace(*args).jaxpr
        env[first : first + count] = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    return [env[v] for v in outs]


def _dead_inputs(inputs) -> frozenset:
    """The positions of the device arrays among a graph's inputs that nothing but the graph
    references: values overwritten while the graph was recorded (a parameter's or an optimizer
    state's old array). The programs are given their buffers (donated, `_donations`), as strict
    eager frees them op by op, so a step's peak memory holds no second copy of what it updates."""
    dead = []
    waited = {id(x) for x in _IN_FLIGHT}
    for i in range(len(inputs)):
        x = inputs[i]
        # three references: the list, `x` and getrefcount's argument; one more where
        # _IN_FLIGHT holds it to wait for its program, which has run once this one runs
        if type(x) is _ArrayImpl and sys.getrefcount(x) <= 3 + (id(x) in waited):
            dead.append(i)
    return frozenset(dead)


def _slots_by_type(outputs) -> dict:
    """How many of `outputs` (Deferred values) there are of each (shape, dtype): the buffers of
    dead inputs of those types that the outputs can reuse (`_donations`, `_check_held`)."""
    free: dict = {}
    for d in outputs:
        k = (d.shape, d.dtype)
        free[k] = free.get(k, 0) + 1
    return free


def _donations(part, dead, inputs, values) -> tuple:
    """The positions, among `part`'s inputs, of the dead graph inputs (`_dead_inputs`) that only
    this part reads and that an output of the same shape and dtype can take the place of."""
    free = _slots_by_type(values[i] for i in part.returned)
    donate = []
    for pos, i in enumerate(part.graph_inputs):
        if i in dead and i not in part.later_inputs:
            x = inputs[i]
            k = (x.shape, x.dtype)
            if free.get(k):
                free[k] -= 1
                donate.append(pos)
    return tuple(donate)


class _Part:
    """One program of a flush: its nodes (in recorded order), the value numbers it reads (graph
    inputs and values an earlier part returns), the value numbers it returns, and, as positions,
    which of its inputs are graph inputs (`graph_inputs`: index into the graph's inputs, or -1)
    and which of its returns are live (`returned`: index into the live values)."""

    __slots__ = ("nodes", "reads", "outs", "graph_inputs", "later_inputs", "returned", "programs")

    def __init__(self, nodes, reads, outs, input_index, live_index, later_inputs=frozenset()):
        self.nodes = nodes
        self.reads = tuple(reads)
        self.outs = tuple(outs)
        self.graph_inputs = tuple(input_index.get(v, -1) for v in self.reads)
        self.later_inputs = later_inputs  # graph inputs a later part reads too: not donated here
        self.returned = tuple(live_index[v] for v in self.outs if v in live_index)
        self.programs = {}  # donated positions -> jitted program


# Split a flush only when the part the read value needs leaves this many ops to run after it.
SPLIT_MIN_REST = 16


def _plan(nodes, input_slots, live, n, wanted) -> list:
    """The programs a flush runs: one for the whole graph; or, when a read of the value numbered
    `wanted` made the flush, first the ops that value needs and then the rest, so that the read
    waits for the first program alone and the second runs while Python goes on (the backward and
    the optimizer step of a loop that reads `loss.item()` run while the next step is recorded)."""
    input_index = {v: i for i, v in enumerate(input_slots)}
    live_index = {v: i for i, v in enumerate(live)}
    if wanted is not None:
        need = bytearray(n)
        need[wanted] = 1
        first_part = bytearray(len(nodes))
        for k in range(len(nodes) - 1, -1, -1):
            fn, refs, first, count = nodes[k]
            if any(need[first : first + count]):
                first_part[k] = 1
                for r in refs:
                    need[r] = 1
        rest = len(nodes) - sum(first_part)
        if rest >= SPLIT_MIN_REST:
            one = [nd for k, nd in enumerate(nodes) if first_part[k]]
            two = [nd for k, nd in enumerate(nodes) if not first_part[k]]
            made_one, made_two = set(), set()
            for _, _, first, count in one:
                made_one.update(range(first, first + count))
            for _, _, first, count in two:
                made_two.update(range(first, first + count))
            reads_one = sorted({r for nd in one for r in nd[1]} - made_one)
            reads_two = sorted({r for nd in two for r in nd[1]} - made_two)
            outs_one = sorted({v for v in live if v in made_one} | (set(reads_two) & made_one))
            outs_two = [v for v in live if v in made_two]
            later = frozenset(input_index[v] for v in reads_two if v in input_index)
            return [
                _Part(tuple(one), reads_one, outs_one, input_index, live_index, later),
                _Part(tuple(two), reads_two, outs_two, input_index, live_index),
            ]
    return [_Part(tuple(nodes), input_slots, live, input_index, live_index)]


def flush(wanted: Deferred | None = None, queued: int = 1) -> None:
    """Run the recorded ops and give every live Deferred its array. `wanted`, the value whose
    read made the flush, may be computed by a program of its own that runs first (`_plan`).
    `queued`: how many earlier flushes' programs may still wait on the device when these run
    (`_wait_for_earlier_flushes`)."""
    global _GRAPH
    g = _GRAPH
    if not g.nodes:
        return
    _GRAPH = _Graph(g.epoch + 1)
    _wait_for_earlier_flushes(queued)
    live = []
    values = []
    for slot, ref in g.outputs.items():
        d = ref()
        if d is not None:
            live.append(slot)
            values.append(d)
    dead = _dead_inputs(g.inputs)
    # a mesh on the CPU platform waits for every program (backend.state.Config): nothing to overlap
    wanted_slot = wanted.slot if wanted is not None and not CONFIG.sync_dispatch else None
    key = (tuple(g.nodes), tuple(g.input_slots), tuple(live), g.n, wanted_slot)
    parts = _PROGRAMS.get(key)
    if parts is None:
        if len(_PROGRAMS) >= _MAX_PROGRAMS:
            _PROGRAMS.clear()  # graphs that never repeat: keep the cache's memory bounded
        parts = _PROGRAMS[key] = _plan(g.nodes, g.input_slots, live, g.n, wanted_slot)
    FUSED_STATS.flushes += 1
    if _LOG_FLUSHES:
        print(
            f"[torchtpu] fused flush: {len(g.nodes)} ops in {len(parts)} program(s), {len(live)} outputs, from\n"
            + "".join(traceback.format_stack(limit=12)[:-2]),
            file=sys.stderr,
        )
    made: dict = {}  # value number -> array, of what an earlier part returned
    done = 0
    outs = ()
    try:
        for part in parts:
            donate = _donations(part, dead, g.inputs, values) if dead else ()
            program = part.programs.get(donate)
            if program is None:
                body = functools.partial(_program, part.nodes, part.reads, part.outs, g.n)
                program = part.programs[donate] = jax.jit(body, donate_argnums=donate)
                FUSED_STATS.programs += 1
            args = [g.inputs[i] if i >= 0 else made[v] for i, v in zip(part.graph_inputs, part.reads)]
            outs = program(*args)
            del args
            if CONFIG.sync_dispatch:
                # a program over a device mesh on the CPU platform is waited for, as every strict op is
                # there (backend.state.Config)
                outs = jax.block_until_ready(outs)
            FUSED_STATS.runs += 1
            FUSED_STATS.donated += len(donate)
            for v, o in zip(part.outs, outs):
                made[v] = o
            for i in part.returned:
                values[i].value = made[live[i]]
            done += 1
        if outs and not CONFIG.sync_dispatch:
            _IN_FLIGHT.append(min(outs, key=_nbytes))
    except Exception as e:
        for part in parts[done:]:
            for i in part.returned:
                values[i].error = e
        raise


def _nbytes(x) -> int:
    return x.nbytes


def _wait_for_earlier_flushes(queued: int) -> None:
    """Before a flush runs its programs, wait for those of the earlier flushes but the last
    `queued` ones. A loop that reads nothing (an inference loop that keeps its predictions on the
    device) records batches faster than the device computes them; without this each flush would
    queue more programs, and every queued program holds its inputs (the batches) until it runs.
    The flush such a loop makes (a graph past its bound on held inputs, or on ops) lets none
    queue: one graph's programs run while Python records the next. Other flushes let one: a loop
    that reads a value each step never waits here, since its read waited for the programs of the
    flush before."""
    while len(_IN_FLIGHT) > queued:
        x = _IN_FLIGHT.pop(0)
        try:
            if not x.is_deleted():  # donated to a later program, which runs after it
                x.block_until_ready()
        except Exception:  # noqa: BLE001 - that program's own values raise its error when read
            pass


def set_eager_mode(mode: str) -> None:
    """Choose how eager ops run: "strict" (one program per op), "fused" (ops recorded and run
    as one program when a value is needed) or "debug" (strict, each op waited for and checked
    for NaN/Inf). Leaving fused mode runs what was recorded."""
    if mode not in EAGER_MODES:
        raise ValueError(f"unknown torchtpu eager mode {mode!r}: choose one of {', '.join(EAGER_MODES)}")
    if CONFIG.eager_mode == "fused" and mode != "fused":
        flush()
    CONFIG.set_mode(mode)
