"""Layer scan: a stack of identical blocks compiled once and run under `jax.lax.scan`.

    scan_layers(model.layers)   # an nn.ModuleDict / nn.ModuleList of identical blocks

After this, inside a `torchtpu.compile`d step a loop such as torchtitan's

    for layer in self.layers.values():
        h = layer(h, freqs_cis, attention_masks=..., positions=...)

traces ONE block and runs it `len(layers)` times in an XLA while loop, so the program (and its
compile time) does not grow with depth. Eager calls (the compiled step's warm-up, inference,
`init_weights`) go block by block, exactly as without the scan.

What the scan leaves as it is:
- Parameters. Every block keeps its own Parameters, so `state_dict()` names, shapes and values,
  checkpoints and each parameter's FSDP/TP layout are untouched. A model materialized from
  `meta` after `scan_layers` (the trainer's way) stores each parameter slot of the blocks as
  one [n_blocks, *shape] storage whose row i is block i's Parameter (a view;
  params._materialize_stacked): the loop body then slices block i's weights from those arrays,
  and an optimizer built on `optimizer_parameters(model)` updates each slot as one tensor after
  `stack_gradients`, so the compiled step does not hold one update per block and parameter
  (the Llama 3 8B step for v5p:2x2x1 compiles in 71-90 s instead of 319 s; docs/DESIGN_NOTES.md). Other models keep one storage per
  parameter; the loop body picks block i's from them (PARAMS_BY below). Either way the program
  holds no second copy of the weights; the gradients come out of the backward loop stacked and
  are handed back per block.
- Module hooks. The loop body runs the first block's own forward, with its hooks (FSDP's
  casts and sharding constraints, TP's activation layouts), on block i's parameters. The
  blocks must therefore be identical: same class and structure, same parameter names, shapes,
  dtypes and layouts, same hooks, which `scan_layers` checks.
- Autograd. The stack is one autograd function. Its backward is a reverse scan whose body
  recomputes the block's forward from the saved block input and runs PyTorch's autograd
  through it (`torch.autograd.grad`), so every op's PyTorch backward (including the layout
  constraints of TP/FSDP gradients and custom autograd functions) applies as in the unrolled
  program. This IS full activation checkpointing of every block: only each block's input is
  kept from the forward. Use the scan where the blocks would be fully recomputed anyway.
- Per-op selective checkpointing (`scan_layers(blocks, save_ops=True)`, torchtitan's
  `selective_ac_option = "op"`): the forward loop also returns, stacked per block, the outputs of
  the ops that activation_checkpoint.OpPolicy keeps (matmuls, attention, ...), recorded in order by
  a dispatch mode; the backward's recomputation gets those values back in the same order instead
  of computing those ops again (autograd still records each op, so its backward runs). A
  recomputation whose kept ops differ from the forward's (another op, or other input shapes or
  dtypes, at some position) raises a ScanError naming them.
- Randomness. Each block draws from its own key (the step's key folded with the block index),
  and the backward's recomputation draws the same values as the forward.
- Buffers (a MoE layer's expert_bias and tokens_per_expert). The loop hands block i its own
  buffers (stacked per slot, one row per block); what the block writes into them in place is
  written back to block i's buffers after the forward loop. The backward's recomputation starts
  from the values block i saw and its writes are dropped, so a block's update happens once per
  forward, as in a block that is not recomputed.

`scan_layers(blocks, start=k)` leaves the first k blocks (DeepSeek-V3's dense layers) outside the
scan: the loop calls them as they are, then the scan runs the identical blocks from k on.

The loop must feed each block's output straight to the next block with the same other
arguments. Anything else (work between blocks, a loop that stops early, other arguments per
block) raises an error naming it instead of computing something different.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..backend import (
    Storage,
    TpuTensor,
    array_of,
    is_tracing,
    new_base,
    row_index,
    storage_array,
    storage_of,
    storage_order,
    tracing,
    write,
)
from ..backend import random as tpu_random
from ..backend.activation_checkpoint import OpPolicy, force_recompute_shapes
from .params import get_layout, module_record, scanned_children

__all__ = [
    "scan_layers",
    "unscan_layers",
    "is_scanned",
    "stacked_parameters",
    "optimizer_parameters",
    "stack_gradients",
    "loop_unrolled",
]


class ScanError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- install


def scan_layers(blocks: nn.Module, start: int = 0, save_ops: bool = False) -> nn.Module:
    """Run the identical blocks of `blocks` (an nn.ModuleDict or nn.ModuleList) under one
    `jax.lax.scan` inside compiled programs. Returns `blocks` (changed in place: same object,
    same children, same state_dict).

    With `start`, the first `start` blocks (DeepSeek-V3's dense layers in front of its MoE blocks)
    run as they are, one by one, and the scan runs the blocks from `start` on, which must be
    identical. With `save_ops`, the backward's recomputation of each block reuses the forward's
    outputs of the ops activation_checkpoint.OpPolicy keeps (per-op selective checkpointing)."""
    if not isinstance(blocks, (nn.ModuleDict, nn.ModuleList)):
        raise TypeError(f"scan_layers takes an nn.ModuleDict or nn.ModuleList of blocks, got {type(blocks).__name__}")
    if is_scanned(blocks):
        return blocks
    children = [m for m in blocks._modules.values() if m is not None]
    if not 0 <= start <= len(children):
        raise ValueError(f"scan_layers: start {start} is not a block index of the {len(children)} blocks")
    children = children[start:]
    if len(children) < 2:
        raise ValueError(f"scan_layers needs at least 2 blocks to scan, got {len(children)}")
    _check_identical(children, start)
    base = type(blocks)
    rec = module_record(blocks, create=True)
    rec.scan_base, rec.scan_start, rec.scan_saves_ops = base, start, save_ops
    blocks.__class__ = _scanned_class(base)
    return blocks


def unscan_layers(blocks: nn.Module) -> nn.Module:
    """Undo `scan_layers`: the blocks run one by one again."""
    record = module_record(blocks)
    if record is not None and record.scan_base is not None:
        blocks.__class__, record.scan_base, record.scan_start = record.scan_base, None, 0
    return blocks


def is_scanned(blocks: nn.Module) -> bool:
    record = module_record(blocks)
    return record is not None and record.scan_base is not None


_CLASSES: dict[type, type] = {}


def _scanned_class(base: type) -> type:
    cls = _CLASSES.get(base)
    if cls is None:
        mixin = _ScannedDict if issubclass(base, nn.ModuleDict) else _ScannedList
        cls = _CLASSES[base] = type(f"Scanned{base.__name__}", (mixin, base), {})
    return cls


class _ScannedDict:
    """ModuleDict whose values() yields, while a program is being traced, a scan of all blocks."""

    def values(self):
        if is_tracing():
            return _Run(self).callables()
        return super().values()


class _ScannedList:
    def __iter__(self):
        if is_tracing():
            return _Run(self).callables()
        return super().__iter__()


def _structure(block: nn.Module):
    """What must be equal between blocks for one block's trace to stand for all of them."""
    out = []
    for path, m in block.named_modules():
        hooks = (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks))
        fsdp = getattr(module_record(m), "fsdp", None)
        mp = fsdp.mp_policy if fsdp is not None else None
        out.append(("module", path, type(m), hooks, mp))
        for name, p in m._parameters.items():
            if p is None:
                continue
            rec = get_layout(m, name)
            layout = None if rec is None or rec.mesh is None else (id(rec.mesh.jax_mesh), rec.spec)
            out.append(("param", path, name, tuple(p.shape), p.dtype, p.requires_grad, layout))
        for name, b in m._buffers.items():
            if b is not None:
                out.append(("buffer", path, name, tuple(b.shape), b.dtype))
    return out


def _check_identical(children, start: int = 0) -> None:
    first = _structure(children[0])
    for i, c in enumerate(children[1:], start + 1):
        other = _structure(c)
        if other != first:
            diff = next((a, b) for a, b in zip(first + [None] * len(other), other + [None] * len(first)) if a != b)
            raise ValueError(
                f"scan_layers: block {i} differs from block {start} ({diff[1]} vs {diff[0]}); only identical "
                "blocks (same class, parameters, buffers, layouts and hooks) can be scanned"
            )


# ----------------------------------------------------------------------------- stacked storage


def _rows_of(base: TpuTensor, views) -> bool:
    """Whether `views` are, in order, the rows of `base` (views[i] is base.select(0, i))."""
    return not base._vw and _rows_of_storage(storage_of(base), views)


def _rows_of_storage(st, views) -> bool:
    if tuple(st.shape) != (len(views), *tuple(views[0].shape)):
        return False
    return all(isinstance(v, TpuTensor) and storage_of(v) is st and row_index(v) == i for i, v in enumerate(views))


def stacked_parameters(model: nn.Module) -> list[tuple[TpuTensor, list]]:
    """(stacked storage tensor, the blocks' Parameters that are its rows) for every parameter slot
    of `model`'s scanned blocks that `materialize` stacked and that still are its rows."""
    out = []
    for mod in model.modules():
        rec = module_record(mod)
        if rec is None or not rec.stacked:
            continue
        children = scanned_children(mod, rec)
        for slot, base in rec.stacked.items():
            path, _, name = slot.rpartition(".")
            views = [c.get_submodule(path)._parameters.get(name) for c in children]
            if all(v is not None for v in views) and _rows_of(base, views):
                out.append((base, views))
    return out


def optimizer_parameters(model: nn.Module, groups=None) -> list:
    """`model.parameters()` with each stacked slot's block Parameters replaced, where the first of
    them stood, by the slot's stacked tensor (a leaf that `stack_gradients` gives a gradient): what
    an optimizer should update so that a compiled step holds one update per slot.

    Each stacked tensor's `requires_grad` is set to its rows' here, when the optimizer is built: a
    slot frozen after `materialize` (requires_grad_(False) on all its Parameters) is frozen in the
    optimizer too. A slot with frozen and trainable rows is refused: one update of the stacked
    tensor would also move the frozen rows (weight decay acts without a gradient)."""
    groups = stacked_parameters(model) if groups is None else groups
    for base, views in groups:
        if len({bool(v.requires_grad) for v in views}) > 1:
            frozen = [i for i, v in enumerate(views) if not v.requires_grad]
            raise ValueError(
                f"scan: the stacked parameter slot {tuple(base.shape)} mixes frozen blocks {frozen} with trainable "
                "ones; an optimizer over the stacked slots would update the frozen rows too. Freeze a slot in every "
                "block, or build the optimizer on model.parameters() (each block's own tensors)"
            )
    first = {id(views[0]): base for base, views in groups}
    rows = {id(v) for _, views in groups for v in views}
    out = []
    for p in model.parameters():
        if id(p) in first:
            base = first[id(p)]
            base.requires_grad_(p.requires_grad)
            out.append(base)
        elif id(p) not in rows:
            out.append(p)
    return out


def stack_gradients(groups, model: nn.Module | None = None) -> None:
    """Move the blocks' gradients of each stacked slot onto the slot's stacked tensor (its .grad
    becomes their stack; theirs becomes None), so the optimizer and gradient clipping see them as one.

    With `model`, first check that `groups` are still its stacked slots: an optimizer built on
    stacked tensors whose rows are not the model's parameters would update nothing the
    model uses."""
    if model is not None:
        now = {(id(b), tuple(map(id, vs))) for b, vs in stacked_parameters(model)}
        if now != {(id(b), tuple(map(id, vs))) for b, vs in groups}:
            raise RuntimeError(
                "the scanned blocks' parameters were replaced after the optimizer was built on their stacked "
                "storage; build the optimizer again (scan.optimizer_parameters) or write new values in place "
                "(load_state_dict without assign=True, copy_)"
            )
    for base, views in groups:
        grads = [v.grad for v in views]
        if all(g is None for g in grads):
            base.grad = None
            continue
        if any(g is None for g in grads):
            # a row without a gradient is one PyTorch's optimizer would skip; a zero in the stack
            # would still be decayed and moved by its moments
            missing = [i for i, g in enumerate(grads) if g is None]
            raise RuntimeError(
                f"scan: blocks {missing} of the stacked parameter slot {tuple(base.shape)} have no gradient while the "
                "others have one (frozen after the optimizer was built?); one stacked update cannot skip them. Freeze "
                "a slot in every block and build the optimizer again (scan.optimizer_parameters)"
            )
        base.grad = torch.stack(grads)
        for v in views:
            v.grad = None


# ----------------------------------------------------------------------------- one traced pass


class _Run:
    """One pass of a traced loop over the blocks: the first callable runs the whole scan, the
    others check that they are called in order on its result and pass it on."""

    def __init__(self, blocks):
        rec = module_record(blocks)
        self.before = [m for m in blocks._modules.values() if m is not None][: rec.scan_start]
        self.children = scanned_children(blocks, rec)
        self.save_ops = rec.scan_saves_ops
        self.result = None
        self.args = None
        self.called = 0

    def callables(self):
        yield from self.before  # the blocks in front of the scanned run, called as they are
        yield self._first
        for i in range(1, len(self.children)):
            yield _PassThrough(self, i)

    def _first(self, h, *args, **kwargs):
        self.called = 1
        self.args = (args, kwargs)
        self.result = _scan_blocks(self, h, args, kwargs)
        return self.result

    def check_complete(self):
        n = len(self.children)
        if self.called != n:
            raise ScanError(
                f"scan_layers: the loop over the {n} scanned blocks stopped after {self.called} of them, but the scan "
                "ran all of them; scanned blocks must all be called in one loop (turn the layer scan off, "
                "[tpu] scan_layers = false, for models that skip blocks)"
            )


class _PassThrough:
    def __init__(self, run: _Run, index: int):
        self.run = run
        self.index = index

    def __call__(self, h, *args, **kwargs):
        run = self.run
        i = len(run.before) + self.index  # the block's index among all the blocks
        if h is not run.result or run.called != self.index:
            raise ScanError(
                f"scan_layers: block {i} was not called on block {i - 1}'s output; a scanned loop "
                "must feed each block's output straight to the next block (turn the layer scan off, "
                "[tpu] scan_layers = false, for models that do work between blocks)"
            )
        a0, k0 = run.args
        if (
            len(args) != len(a0)
            or any(x is not y for x, y in zip(args, a0))
            or k0.keys() != kwargs.keys()
            or any(kwargs[k] is not k0[k] for k in k0)
        ):
            raise ScanError(
                f"scan_layers: block {i} got other arguments than block {len(run.before)}; scanned blocks must all "
                "get the same extra arguments (turn the layer scan off, [tpu] scan_layers = false)"
            )
        run.called += 1
        return h

    def __getattr__(self, name):
        raise ScanError(
            f"scan_layers: attribute {name!r} of a scanned block was read while tracing the loop over "
            "the blocks; scanned loops may only call the blocks (turn the layer scan off, "
            "[tpu] scan_layers = false)"
        )


# ----------------------------------------------------------------------------- the scan


def _param_slots(block: nn.Module):
    """(owner module, name) of each parameter of `block`, in a fixed order."""
    return [(m, n) for _, m in block.named_modules() for n, p in m._parameters.items() if p is not None]


def _buffer_slots(block: nn.Module):
    """(owner module, name) of each buffer of `block` (a MoE layer's expert_bias and
    tokens_per_expert), in a fixed order."""
    return [(m, n) for _, m in block.named_modules() for n, b in m._buffers.items() if b is not None]


def _scan_blocks(run: _Run, h, args, kwargs):
    if not isinstance(h, TpuTensor):
        raise TypeError(f"scan_layers: the blocks' input must be a tpu tensor, got {type(h).__name__} on {h.device}")
    flat, spec = tree_flatten((args, kwargs))
    for x in flat:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise NotImplementedError(
                "scan_layers: an argument of the scanned blocks other than the first requires grad; the layer scan "
                "differentiates only the carried activation and the parameters (turn it off: [tpu] scan_layers = false)"
            )
    template = run.children[0]
    slots = _param_slots(template)
    per_block = [[m._parameters[n] for m, n in _param_slots(c)] for c in run.children]
    params = [p for ps in per_block for p in ps]
    buffers = [[m._buffers[n] for m, n in _buffer_slots(c)] for c in run.children]
    for bs in buffers:
        for b in bs:
            if not isinstance(b, TpuTensor) or b.requires_grad:
                raise NotImplementedError(
                    f"scan_layers: a buffer of the scanned blocks is {_describe(b)} on {b.device}"
                    f"{' requiring grad' if b.requires_grad else ''}; the layer scan carries tpu buffers without "
                    "gradients only (turn it off: [tpu] scan_layers = false)"
                )
    if tpu_random.TRACED is not None:
        key = tpu_random.TRACED.next()
    else:
        key = tpu_random.next_key_data(storage_of(h).device_index)
    job = _Job(
        run,
        template,
        slots,
        len(run.children),
        flat,
        spec,
        key,
        storage_of(h).device_index,
        [p.dtype for p in per_block[0]],
        _buffer_slots(template),
        buffers,
        run.save_ops,
    )
    return _ScanFunction.apply(job, h, *params)


@dataclasses.dataclass(eq=False)
class _Job:
    """What one scan over the blocks needs besides the carried activation and the parameters."""

    run: _Run
    template: nn.Module  # the first block: its code runs every iteration, on that iteration's parameters
    slots: list  # (owner module, name) of each of the template's parameters
    n: int  # blocks
    flat: list  # the blocks' other arguments, flattened
    spec: TreeSpec  # how `flat` unflattens into (args, kwargs)
    key: object  # key data the random ops in the blocks (dropout) draw from
    device_index: int
    param_dtypes: list  # dtypes of one block's parameters
    buffer_slots: list  # (owner module, name) of each of the template's buffers
    buffers: list  # per block, its buffers (the tensors the scan writes back)
    save_ops: bool = False  # per-op selective checkpointing: keep the outputs of OpPolicy's ops
    kept: list | None = None  # the forward body's _Kept records, in order (set when it is traced)

    def policy(self) -> OpPolicy:
        """A fresh per-op policy for one run of the block (its matmul count starts at zero)."""
        return OpPolicy(force_recompute_shapes(self.template))

    def extra_arrays(self):
        return [array_of(x) if isinstance(x, TpuTensor) else x for x in self.flat]

    def buffer_inputs(self):
        """Per buffer slot, the blocks' values stacked [n, *shape]: what the loop hands block i."""
        return [jnp.stack([array_of(bs[j]) for bs in self.buffers]) for j in range(len(self.buffer_slots))]

    def call_block(self, h_t, param_ts, extra, index, buffer_arrays):
        """Run the template block on tensors wrapping this iteration's values (parameters and
        buffers); returns its output and the block's buffers' values after it ran (a block updates
        them in place, as a MoE layer adds its token counts)."""
        flat = [
            new_base(a, self.device_index, x.dtype) if isinstance(x, TpuTensor) else x for a, x in zip(extra, self.flat)
        ]
        args, kwargs = tree_unflatten(flat, self.spec)
        saved = [m._parameters[n] for m, n in self.slots]
        saved_buffers = [m._buffers[n] for m, n in self.buffer_slots]
        prev_keys = tpu_random.TRACED
        tpu_random.TRACED = tpu_random.TracedKeys(
            jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(self.key), index))
        )
        try:
            for (m, n), t in zip(self.slots, param_ts):
                m._parameters[n] = t
            for (m, n), a, b in zip(self.buffer_slots, buffer_arrays, saved_buffers):
                m._buffers[n] = new_base(a, self.device_index, b.dtype)
            with tracing():
                out = self.template(h_t, *args, **kwargs)
            return out, [array_of(m._buffers[n]) for m, n in self.buffer_slots]
        finally:
            tpu_random.TRACED = prev_keys
            for (m, n), p in zip(self.slots, saved):
                m._parameters[n] = p
            for (m, n), b in zip(self.buffer_slots, saved_buffers):
                m._buffers[n] = b


def _wrap(a, device_index, dtype, requires_grad=False):
    t = new_base(a, device_index, dtype)
    if requires_grad:
        t.requires_grad_(True)
    return t


# How the loop body gets block i's parameters:
# "select" (default): the per-block arrays are loop invariants and a switch on i picks block i's, so
#   the program holds no second copy of the weights (one block's worth per iteration). On the
#   Llama 3 8B step (FSDP over v5p:2x2x1) this needs 3.1 GiB less HBM per chip than "stack"
#   (43.44 vs 46.57 GiB; the float32 stack and a bfloat16 copy of it are gone) and compiles faster.
# "stack": the arrays are stacked along a new leading dim and the loop slices them (a copy of
#   every block's weights while the step runs).
#   bench/scan_layers.py compares the two; tests/distributed/test_scan_layers.py runs both.
PARAMS_BY = "select"


def _layer_params(per_block, index):
    """Block `index`'s parameter arrays, picked from per-block arrays inside the loop."""
    if len(per_block) == 1:
        return list(per_block[0])
    branches = [lambda ps=ps: tuple(ps) for ps in per_block]
    return list(jax.lax.switch(index, branches))


def _layer_rows(bases, index):
    """Row `index` of each stacked array, multiplied by a 1 that XLA cannot see is 1.

    A plain slice lets XLA move the block's casts (FSDP's bfloat16 compute copy) in front of the
    loops, converting every whole stacked array once: a low-precision copy of all blocks'
    weights held through the step (3.2 GiB per chip more on the Llama 3 8B step on v5p:2x2x1).
    Neither an optimization barrier on the rows nor a switch over static slices stops it. The
    product with a 1 computed from the loop index is exact and fuses with the cast, which then
    stays in the loop, one block's weights at a time."""
    out = []
    for b in bases:
        row = jax.lax.dynamic_index_in_dim(b, index, keepdims=False)
        if jnp.issubdtype(b.dtype, jnp.floating):
            row = row * (index >= 0).astype(b.dtype)
            # the row leaves here without its stacked dim: left to XLA, the unit dim stays on up
            # to FSDP's all-gather, which then gathers (1, E, ...) and lays it out gathered dim
            # major, and a copy of the whole gathered weight restores the usual layout (Qwen3
            # 30B-A3B: the experts' 0.4 GB, forward and backward, in every layer)
            (row,) = jax.lax.optimization_barrier((row,))
        out.append(row)
    return out


def loop_unrolled() -> bool:
    """Whether the blocks' loops are unrolled here: only on CPU devices of several processes, for
    an XLA:CPU defect (elsewhere they are `lax.scan` loops).

    XLA:CPU orders a program's collectives by *scheduling* edges: a collective may start once the
    one before it has started. A plain collective runs to its end before the next starts, but a
    while loop is asynchronous, so a collective after the loop that does not read its results
    (the final norm's and the output projection's FSDP all-gathers in the evaluation step) runs
    while the loop's own all-gathers do. Within one process each collective meets its peers by
    its op id, so that is harmless; across processes XLA:CPU runs them on gloo with one tag for
    all, the two streams of messages interleave differently on each host, and gloo aborts
    ("Received data size doesn't match expected size"). Unrolled, the blocks are straight-line
    code with no loop, the same arithmetic (tests/launch/test_launch.py checks the losses against
    the unscanned job), a compile time that grows with depth again, and the same stacked
    storage and checkpoints."""
    return jax.process_count() > 1 and jax.devices()[0].platform == "cpu"


_STRAIGHT_LINE = [False]


@contextlib.contextmanager
def straight_line_loops(unroll: bool | int = True):
    """Within this block, programs traced run the blocks' loops fully unrolled (`lax.scan`'s
    unroll=True): the scanned program's own structure (stacked weights, the forward's kept
    outputs, the backward's recomputation) as straight-line code, whose cost XLA counts in full
    where it counts a loop body once (the step estimate's costing copies). `unroll=k` instead
    keeps the loops with k blocks per iteration, each block reading its own row of the stacked
    inputs and writing its own row of the stacked outputs as a one-block iteration does
    (`_blocks_loop`), so XLA's cost of a k-block body less a 1-block one is k - 1 blocks as the
    loop runs them (`bench.step_estimate --loop`)."""
    prev = _STRAIGHT_LINE[0]
    _STRAIGHT_LINE[0] = unroll
    try:
        yield
    finally:
        _STRAIGHT_LINE[0] = prev


def _straight_line() -> bool:
    """Whether the blocks' loops are unrolled into straight-line code here (`_blocks_loop`)."""
    return loop_unrolled() or _STRAIGHT_LINE[0] is True


def _blocks_loop(body, init, xs, n: int, reverse: bool = False):
    """`lax.scan(body, init, xs, reverse=reverse)` over the n blocks: a loop of one block per
    iteration, unrolled into straight-line code where `loop_unrolled` or `straight_line_loops()`
    says so, and with k blocks per iteration under `straight_line_loops(k)`.

    The k-block loop is not `lax.scan`'s `unroll=k`, which reshapes every stacked input and output
    to (n / k, k, ...) and slices and writes a group of k rows per iteration: XLA adds copies for
    those groups (a toy FSDP stack of matmul blocks on v5p: 8% more per block than one block per
    iteration). Here each block of an iteration slices row i of the stacked inputs and writes row
    i of the stacked outputs, the ops a one-block iteration runs."""
    k = _STRAIGHT_LINE[0]
    if _straight_line():
        return jax.lax.scan(body, init, xs, reverse=reverse, unroll=True)
    if not k or k == 1:
        return jax.lax.scan(body, init, xs, reverse=reverse)
    if n % k:
        raise ValueError(f"straight_line_loops({k}): {n} blocks do not split into iterations of {k}")

    def row(i):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs)

    _, out_row = jax.eval_shape(body, init, row(0))
    outs = jax.tree.map(lambda s: jnp.zeros((n, *s.shape), s.dtype), out_row)

    def iteration(state, t):
        carry, outs = state
        for j in range(k):
            i = t * k + (k - 1 - j if reverse else j)
            carry, y = body(carry, row(i))
            outs = jax.tree.map(lambda o, v, i=i: jax.lax.dynamic_update_index_in_dim(o, v, i, 0), outs, y)
        return (carry, outs), None

    (carry, outs), _ = jax.lax.scan(iteration, (init, outs), jnp.arange(n // k, dtype=jnp.int32), reverse=reverse)
    return carry, outs


def _stacked_bases(params, n: int, k: int):
    """Per slot, the array of the storage whose rows the n blocks' parameters are (see
    params._materialize_stacked); None unless every slot is stacked so."""
    arrays = []
    for j in range(k):
        views = [params[i * k + j] for i in range(n)]
        if not isinstance(views[0], TpuTensor):
            return None
        st = storage_of(views[0])
        if not _rows_of_storage(st, views):
            return None
        arrays.append(storage_array(st))
    return arrays


# ----------------------------------------------------------------------------- per-op selective checkpointing


def _signature(args, kwargs):
    """What must be equal for a kept op's output to stand for its recomputation: its inputs' shapes
    and dtypes, and its other arguments."""
    leaves, spec = tree_flatten((args, kwargs))
    return spec, tuple(
        ("tensor", tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", x) for x in leaves
    )


@dataclasses.dataclass(eq=False)
class _Kept:
    """One op output the forward body kept: the op, its inputs' signature, the output's structure,
    and per leaf either its value (a leaf that is no tensor) or its tensor's dtype, strides and
    storage layout (the array is a row of the forward loop's outputs)."""

    func: object
    signature: tuple
    spec: TreeSpec | None
    leaves: list  # per leaf: its value, or None for a tensor
    tensors: list  # per leaf: None, or (dtype, strides, storage layout, storage memory order)

    def describe(self) -> str:
        shapes = [s[1:] for s in self.signature[1] if s[0] == "tensor"]
        return f"{self.func} on {', '.join(f'{tuple(sh)} {dt}' for sh, dt in shapes) or 'no tensors'}"


class _Keep(TorchDispatchMode):
    """The forward body's mode: runs every op and records, in order, the outputs of those OpPolicy
    keeps."""

    def __init__(self, policy: OpPolicy):
        super().__init__()
        self.policy = policy
        self.kept: list[_Kept] = []
        self.arrays: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.policy.saves(func, args):
            return out
        leaves, spec = tree_flatten(out)
        values, tensors = [], []
        for x in leaves:
            if not isinstance(x, torch.Tensor):
                values.append(x)
                tensors.append(None)
                continue
            if not isinstance(x, TpuTensor):
                raise ScanError(
                    f"scan_layers: {func} in a scanned block returned {_describe(x)} on {x.device}; per-op selective "
                    "checkpointing keeps tpu tensors only (use activation_checkpoint.mode = 'full')"
                )
            st = storage_of(x)
            base = not x._vw
            values.append(None)
            tensors.append((x.dtype, tuple(x.stride()), st.dist if base else None, storage_order(st) if base else None))
            self.arrays.append(array_of(x))
        self.kept.append(_Kept(func, _signature(args, kwargs), spec, values, tensors))
        return out


class _Replay(TorchDispatchMode):
    """The backward body's mode, during the recomputation: the ops OpPolicy keeps return the
    forward's outputs (this block's row of them), in the order the forward kept them; every other
    op runs. Raises a ScanError at the first kept op that is not the forward's."""

    def __init__(self, kept: list[_Kept], arrays: list, device_index: int, policy: OpPolicy):
        super().__init__()
        self.policy = policy
        self.kept = kept
        self.arrays = arrays
        self.device_index = device_index
        self.pos = 0
        self.next_array = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.policy.saves(func, args):
            return func(*args, **kwargs)
        i = self.pos
        here = _Kept(func, _signature(args, kwargs), None, [], [])
        if i >= len(self.kept):
            raise ScanError(
                f"scan_layers: the backward's recomputation of a block ran {here.describe()} as kept op {i}, but the "
                f"forward kept only {len(self.kept)} ops; the block computes other ops with gradients on "
                "(use activation_checkpoint.mode = 'full')"
            )
        rec = self.kept[i]
        if rec.func is not func or rec.signature != here.signature:
            raise ScanError(
                f"scan_layers: the backward's recomputation of a block ran {here.describe()} as kept op {i}, where "
                f"the forward ran {rec.describe()}; the block computes other ops with gradients on "
                "(use activation_checkpoint.mode = 'full')"
            )
        self.pos += 1
        leaves = []
        for value, meta in zip(rec.leaves, rec.tensors):
            if meta is None:
                leaves.append(value)
                continue
            dtype, strides, dist, order = meta
            a = self.arrays[self.next_array]
            self.next_array += 1
            st = Storage(a, tuple(a.shape), dtype, self.device_index)
            st.dist = dist
            if order is not None:
                st.order = order
            leaves.append(TpuTensor(st, (), tuple(a.shape), dtype, strides=strides))
        return tree_unflatten(leaves, rec.spec)

    def check_complete(self):
        if self.pos != len(self.kept):
            raise ScanError(
                f"scan_layers: the backward's recomputation of a block ran {self.pos} of the {len(self.kept)} ops the "
                f"forward kept (the next was {self.kept[self.pos].describe()}); the block computes other ops with "
                "gradients on (use activation_checkpoint.mode = 'full')"
            )


class _ScanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, job: _Job, h, *params):
        k = len(job.slots)
        dev = job.device_index
        bases = _stacked_bases(params, job.n, k)
        if bases is not None:
            # the blocks' parameters are the rows of one storage per slot: the body slices row i
            # (_layer_rows), so the program holds no second copy of the weights
            by_xs, weights = False, bases
        else:
            per_block = [[array_of(params[i * k + j]) for j in range(k)] for i in range(job.n)]
            by_xs = PARAMS_BY == "stack"
            weights = [jnp.stack([per_block[i][j] for i in range(job.n)]) for j in range(k)] if by_xs else per_block
        extra = job.extra_arrays()
        buffers_in = job.buffer_inputs()
        h_dtype = h.dtype

        def params_at(index, xs_weights):
            if bases is not None:
                return _layer_rows(bases, index)
            return list(xs_weights) if by_xs else _layer_params(weights, index)

        def body(carry, xs):
            index, xs_weights, block_buffers = xs
            param_ts = [_wrap(a, dev, dt) for a, dt in zip(params_at(index, xs_weights), job.param_dtypes)]
            keep = _Keep(job.policy()) if job.save_ops else contextlib.nullcontext()
            with torch.no_grad(), keep:
                out, buffers_out = job.call_block(_wrap(carry, dev, h_dtype), param_ts, extra, index, block_buffers)
            if not isinstance(out, TpuTensor) or tuple(out.shape) != tuple(carry.shape) or out.dtype != h_dtype:
                raise ScanError(
                    f"scan_layers: a block must return one tensor shaped like its input {tuple(carry.shape)} "
                    f"{h_dtype}, got {_describe(out)}"
                )
            # the block's input is the only activation kept for the backward (full recomputation),
            # with per-op selective checkpointing also the outputs of the ops OpPolicy keeps
            kept = []
            if job.save_ops:
                job.kept, kept = keep.kept, keep.arrays
            return array_of(out), (carry, buffers_out, kept)

        indices = jnp.arange(job.n, dtype=jnp.int32)
        xs_weights = weights if by_xs else []
        out, (inputs, buffers_out, kept) = _blocks_loop(body, array_of(h), (indices, xs_weights, buffers_in), job.n)
        # each block's buffers as its forward left them, written back per block; the backward's
        # recomputation starts from the values each block saw and its buffer writes are dropped,
        # so a block's update happens once per step, as in an unrecomputed forward
        with torch.no_grad():
            for i, bs in enumerate(job.buffers):
                for j, b in enumerate(bs):
                    write(b, buffers_out[j][i])
        ctx.job = job
        ctx.saved = (weights if by_xs else [], params_at, inputs, extra, buffers_in, kept)
        ctx.h_dtype = h_dtype
        return _wrap(out, dev, h_dtype)

    @staticmethod
    def backward(ctx, g):
        job = ctx.job
        job.run.check_complete()
        xs_weights, params_at, inputs, extra, buffers_in, kept = ctx.saved
        dev = job.device_index
        h_dtype = ctx.h_dtype
        k = len(job.slots)
        g_arr = array_of(g) if g is not None else jnp.zeros(inputs.shape[1:], inputs.dtype)

        def body(g_carry, xs):
            index, h_in, xs_weights, block_buffers, block_kept = xs
            layer_params = params_at(index, xs_weights)
            if _straight_line():
                # unrolled (the dry run's costing copies; across CPU processes, loop_unrolled),
                # the recomputation reads the very values the forward computed from (its input,
                # the kept outputs, the weights) and XLA would merge the ops they have in common,
                # which a loop recomputes in its backward body: the barrier keeps the loop's
                # arithmetic (Qwen3 30B-A3B on v5p:2x2x4: the dispatch's sorts and much elementwise
                # work, 11% of a layer; docs/dry-run.md, "How the step is costed")
                h_in, layer_params, block_buffers, block_kept = jax.lax.optimization_barrier(
                    (h_in, layer_params, block_buffers, block_kept)
                )
            h_t = _wrap(h_in, dev, h_dtype, requires_grad=True)
            param_ts = [_wrap(a, dev, dt, requires_grad=True) for a, dt in zip(layer_params, job.param_dtypes)]
            with torch.enable_grad():
                replay = _Replay(job.kept, block_kept, dev, job.policy()) if job.save_ops else contextlib.nullcontext()
                with replay:
                    out, _ = job.call_block(h_t, param_ts, extra, index, block_buffers)
                if job.save_ops:
                    replay.check_complete()
                grads = torch.autograd.grad(out, [h_t] + param_ts, _wrap(g_carry, dev, h_dtype), allow_unused=True)
            g_h = array_of(grads[0]) if grads[0] is not None else jnp.zeros_like(h_in)
            g_params = [array_of(gp) if gp is not None else jnp.zeros_like(a) for gp, a in zip(grads[1:], layer_params)]
            return g_h, g_params

        indices = jnp.arange(job.n, dtype=jnp.int32)
        g_h, g_stacked = _blocks_loop(body, g_arr, (indices, inputs, xs_weights, buffers_in, kept), job.n, reverse=True)
        ctx.saved = None
        grads = [None] * (job.n * k)
        for j in range(k):
            for i in range(job.n):
                if ctx.needs_input_grad[2 + i * k + j]:
                    grads[i * k + j] = _wrap(g_stacked[j][i], dev, job.param_dtypes[j])
        return (None, _wrap(g_h, dev, h_dtype), *grads)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor {tuple(x.shape)} {x.dtype}"
    return type(x).__name__
