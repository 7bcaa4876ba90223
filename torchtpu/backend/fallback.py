"""What runs beside the XLA path: the CPU fallback for ops without a lowering
(TORCHTPU_CPU_FALLBACK=1), debug mode's check for NaN/Inf (TORCHTPU_DEBUG=1), and repr."""

from __future__ import annotations

import linecache
import traceback
import warnings

import jax.numpy as jnp
import numpy as np
import torch
from torch.utils._mode_utils import no_dispatch

from . import dtypes
from .execute import device_index_of, returns
from .plans import argument, plan_for
from .tensor import TpuTensor, new_base, place
from .views import array_of, write

# ----------------------------------------------------------------------------- CPU fallback

WARNED: set = set()  # ops that ran on the CPU (each warns once)


def to_cpu(x):
    """CPU copies of the tpu tensors in `x` (a tensor, or a nested list/tuple)."""
    if isinstance(x, TpuTensor):
        a = np.asarray(array_of(x))
        return dtypes.numpy_to_torch(a, x.dtype).reshape(tuple(x.shape))
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v) for v in x)
    return x


def _to_tpu_like(x, device_index):
    if isinstance(x, torch.Tensor) and not isinstance(x, TpuTensor):
        return new_base(place(dtypes.torch_to_numpy(x.contiguous()), device_index), device_index, x.dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_tpu_like(v, device_index) for v in x)
    return x


def cpu_fallback(func, args, kwargs):
    if func not in WARNED:
        WARNED.add(func)
        warnings.warn(
            f"torchtpu: running {func} on the CPU (TORCHTPU_CPU_FALLBACK=1); it has no XLA lowering", stacklevel=3
        )
    index = device_index_of(args, kwargs)
    cargs = to_cpu(list(args))
    ckwargs = {k: to_cpu(v) for k, v in kwargs.items()}
    if "device" in ckwargs and isinstance(ckwargs["device"], torch.device) and ckwargs["device"].type == "tpu":
        ckwargs["device"] = torch.device("cpu")
    with no_dispatch():
        out = func(*cargs, **ckwargs)
    plan = plan_for(func)
    for i in plan.mutated:
        # a mutated Tensor[] (a fused optimizer's parameters and moments, a _foreach_ op's
        # list) is written back element by element, as a single mutated tensor is
        tgt = argument(plan, args, kwargs, i)
        src = argument(plan, cargs, ckwargs, i)
        pairs = zip(tgt, src, strict=True) if isinstance(tgt, (list, tuple)) else [(tgt, src)]
        for t, s in pairs:
            if isinstance(t, TpuTensor):
                write(t, jnp.asarray(dtypes.torch_to_numpy(s.contiguous())))
    if plan.mutated:
        return returns(plan, args, kwargs, [None] * len(plan.returns_alias))
    return _to_tpu_like(out, index)


# ----------------------------------------------------------------------------- debug mode


class NonFiniteError(FloatingPointError):
    pass


def _user_frame():
    for frame in reversed(traceback.extract_stack()[:-3]):
        f = frame.filename
        if "/torchtpu/" in f or "/torch/" in f or "/jax/" in f or f.startswith("<"):
            continue
        return frame
    return None


def check_finite(func, out):
    outs = out if isinstance(out, (list, tuple)) else [out]
    for o in outs:
        if isinstance(o, TpuTensor) and (o.dtype.is_floating_point or o.dtype.is_complex):
            a = array_of(o)
            a.block_until_ready()
            if not bool(jnp.all(jnp.isfinite(a))):
                frame = _user_frame()
                where = (
                    f" at {frame.filename}:{frame.lineno}: {linecache.getline(frame.filename, frame.lineno).strip()}"
                    if frame
                    else ""
                )
                kind = "NaN" if bool(jnp.any(jnp.isnan(a))) else "Inf"
                raise NonFiniteError(f"torchtpu debug mode: {func} produced {kind}{where}")


# ----------------------------------------------------------------------------- repr


def tensor_repr(t: TpuTensor, *, tensor_contents=None) -> str:
    """torch.Tensor.__repr__ formats through many small ops; this formats the CPU copy instead."""
    with torch._C.DisableTorchFunctionSubclass():
        cpu = to_cpu(t)
    body = repr(cpu)
    assert body.endswith(")")
    extras = [f"device='{t.device}'"]
    if t.grad_fn is not None:
        extras.append(f"grad_fn=<{type(t.grad_fn).__name__}>")
    elif t.requires_grad:
        extras.append("requires_grad=True")
    return body[:-1] + ", " + ", ".join(extras) + ")"
