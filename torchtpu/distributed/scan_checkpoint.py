"""Per-op selective checkpointing inside scanned blocks (`scan_layers(blocks, save_ops=True)`,
scan.py): the forward loop keeps, stacked per block, the outputs of the ops OpPolicy keeps
(`KeepOps`), and the backward's recomputation gets them back in the same order (`ReplayOps`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..backend import Storage, TpuTensor, array_of, storage_of, storage_order
from ..backend.activation_checkpoint import OpPolicy


class ScanError(RuntimeError):
    pass


def describe_value(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor {tuple(x.shape)} {x.dtype}"
    return type(x).__name__


def _signature(args, kwargs):
    """What must be equal for a kept op's output to stand for its recomputation: its inputs' shapes
    and dtypes, and its other arguments."""
    leaves, spec = tree_flatten((args, kwargs))
    return spec, tuple(
        ("tensor", tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", x) for x in leaves
    )


@dataclasses.dataclass(eq=False)
class KeptOp:
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


class KeepOps(TorchDispatchMode):
    """The forward body's mode: runs every op and records, in order, the outputs of those OpPolicy
    keeps."""

    def __init__(self, policy: OpPolicy):
        super().__init__()
        self.policy = policy
        self.kept: list[KeptOp] = []
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
                    f"scan_layers: {func} in a scanned block returned {describe_value(x)} on {x.device}; per-op selective "
                    "checkpointing keeps tpu tensors only (use activation_checkpoint.mode = 'full')"
                )
            st = storage_of(x)
            base = not x._vw
            values.append(None)
            tensors.append((x.dtype, tuple(x.stride()), st.dist if base else None, storage_order(st) if base else None))
            self.arrays.append(array_of(x))
        self.kept.append(KeptOp(func, _signature(args, kwargs), spec, values, tensors))
        return out


class ReplayOps(TorchDispatchMode):
    """The backward body's mode, during the recomputation: the ops OpPolicy keeps return the
    forward's outputs (this block's row of them), in the order the forward kept them; every other
    op runs. Raises a ScanError at the first kept op that is not the forward's."""

    def __init__(self, kept: list[KeptOp], arrays: list, device_index: int, policy: OpPolicy):
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
        here = KeptOp(func, _signature(args, kwargs), None, [], [])
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
