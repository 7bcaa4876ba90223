"""flex_attention's device check, accepting tpu (installed by torchtpu.backend.flex_attention).

`torch.nn.attention.flex_attention.flex_attention` refuses devices other than CUDA, CPU, XPU, HPU
and MPS in `_validate_device`. Its replacement is defined here, outside torchtpu.backend, because
flex_attention calls it inside code that torch.compile traces: Dynamo skips every function under
torchtpu.backend (backend code, never captured into a graph), so a check defined there would
break the graph in the middle of flex_attention; this one Dynamo traces through.
"""

from __future__ import annotations


def accepting_tpu(check):
    """`check(query, key, value)` that lets tpu tensors through."""

    def _validate_device(query, key, value):
        if query.device.type != "tpu":
            check(query, key, value)

    _validate_device.__wrapped__ = check
    return _validate_device
