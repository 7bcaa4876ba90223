"""An op taken over by a layer above the backend: the op keeps its lowering, and a handler the
layer gives decides, per call, whether to run that lowering or something else.

torchtpu.distributed takes over PyTorch's functional collectives this way: a collective addressed
to one of torchtpu's mesh axes runs its lowering, one addressed to a c10d process group runs the
group's own kernel.
"""

from __future__ import annotations

import functools

from jax._src.array import ArrayImpl as _ArrayImpl

from .execute import device_index_of, run, wrap
from .optable import CUSTOM
from .plans import forget_plan, new_plan
from .tensor import TpuTensor, new_base


def _run_lowering(plan, func, args, kwargs):
    out = run(plan, func, args, kwargs)
    if type(out) is _ArrayImpl:
        a0 = args[0] if args else None
        return new_base(out, a0._st.device_index if type(a0) is TpuTensor else device_index_of(args, kwargs))
    return wrap(out, device_index_of(args, kwargs))


def override_op(func, make_handler) -> None:
    """Make `func` (an ATen overload with a lowering) a custom op of the dispatcher, handled by
    `make_handler(lowered)`, a function `handle(args, kwargs) -> result`; `lowered(args, kwargs)`
    runs the op's own lowering on tpu tensors and returns tpu tensors. An op already custom is
    left as it is."""
    if func in CUSTOM:
        return
    plan = new_plan(func)  # the lowering's plan, made before the op turns custom
    CUSTOM[func] = make_handler(functools.partial(_run_lowering, plan, func))
    forget_plan(func)
