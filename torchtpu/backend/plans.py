"""Op plans: how the dispatcher handles an ATen overload, classified once from its schema.

- view ops return a tensor sharing the input's storage, with one more view step;
- in-place-view ops (transpose_, squeeze_...) change a tensor's metadata and view chain;
- mutating ops (add_, add.out, _foreach_mul_, copy_...) compute the new values of the
  mutated arguments functionally, then write them back through the storage;
- functional ops compute fresh outputs;
- custom ops have a bespoke handler (optable.custom); composite ops run their ATen
  decomposition.
"""

from __future__ import annotations

import functools

import torch

from .optable import CUSTOM, LOWERINGS, POST

aten = torch.ops.aten


# Python numbers in these positions are traced: Scalar arguments, and Tensor arguments that
# PyTorch lets callers pass a Python number for (`x * 0.1` reaches mul.Tensor with a float).
SCALAR_TYPES = ("number", "Optional[number]", "Tensor", "Optional[Tensor]")
# The foreach ops' Scalar lists too: an optimizer passes per-step values there (AdamW's bias
# corrections), which as part of the cache key would compile the op again every step.
SCALAR_LIST_OPS = "aten::_foreach_"


def _traced_type(schema, a) -> bool:
    t = str(a.type)
    return t in SCALAR_TYPES or (t == "List[number]" and schema.name.startswith(SCALAR_LIST_OPS))


# Ops that make a tensor "like" their input: the result keeps the input's mesh layout (so
# optimizer moments made with zeros_like(param) are sharded like the parameter).
_LIKE_OPS = frozenset(
    [f"aten::{n}_like" for n in ("zeros", "ones", "full", "empty", "rand", "randn", "randint")] + ["aten::clone"]
)


class OpPlan:
    __slots__ = (
        "func",
        "kind",
        "arg_names",
        "dyn_pos",
        "dyn_kw",
        "impl",
        "mutated",
        "returns_alias",
        "functional",
        "lowering",
        "random",
        "jit",
        "name",
        "executables",
        "like",
        "int_returns",
        "post",
        "plain",
        "fold",
    )


_PLANS: dict = {}


def _functional_variant(func):
    """aten.add_.Tensor -> aten.add.Tensor; aten.add.out -> aten.add.Tensor; None if none."""
    schema = func._schema
    name = schema.name.split("::")[1]
    packet_name = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    packet = getattr(aten, packet_name, None)
    if packet is None:
        return None
    # the functional twin takes the same arguments minus the out= tensors
    want = [
        (a.name, str(a.type)) for a in schema.arguments if not (a.alias_info and a.alias_info.is_write and a.kwarg_only)
    ]
    candidates = [getattr(packet, o) for o in packet.overloads()]
    candidates = [c for c in candidates if c is not func and not c._schema.is_mutable]
    for cand in candidates:
        if [(a.name, str(a.type)) for a in cand._schema.arguments] == want:
            return cand
    # loose match on names only (types may differ, as Tensor vs Tensor?)
    for cand in candidates:
        if [a.name for a in cand._schema.arguments] == [n for n, _ in want]:
            return cand
    return None


def new_plan(func) -> OpPlan:
    """A plan of `func` made now from its schema and the op table (not cached: see plan_for)."""
    p = OpPlan()
    p.func = func
    p.impl = None
    p.executables = {}
    p.name = str(func)
    schema = func._schema
    p.like = schema.name in _LIKE_OPS
    p.post = POST.get(func)
    p.int_returns = tuple(i for i, r in enumerate(schema.returns) if str(r.type) in ("SymInt", "int"))
    p.arg_names = [a.name for a in schema.arguments]
    p.lowering = LOWERINGS.get(func)
    static = p.lowering.static if p.lowering else frozenset()
    p.dyn_pos = frozenset(
        i
        for i, a in enumerate(schema.arguments)
        if _traced_type(schema, a) and not a.kwarg_only and a.name not in static
    )
    p.dyn_kw = frozenset(
        a.name for a in schema.arguments if _traced_type(schema, a) and a.kwarg_only and a.name not in static
    )
    # the traced Scalars some of whose values are folded (optable.lower's fold), by position and
    # by name (a keyword-only argument); None for the many ops with none
    p.fold = None
    if p.lowering and p.lowering.fold:
        names = {a.name: (a.name if a.kwarg_only else i) for i, a in enumerate(schema.arguments)}
        p.fold = {names[name]: keep for name, keep in p.lowering.fold}
    p.random = bool(p.lowering and p.lowering.random)
    p.jit = not (p.lowering and not p.lowering.jit)
    p.mutated = [i for i, a in enumerate(schema.arguments) if a.alias_info and a.alias_info.is_write]
    p.functional = None
    rets = schema.returns
    p.returns_alias = []
    for r in rets:
        idx = None
        if r.alias_info is not None:
            for i, a in enumerate(schema.arguments):
                if a.alias_info and set(a.alias_info.before_set) & set(r.alias_info.before_set):
                    idx = i
                    break
        p.returns_alias.append(idx)
    if func in CUSTOM:
        p.kind = "custom"
    elif p.lowering is None and func not in decomposition_table() and has_composite_implicit(func):
        # CompositeImplicitAutograd ops reach the Python key when autograd is excluded
        # (inside other ops' dispatch): run their decomposition at the ATen level.
        p.kind = "composite"
    elif torch._C.Tag.inplace_view in func.tags:
        p.kind = "inplace_view"
    elif p.mutated:
        p.kind = "mutating"
        if p.lowering is None:
            p.functional = _functional_variant(func)
            if p.functional is not None:
                fp = _PLANS.get(p.functional) or new_plan(p.functional)
                _PLANS[p.functional] = fp
                p.random = fp.random
                p.jit = fp.jit
    elif any(r.alias_info is not None and not r.alias_info.is_write for r in rets):
        p.kind = "view"
    else:
        p.kind = "functional"
    # a functional op whose eager call is only: flatten, run the cached executable, wrap fresh
    # tensors (handlers.dispatch's fast path)
    p.plain = p.kind == "functional" and p.jit and not p.random and not p.like and p.post is None and not p.int_returns
    return p


def plan_for(func) -> OpPlan:
    p = _PLANS.get(func)
    if p is None:
        p = _PLANS[func] = new_plan(func)
    return p


def forget_plan(func) -> None:
    """Drop the cached plans of `func` (the table's, and the one handlers.dispatch keeps on the
    overload), so that its next call plans it again."""
    _PLANS.pop(func, None)
    func.__dict__.pop("_tpu_plan", None)


def has_composite_implicit(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


@functools.cache
def decomposition_table():
    from torch._decomp import decomposition_table

    return decomposition_table


# ----------------------------------------------------------------------------- binding arguments


def argument(plan: OpPlan, args, kwargs, i):
    """The value of the schema's `i`-th argument in a call (None when left to its default)."""
    if i < len(args):
        return args[i]
    return kwargs.get(plan.arg_names[i])


def bind(func, args, kwargs) -> dict:
    """A call's arguments by schema name, in schema order: positional, keyword, the schema's
    default, or None for an argument with no default that was not given."""
    out = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out
