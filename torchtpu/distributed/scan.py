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

Beside this module: scan_params.py (the stacked parameters and the optimizer's slots over them),
scan_loops.py (the blocks' loops, and their straight-line costing copies) and scan_checkpoint.py
(per-op selective checkpointing).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..backend import TpuTensor, array_of, is_tracing, new_base, storage_array, storage_of, tracing, write
from ..backend import random as tpu_random
from ..backend.activation_checkpoint import OpPolicy, force_recompute_shapes
from .params import get_layout, module_record, scanned_children
from .scan_checkpoint import KeepOps, ReplayOps, ScanError, describe_value
from .scan_loops import blocks_loop, loop_unrolled, straight_line, straight_line_loops
from .scan_params import optimizer_parameters, rows_of_storage, stack_gradients, stacked_parameters

__all__ = [
    "scan_layers",
    "unscan_layers",
    "is_scanned",
    "stacked_parameters",
    "optimizer_parameters",
    "stack_gradients",
    "loop_unrolled",
    "straight_line_loops",
    "ScanError",
]


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
                    f"scan_layers: a buffer of the scanned blocks is {describe_value(b)} on {b.device}"
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
    kept: list | None = None  # the forward body's KeptOp records, in order (set when it is traced)

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


def _stacked_bases(params, n: int, k: int):
    """Per slot, the array of the storage whose rows the n blocks' parameters are (see
    params._materialize_stacked); None unless every slot is stacked so."""
    arrays = []
    for j in range(k):
        views = [params[i * k + j] for i in range(n)]
        if not isinstance(views[0], TpuTensor):
            return None
        st = storage_of(views[0])
        if not rows_of_storage(st, views):
            return None
        arrays.append(storage_array(st))
    return arrays


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
            keep = KeepOps(job.policy()) if job.save_ops else contextlib.nullcontext()
            with torch.no_grad(), keep:
                out, buffers_out = job.call_block(_wrap(carry, dev, h_dtype), param_ts, extra, index, block_buffers)
            if not isinstance(out, TpuTensor) or tuple(out.shape) != tuple(carry.shape) or out.dtype != h_dtype:
                raise ScanError(
                    f"scan_layers: a block must return one tensor shaped like its input {tuple(carry.shape)} "
                    f"{h_dtype}, got {describe_value(out)}"
                )
            # the block's input is the only activation kept for the backward (full recomputation),
            # with per-op selective checkpointing also the outputs of the ops OpPolicy keeps
            kept = []
            if job.save_ops:
                job.kept, kept = keep.kept, keep.arrays
            return array_of(out), (carry, buffers_out, kept)

        indices = jnp.arange(job.n, dtype=jnp.int32)
        xs_weights = weights if by_xs else []
        out, (inputs, buffers_out, kept) = blocks_loop(body, array_of(h), (indices, xs_weights, buffers_in), job.n)
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
            if straight_line():
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
                replay = (
                    ReplayOps(job.kept, block_kept, dev, job.policy()) if job.save_ops else contextlib.nullcontext()
                )
                with replay:
                    out, _ = job.call_block(h_t, param_ts, extra, index, block_buffers)
                if job.save_ops:
                    replay.check_complete()
                grads = torch.autograd.grad(out, [h_t] + param_ts, _wrap(g_carry, dev, h_dtype), allow_unused=True)
            g_h = array_of(grads[0]) if grads[0] is not None else jnp.zeros_like(h_in)
            g_params = [array_of(gp) if gp is not None else jnp.zeros_like(a) for gp, a in zip(grads[1:], layer_params)]
            return g_h, g_params

        indices = jnp.arange(job.n, dtype=jnp.int32)
        g_h, g_stacked = blocks_loop(body, g_arr, (indices, inputs, xs_weights, buffers_in, kept), job.n, reverse=True)
        ctx.saved = None
        grads = [None] * (job.n * k)
        for j in range(k):
            for i in range(job.n):
                if ctx.needs_input_grad[2 + i * k + j]:
                    grads[i * k + j] = _wrap(g_stacked[j][i], dev, job.param_dtypes[j])
        return (None, _wrap(g_h, dev, h_dtype), *grads)
