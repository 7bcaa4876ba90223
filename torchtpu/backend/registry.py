"""Everything an op module (backend/ops/) uses from the rest of the backend, in one place.

Op modules register into the op table (`lower`, `custom`, `POST`; see optable.py) and never
import the dispatcher's modules themselves. A bespoke handler (`custom`) works on tensors, so
it gets the dispatcher's services from here: running an op's plan (`plan_for`, `run`),
wrapping results (`wrap`), writing a mutated argument (`write_value`), reading values
(`array_of`, `to_cpu`) and re-dispatching (`dispatch`). An op whose whole implementation is a
JAX function (a Pallas kernel's wrapper) is registered with `jax_op`, as users register theirs.
"""

from __future__ import annotations

from .execute import device_index_of, run, wrap
from .fallback import to_cpu
from .handlers import dispatch, write_value
from .jax_op import jax_op
from .optable import CUSTOM, LOWERINGS, POST, Lowering, aten, custom, lower
from .plans import bind, plan_for
from .state import CONFIG, is_tracing
from .views import array_of

__all__ = [
    "CONFIG",
    "CUSTOM",
    "LOWERINGS",
    "POST",
    "Lowering",
    "array_of",
    "aten",
    "bind",
    "custom",
    "device_index_of",
    "dispatch",
    "is_tracing",
    "jax_op",
    "lower",
    "plan_for",
    "run",
    "to_cpu",
    "wrap",
    "write_value",
]
