"""PyTorch's functional collectives (`torch.ops._c10d_functional`) addressed to a c10d process
group on tpu tensors: what PyTorch's own `DeviceMesh` over the "tpu" process group (DTensor's
`redistribute`, `full_tensor`, reductions to `Partial`) calls.

torchtpu lowers these ops to XLA collectives over named axes of its global mesh
(collectives.py). A group name that c10d registered for a process group is no mesh axis: such a
call goes to PyTorch's own kernel of the op, which resolves the group and calls its collective
(an eager `TpuProcessGroup` op); `wait_tensor` then waits for the `Work` that kernel recorded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from jax._src.array import ArrayImpl as _ArrayImpl

from ..backend import plans
from ..backend.execute import device_index_of, run, wrap
from ..backend.optable import CUSTOM
from ..backend.state import STATE
from ..backend.tensor import TpuTensor, new_base

_c10d = torch.ops._c10d_functional
_BACKEND = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
_GROUP_ARG = {  # op -> the position of its group_name argument
    _c10d.all_reduce.default: 2,
    _c10d.all_gather_into_tensor.default: 2,
    _c10d.reduce_scatter_tensor.default: 3,
    _c10d.all_to_all_single.default: 3,
    _c10d.broadcast.default: 2,
}


def _is_process_group(name) -> bool:
    if not isinstance(name, str) or not dist.is_initialized():
        return False
    return name in dist.distributed_c10d._world.pg_names.values()


def _functional(plan, func, args, kwargs):
    """torchtpu's own path for the op (its lowering onto the global mesh's axes)."""
    out = run(plan, func, args, kwargs)
    if type(out) is _ArrayImpl:
        a0 = args[0] if args else None
        return new_base(out, a0._st.device_index if type(a0) is TpuTensor else device_index_of(args, kwargs))
    return wrap(out, device_index_of(args, kwargs))


def _handler(func, plan, pos):
    def handle(args, kwargs):
        name = args[pos] if len(args) > pos else kwargs.get("group_name")
        if _is_process_group(name):
            if STATE.trace_depth:
                raise RuntimeError(
                    f"{func} over the c10d process group {name!r} inside a traced tpu program: process-group "
                    "collectives run eagerly; inside compiled code use torchtpu's global mesh"
                )
            out = func.redispatch(_BACKEND, *args, **kwargs)
            # PyTorch's kernel registers the op's Work under the output's storage until wait_tensor
            # finds it there. A tpu tensor's C++ storage is its own wrapper's, so a wait on a view or
            # an alias of the output never found it, and each such Work (holding its output arrays)
            # stayed registered: TP's step leaked one per step. Its arrays are futures XLA orders, so
            # the values need no wait; the entry is taken out here, on the output itself.
            _c10d.wait_tensor.default.redispatch(_BACKEND, out)
            return out
        return _functional(plan, func, args, kwargs)

    return handle


def _wait_handler(plan):
    def handle(args, kwargs):
        if not STATE.trace_depth and torch._C._distributed_c10d._get_work_registry_size():
            return _c10d.wait_tensor.default.redispatch(_BACKEND, *args, **kwargs)
        return _functional(plan, _c10d.wait_tensor.default, args, kwargs)

    return handle


def install() -> None:
    from . import collectives  # noqa: F401  (registers the lowerings these handlers fall back to)

    for func, pos in _GROUP_ARG.items():
        if func in CUSTOM:
            continue
        plan = plans._plan(func)  # the lowering's plan, made before the op turns custom
        CUSTOM[func] = _handler(func, plan, pos)
        plans._PLANS.pop(func, None)
        func.__dict__.pop("_tpu_plan", None)
    wait = _c10d.wait_tensor.default
    if wait not in CUSTOM:
        plan = plans._plan(wait)
        CUSTOM[wait] = _wait_handler(plan)
        plans._PLANS.pop(wait, None)
        wait.__dict__.pop("_tpu_plan", None)
