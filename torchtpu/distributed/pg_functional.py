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

from ..backend import is_tracing, override_op

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


def _handler(func, pos):
    """The handler of `func` given `lowered`, torchtpu's own path for the op (its lowering onto
    the global mesh's axes)."""

    def make(lowered):
        def handle(args, kwargs):
            name = args[pos] if len(args) > pos else kwargs.get("group_name")
            if _is_process_group(name):
                if is_tracing():
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
            return lowered(args, kwargs)

        return handle

    return make


def _wait_handler(lowered):
    def handle(args, kwargs):
        if not is_tracing() and torch._C._distributed_c10d._get_work_registry_size():
            return _c10d.wait_tensor.default.redispatch(_BACKEND, *args, **kwargs)
        return lowered(args, kwargs)

    return handle


def install() -> None:
    from . import collectives  # noqa: F401  (registers the lowerings these handlers fall back to)

    for func, pos in _GROUP_ARG.items():
        override_op(func, _handler(func, pos))
    override_op(_c10d.wait_tensor.default, _wait_handler)
