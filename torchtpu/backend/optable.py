"""The op table: ATen overload -> pure JAX lowering, bespoke handler, or output fix-up.

A lowering is a plain function with the ATen schema's argument names. Tensor arguments
arrive as JAX arrays (concrete in eager mode, tracers when traced), everything else as the
Python value the schema describes. It returns JAX arrays shaped like the ATen returns.
Lowerings never see views, mutation or devices: the dispatcher handles those.

    @lower(aten.add.Tensor, aten.add.Scalar)
    def add(self, other, alpha=1):
        ...

Options:
- static: names of `Scalar` arguments that must be Python values at trace time (for example
  `arange`'s bounds, which decide the output shape). Every other Scalar is traced, so a
  changing learning rate never recompiles.
- fold: {name: predicate} for `Scalar` arguments that are traced except for the values the
  predicate accepts, which reach the lowering as Python numbers (folded into the program): a
  few values for which a constant gives XLA a cheaper or exacter computation (`x ** 2` as a
  multiplication), each one executable more.
- jit=False: the op has a data-dependent output shape (nonzero, masked_select, unique...). It
  runs op by op on concrete arrays in eager mode and cannot be part of a compiled program.
- random=True: the lowering takes a keyword argument `key`, a JAX PRNG key drawn from the
  device generator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Lowering:
    fn: Callable
    static: frozenset = frozenset()
    jit: bool = True
    random: bool = False
    fold: tuple = ()  # (name, predicate) pairs


LOWERINGS: dict = {}


def lower(*ops, static=(), jit: bool = True, random: bool = False, fold=None):
    def register(fn):
        entry = Lowering(fn, frozenset(static), jit, random, tuple((fold or {}).items()))
        for op in ops:
            if isinstance(op, torch._ops.OpOverloadPacket):
                for name in op.overloads():
                    LOWERINGS.setdefault(getattr(op, name), entry)
            else:
                LOWERINGS[op] = entry
        return fn

    return register


# func -> handler(args, kwargs): ops whose semantics the dispatcher's generic paths do not
# cover (copies between devices, resize_, out= factories, fused modules...)
CUSTOM: dict = {}


def custom(*ops):
    """Register `handler(args, kwargs) -> result` for `ops`, instead of the generic paths."""

    def register(fn):
        for op in ops:
            CUSTOM[op] = fn
        return fn

    return register


# func -> fn(args, out) -> out: fix-ups of an op's wrapped outputs (e.g. strides PyTorch's meta
# function promises that differ from the contiguous layout of a fresh result)
POST: dict = {}


def post(*ops):
    """Register `fn(args, out) -> out` as the fix-up of the wrapped outputs of `ops`."""

    def register(fn):
        for op in ops:
            POST[op] = fn
        return fn

    return register
