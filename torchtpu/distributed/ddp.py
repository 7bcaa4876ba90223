"""DDP's `find_unused_parameters=True` (and `static_graph=True`) on tpu.

DDP's reducer copies its map of the parameters that a step uses onto the device through a pinned host
buffer, which it asks PyTorch's CPU allocator for; PyTorch hands that request to the device's
C++ hooks, and a device registered from Python has no pinned allocator to give. XLA copies from
any host buffer, so a plain buffer does the job: while a DDP backward that needs one runs, the
CPU kernel of `empty_strided` (the reducer's allocation) is replaced by one that answers pinned
requests with a plain buffer that `is_pinned()` reports as pinned. It is armed by the forward of
such a DDP module on tpu and removed at the end of the backward that used it, so CPU work outside
those backwards keeps PyTorch's own kernel.
"""

from __future__ import annotations

import warnings

import torch
from torch.nn.parallel import DistributedDataParallel

from ..backend import mark_pinned

_armed: list = []  # the torch.library.Library holding the replacement, while armed


def _storage_numel(size, stride) -> int:
    if any(s == 0 for s in size):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(size, stride))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    dtype = dtype or torch.get_default_dtype()
    # torch.empty (empty.memory_format) is a different kernel: no recursion into this one
    storage = torch.empty(_storage_numel(size, stride), dtype=dtype).untyped_storage()
    out = torch.empty(0, dtype=dtype).set_(storage, 0, list(size), list(stride))
    if pin_memory:
        mark_pinned(out)
        # the reducer's one pinned buffer of this backward: back to PyTorch's kernel at its end
        torch.autograd.Variable._execution_engine.queue_callback(_disarm)
    return out


def _arm() -> None:
    if not _armed:
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel": the point
            warnings.simplefilter("ignore")
            lib.impl("empty_strided", _empty_strided, "CPU")
        _armed.append(lib)


def _disarm() -> None:
    while _armed:
        _armed.pop()._destroy()


def _needs_pinned(ddp) -> bool:
    """Whether the coming backward of `ddp` all-reduces its map of used parameters through the
    device (PyTorch's reducer does for a dynamic graph with find_unused_parameters, and in the
    first iteration of a static graph)."""
    if getattr(ddp, "device_type", None) != "tpu" or not torch.is_grad_enabled():
        return False
    if ddp.static_graph:  # its first forward only
        first = not getattr(ddp, "_torchtpu_static_seen", False)
        ddp._torchtpu_static_seen = True
        return first
    return ddp.find_unused_parameters and ddp.require_backward_grad_sync


_original_post_forward = DistributedDataParallel._post_forward


def _post_forward(self, output):
    if _needs_pinned(self):
        _arm()
    return _original_post_forward(self, output)


def install() -> None:
    """Wrap DDP's end of forward so a backward that needs a pinned buffer on tpu finds one."""
    DistributedDataParallel._post_forward = _post_forward
