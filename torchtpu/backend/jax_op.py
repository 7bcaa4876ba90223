"""`torchtpu.jax_op`: a JAX function (a Pallas kernel inside it or not) as a PyTorch custom op.

    op = torchtpu.jax_op("mylib::fused_softmax", fused_softmax)
    y = op(x)  # x a tpu tensor; y = fused_softmax(to_jax(x)) as a tpu tensor

`jax_op` defines the op with `torch.library` and registers, for it:
- its lowering in the op table (optable.py), so it runs like any ATen op: in eager through the
  per-signature executable cache, and called on tracers inside `torchtpu.compile` and
  `torch.compile(backend="tpu")` programs, where it becomes part of the one XLA program;
- its fake (meta) implementation, from `jax.eval_shape` of the function (or the user's `fake=`):
  Dynamo, AOTAutograd and the dry run see shapes without running it;
- its autograd formula: a second op, `<name>_vjp`, whose lowering is `jax.vjp` of the function
  (a `jax.custom_vjp` inside it is honoured). The backward op runs the function's forward again
  inside `jax.vjp` (the residuals JAX keeps are not torch tensors): a kernel's forward runs twice
  per training step, as under full rematerialisation. `backward=` gives the pullback instead, a
  function of the op's arguments and the outputs' cotangents, which runs alone. A function JAX
  cannot differentiate raises an error naming the op when a gradient is asked for, also when the
  backward is traced (the vjp op's fake runs `jax.vjp` abstractly).

Pallas: where a program is compiled for TPU the function's `pallas_call`s lower to Mosaic; on
every other platform (XLA:CPU here) the function is traced in Pallas's interpret mode, so a
kernel runs, and is tested, on CPU (`lax.platform_dependent` chooses at lowering time, as the
project's own kernels do). The TPU branch is traced with JAX's 64-bit types off (Mosaic's index
maps are 32-bit), and its outputs are cast to the types the function gives with them on.

Sharding: by default the function is global (it sees whole arrays; XLA partitions it, which a
Mosaic custom call does not allow on TPU). With `out_specs=` it runs per shard under
`jax.shard_map` over the inputs' mesh: `in_specs=` gives the inputs' PartitionSpecs, or is left
to the placements of the input tensors (their `jax.Array` shardings in eager, the layout
torchtpu.distributed gave them inside programs). The gradient is `jax.vjp` of the shard_map'ed
function, so an input replicated over mesh axes gets its per-shard gradients summed by JAX.
"""

from __future__ import annotations

import contextvars
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import dtypes
from .execute import device_index_of, run, wrap
from .optable import CUSTOM, lower
from .pallas_mode import interpret_kernels, interpreting, mesh_of
from .plans import plan_for
from .state import is_tracing
from .tensor import TpuTensor, storage_of
from .views import array_of

__all__ = ["jax_op"]

_LIBRARIES: dict = {}  # namespace -> torch.library.Library (kept alive: dropping one removes its ops)
_STATIC_TYPES = {bool: "bool", int: "int", float: "float", str: "str"}
# the inputs' PartitionSpecs while an op whose in_specs are inferred runs (set by its handler)
_INFERRED_SPECS: contextvars.ContextVar = contextvars.ContextVar("jax_op_in_specs", default=None)


class JaxOpError(RuntimeError):
    """A jax_op's function, fake or sharding does not fit the op (the message names the op)."""


def jax_op(
    name: str,
    fn,
    *,
    schema=None,
    outputs: int = 1,
    backward=None,
    fake=None,
    in_specs=None,
    out_specs=None,
    choose_platform: bool = True,
    cpu=None,
    cpu_backward=None,
):
    """Register the JAX function `fn` as the PyTorch custom op `name` ("namespace::op") and return it
    (`torch.ops.namespace.op`).

    fn: a function of JAX arrays (one per Tensor argument) and Python values (the other
    arguments), returning one array, or a tuple of `outputs` arrays.
    schema: the op's torch.library schema, as "(Tensor x, float scale=1.0) -> Tensor"; default:
    from fn's signature, a parameter without a default is a Tensor, one with a bool, int, float or
    str default is that type (passed to fn as a Python value, fixed when the op is traced).
    backward: optional JAX pullback, `backward(*args, *cotangents) -> one gradient per Tensor
    argument` (None for one that gets none); default `jax.vjp` of fn.
    fake: optional `fake(*args)` on meta tensors returning the outputs' shapes and dtypes as
    tensors; default `jax.eval_shape` of fn. The outputs fn computes must match it.
    out_specs: a PartitionSpec per output: run fn per shard with `jax.shard_map` over the mesh
    the inputs are laid out on; in_specs: a PartitionSpec per Tensor argument (default: each
    input's own placement). Without out_specs fn is one global function.
    choose_platform: False for a function that picks its TPU and other-platform branches itself
    (`lax.platform_dependent`, as the project's own kernels do); jax_op then calls it as it is.
    cpu, cpu_backward: optional PyTorch implementations of the op and of its pullback (as
    `backward`'s) for CPU tensors; without them the op takes tpu tensors only.
    """
    namespace, opname = _split_name(name)
    if not callable(fn):
        raise TypeError(f"torchtpu.jax_op({name!r}, fn): fn must be a JAX function, got {type(fn).__name__}")
    if hasattr(getattr(torch.ops, namespace), opname):
        raise JaxOpError(
            f"torchtpu.jax_op: the op {name} is already defined; give this function another name "
            "(torch.library ops cannot be redefined in one process)"
        )
    if schema is None:
        schema = _schema_from_signature(name, fn, outputs)
    spec = _JaxOp(name, fn, schema, backward, fake, in_specs, out_specs, choose_platform)
    lib = _LIBRARIES.get(namespace)
    if lib is None:
        lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    lib.define(opname + schema)
    vjp_schema = _vjp_schema(name, schema)
    lib.define(f"{opname}_vjp{vjp_schema}")
    packet = getattr(getattr(torch.ops, namespace), opname)
    vjp_packet = getattr(getattr(torch.ops, namespace), f"{opname}_vjp")
    spec.vjp_op = vjp_packet.default

    if cpu is not None:
        lib.impl(opname, cpu, "CPU")
    if cpu_backward is not None:
        lib.impl(f"{opname}_vjp", spec.cpu_gradients(cpu_backward), "CPU")
    torch.library.register_fake(name, spec.fake_outputs, lib=lib)
    torch.library.register_fake(f"{name}_vjp", spec.fake_gradients, lib=lib)
    torch.library.register_autograd(name, spec.autograd_backward, setup_context=spec.setup_context, lib=lib)
    torch.library.register_autograd(f"{name}_vjp", spec.no_double_backward, lib=lib)
    lower(packet.default)(spec.forward_lowering)
    lower(vjp_packet.default)(spec.vjp_lowering)
    if out_specs is not None and in_specs is None:
        CUSTOM[packet.default] = spec.inferring_specs(packet.default)
        CUSTOM[vjp_packet.default] = spec.inferring_specs(vjp_packet.default)
    return packet


def _split_name(name: str) -> tuple[str, str]:
    m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)::([A-Za-z_][A-Za-z0-9_]*)", name or "")
    if m is None:
        raise ValueError(f"torchtpu.jax_op: the op name {name!r} is not 'namespace::name' (e.g. 'mylib::softmax')")
    return m.group(1), m.group(2)


def _schema_from_signature(name: str, fn, outputs: int) -> str:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as e:
        raise JaxOpError(f"torchtpu.jax_op {name}: cannot read fn's signature ({e}); pass schema=") from None
    args = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise JaxOpError(f"torchtpu.jax_op {name}: fn takes *{p.name}; pass schema= naming each argument")
        if p.default is p.empty:
            args.append(f"Tensor {p.name}")
        elif type(p.default) in _STATIC_TYPES:
            args.append(f"{_STATIC_TYPES[type(p.default)]} {p.name}={p.default!r}".replace("'", '"'))
        else:
            raise JaxOpError(
                f"torchtpu.jax_op {name}: fn's argument {p.name}={p.default!r} is neither a tensor (no default) nor "
                "a bool, int, float or str; pass schema="
            )
    if outputs < 1:
        raise ValueError(f"torchtpu.jax_op {name}: outputs={outputs}; an op returns at least one tensor")
    returns = "Tensor" if outputs == 1 else "(" + ", ".join(["Tensor"] * outputs) + ")"
    return "(" + ", ".join(args) + ") -> " + returns


def _vjp_schema(name: str, schema: str) -> str:
    """The vjp op's schema: the op's arguments, then the outputs' cotangents; a gradient per Tensor."""
    m = re.fullmatch(r"\s*\((.*)\)\s*->.*", schema, re.S)
    if m is None:
        raise JaxOpError(f"torchtpu.jax_op {name}: schema {schema!r} is not '(arguments) -> returns'")
    args = m.group(1).strip()
    return f"({args + ', ' if args else ''}Tensor[] cotangents) -> Tensor[]"


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


class _JaxOp:
    """One op made by jax_op: its schema, and the functions it registers (see the module doc)."""

    def __init__(self, name, fn, schema, backward, fake, in_specs, out_specs, choose_platform):
        self.name = name
        self.choose_platform = choose_platform
        self.fn = fn
        self.user_backward = backward
        self.user_fake = fake
        self.in_specs = None if in_specs is None else tuple(in_specs)
        self.out_specs = None if out_specs is None else (out_specs if isinstance(out_specs, tuple) else (out_specs,))
        parsed = torch._C.parse_schema(f"{name}{schema}")
        self.arguments = parsed.arguments
        self.names = [a.name for a in parsed.arguments]
        self.tensor_pos = []
        for i, a in enumerate(parsed.arguments):
            t = str(a.type)
            if t in ("Tensor", "Optional[Tensor]"):
                self.tensor_pos.append(i)
            elif "Tensor" in t:
                raise JaxOpError(
                    f"torchtpu.jax_op {name}: argument {a.name} is {t}; jax_op takes Tensor and Tensor? arguments"
                )
        if not all(str(r.type) == "Tensor" for r in parsed.returns) or not parsed.returns:
            raise JaxOpError(f"torchtpu.jax_op {name}: the schema must return one or more Tensors, got {schema!r}")
        self.n_out = len(parsed.returns)
        if self.out_specs is not None and len(self.out_specs) != self.n_out:
            raise JaxOpError(
                f"torchtpu.jax_op {name}: {len(self.out_specs)} out_specs for {self.n_out} outputs; give one "
                "PartitionSpec per output"
            )
        if self.in_specs is not None and len(self.in_specs) != len(self.tensor_pos):
            raise JaxOpError(
                f"torchtpu.jax_op {name}: {len(self.in_specs)} in_specs for {len(self.tensor_pos)} tensor arguments "
                f"{[self.names[i] for i in self.tensor_pos]}; give one PartitionSpec per tensor argument"
            )
        if self.in_specs is not None and self.out_specs is None:
            raise JaxOpError(f"torchtpu.jax_op {name}: in_specs without out_specs; per-shard calls need both")
        self.vjp_op = None

    # ------------------------------------------------------------------------- the call
    def _present(self, values) -> list:
        """The positions of the tensor arguments given in this call (a `Tensor?` one may be None)."""
        return [i for i in self.tensor_pos if values[i] is not None]

    def _bind(self, args, kwargs):
        values = list(args) + [None] * (len(self.names) - len(args))
        for i, a in enumerate(self.arguments):
            if i >= len(args):
                if a.name in kwargs:
                    values[i] = kwargs[a.name]
                elif a.has_default_value():
                    values[i] = a.default_value
        return values

    def _call(self, values, arrays):
        """fn on `arrays` (its tensor arguments) and the Python values in `values`: a tuple of outputs."""
        full = list(values)
        for i, a in zip(self._present(values), arrays):
            full[i] = a
        out = self.fn(*full)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if len(outs) != self.n_out:
            raise JaxOpError(
                f"torchtpu.jax_op {self.name}: fn returned {len(outs)} value(s), the op's schema has {self.n_out} "
                "output(s); pass outputs= (or schema=) to match"
            )
        for k, o in enumerate(outs):
            if not isinstance(o, (jax.Array, jax.core.Tracer)):
                raise JaxOpError(
                    f"torchtpu.jax_op {self.name}: fn's output {k} is a {type(o).__name__}, not a JAX array; "
                    "return jax.numpy arrays (jnp.asarray(value))"
                )
        return tuple(outs)

    def _function(self, values):
        """The global JAX function of the tensor arguments, custom_vjp'd with `backward=` if given."""

        def f(*arrays):
            return self._call(values, arrays)

        if self.user_backward is None:
            return f
        g = jax.custom_vjp(f)

        def fwd(*arrays):
            return f(*arrays), arrays

        def bwd(arrays, cts):
            grads = self._backward_grads(values, arrays, cts)
            # JAX's cotangent of an integer input is float0
            return tuple(
                gr if _is_float(a.dtype) else np.zeros(a.shape, jax.dtypes.float0) for gr, a in zip(grads, arrays)
            )

        g.defvjp(fwd, bwd)
        return g

    def _backward_grads(self, values, arrays, cotangents):
        """`backward=`'s gradients, one per tensor argument (zeros where it gives None)."""
        pos = self._present(values)
        full = list(values)
        for i, a in zip(pos, arrays):
            full[i] = a
        grads = self._per_given_tensor(values, self.user_backward(*full, *cotangents), "backward")
        for gr, a, k in zip(grads, arrays, range(len(arrays))):
            if gr is not None and tuple(gr.shape) != tuple(a.shape):
                raise JaxOpError(
                    f"torchtpu.jax_op {self.name}: backward's gradient {k} has shape {list(gr.shape)}, its "
                    f"argument {self.names[pos[k]]!r} {list(a.shape)}"
                )
        return tuple(jnp.zeros_like(a) if gr is None else gr.astype(a.dtype) for gr, a in zip(grads, arrays))

    def _sharded(self, f, values, arrays):
        """f per shard (shard_map) when the op has out_specs and the inputs lie on a mesh, else f."""
        if self.out_specs is None:
            return f
        mesh = mesh_of(*arrays)
        if mesh is None:
            return f
        in_specs = self.in_specs if self.in_specs is not None else _INFERRED_SPECS.get()
        if in_specs is None:
            raise JaxOpError(f"torchtpu.jax_op {self.name}: no in_specs for its per-shard call; pass in_specs=")
        in_specs = tuple(spec for i, spec in zip(self.tensor_pos, in_specs) if values[i] is not None)
        sizes = dict(mesh.shape)
        for i, a, spec in zip(self._present(values), arrays, in_specs):
            _check_spec(self.name, f"input {self.names[i]!r}", a.shape, spec, sizes)
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=self.out_specs, check_vma=False)

    def _on_platform(self, g, operands):
        """g's Pallas kernels as Mosaic where the program is compiled for TPU, interpreted elsewhere."""
        if interpreting() or not self.choose_platform:
            return g(*operands)

        def interpreted(*a):
            with interpret_kernels():
                return g(*a)

        def on_tpu(*a):
            # Mosaic index maps are 32-bit (a literal in one would be int64 with x64 on), and a
            # TPU has no 64-bit floats: the TPU branch is traced with 64-bit types off, its outputs
            # cast to the types the other branch (and the fake) has
            want = jax.eval_shape(g, *a)
            with jax.enable_x64(False):
                out = g(*a)
            return jax.tree.map(lambda o, w: o.astype(w.dtype), out, want)

        return lax.platform_dependent(*operands, tpu=on_tpu, default=interpreted)

    def _expected(self, values, arrays):
        """The fake's outputs for these arrays: [(shape, jax dtype)]."""
        if self.user_fake is None:
            structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
            outs = jax.eval_shape(self._function(values), *structs)
            return [(tuple(o.shape), jnp.dtype(o.dtype)) for o in outs]
        full = list(values)
        for i, a in zip(self._present(values), arrays):
            full[i] = torch.empty(a.shape, dtype=dtypes.to_torch_dtype(a.dtype), device="meta")
        outs = self.user_fake(*full)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        return [(tuple(o.shape), jnp.dtype(dtypes.to_jax_dtype(o.dtype))) for o in outs]

    def forward_lowering(self, *args, **kwargs):
        values = self._bind(args, kwargs)
        arrays = [values[i] for i in self._present(values)]
        g = self._sharded(self._function(values), values, arrays)
        outs = self._on_platform(g, arrays)
        expected = self._expected(values, arrays)
        for k, (o, (shape, dtype)) in enumerate(zip(outs, expected)):
            if tuple(o.shape) != shape or jnp.dtype(o.dtype) != dtype:
                where = " (run per shard, each shard's outputs must tile it)" if self.out_specs is not None else ""
                raise JaxOpError(
                    f"torchtpu.jax_op {self.name}: output {k} is {jnp.dtype(o.dtype)}{list(o.shape)}, the op's fake "
                    f"says {dtype}{list(shape)}{where}; "
                    "fix fake= or out_specs= (leave fake out to derive it from jax.eval_shape)"
                )
        return outs[0] if self.n_out == 1 else tuple(outs)

    # ------------------------------------------------------------------------- autograd
    def _per_given_tensor(self, values, grads, what):
        """`grads` (one per Tensor argument of the schema) for the tensor arguments given (not None)."""
        grads = tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
        if len(grads) != len(self.tensor_pos):
            raise JaxOpError(
                f"torchtpu.jax_op {self.name}: {what} returned {len(grads)} gradient(s) for the "
                f"{len(self.tensor_pos)} tensor argument(s) {[self.names[i] for i in self.tensor_pos]}"
            )
        return [gr for i, gr in zip(self.tensor_pos, grads) if values[i] is not None]

    def cpu_gradients(self, cpu_backward):
        """The vjp op's CPU kernel from `cpu_backward=` (PyTorch, one gradient per Tensor argument)."""

        def kernel(*args, **kwargs):
            values = self._bind(args, kwargs)
            cotangents = values[len(self.names)] if len(values) > len(self.names) else kwargs["cotangents"]
            values = values[: len(self.names)]
            grads = self._per_given_tensor(values, cpu_backward(*values, *cotangents), "cpu_backward")
            tensors = [values[i] for i in self._present(values)]
            return [torch.zeros_like(t) if gr is None else gr.to(t.dtype) for gr, t in zip(grads, tensors)]

        return kernel

    def _pullback(self, values, arrays, cotangents, *, sharded: bool):
        """The gradients of every tensor argument (zeros for integer ones) given the outputs'."""
        if self.user_backward is not None and self.out_specs is None:
            # the pullback itself: the forward need not run again (per shard, jax.vjp of the
            # shard_map'ed custom_vjp below sums a replicated input's gradient over the shards)
            return list(self._backward_grads(values, arrays, cotangents))
        f = self._function(values)
        if sharded:
            f = self._sharded(f, values, arrays)
        wrt = [k for k, a in enumerate(arrays) if _is_float(a.dtype)]

        def of_floats(*floats):
            full = list(arrays)
            for k, a in zip(wrt, floats):
                full[k] = a
            return f(*full)

        try:
            outs, pull = jax.vjp(of_floats, *[arrays[k] for k in wrt])
            cts = tuple(
                jnp.asarray(c).astype(o.dtype) if _is_float(o.dtype) else np.zeros(o.shape, jax.dtypes.float0)
                for c, o in zip(cotangents, outs)
            )  # an integer output has no gradient: JAX's cotangent for it is float0
            grads = pull(cts)
        except JaxOpError:
            raise
        except Exception as e:
            raise JaxOpError(
                f"torchtpu.jax_op {self.name}: a gradient was asked for, and jax.vjp of its function failed "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). A function JAX cannot "
                "differentiate (a bare pallas_call) needs a gradient of its own: wrap the kernel in jax.custom_vjp, "
                "or pass backward= to jax_op; or call the op under torch.no_grad() / on tensors that do not "
                "require grad"
            ) from e
        result = [jnp.zeros(a.shape, a.dtype) for a in arrays]
        for k, gr in zip(wrt, grads):
            result[k] = gr
        return result

    def vjp_lowering(self, *args, **kwargs):
        values = self._bind(args, kwargs)
        cotangents = list(values[len(self.names)] if len(values) > len(self.names) else kwargs["cotangents"])
        values = values[: len(self.names)]
        arrays = [values[i] for i in self._present(values)]
        n = len(arrays)

        def g(*operands):
            return tuple(self._pullback(values, list(operands[:n]), operands[n:], sharded=True))

        return list(self._on_platform(g, arrays + cotangents))

    def fake_outputs(self, *args, **kwargs):
        values = self._bind(args, kwargs)
        tensors = [values[i] for i in self._present(values)]
        if self.user_fake is not None:
            return self.user_fake(*values)
        arrays = [jax.ShapeDtypeStruct(_static_shape(self.name, t), dtypes.to_jax_dtype(t.dtype)) for t in tensors]
        outs = self._expected(values, arrays)
        device = tensors[0].device if tensors else torch.device("meta")
        made = [torch.empty(s, dtype=dtypes.to_torch_dtype(d), device=device) for s, d in outs]
        return made[0] if self.n_out == 1 else tuple(made)

    def fake_gradients(self, *args, **kwargs):
        values = self._bind(args, kwargs)
        cotangents = values[len(self.names)] if len(values) > len(self.names) else kwargs["cotangents"]
        values = values[: len(self.names)]
        tensors = [values[i] for i in self._present(values)]
        if self.user_backward is not None:
            return [torch.empty_like(t) for t in tensors]
        arrays = [jax.ShapeDtypeStruct(_static_shape(self.name, t), dtypes.to_jax_dtype(t.dtype)) for t in tensors]
        cts = [jax.ShapeDtypeStruct(_static_shape(self.name, c), dtypes.to_jax_dtype(c.dtype)) for c in cotangents]
        n = len(arrays)
        # traced abstractly now, so a function JAX cannot differentiate fails where the backward is built
        jax.eval_shape(lambda *ops: self._pullback(values, list(ops[:n]), ops[n:], sharded=False), *arrays, *cts)
        return [torch.empty_like(t) for t in tensors]

    def setup_context(self, ctx, inputs, output):
        values = list(inputs)
        ctx.save_for_backward(*[values[i] for i in self.tensor_pos])
        for i in self.tensor_pos:
            values[i] = None
        ctx.values = values

    def autograd_backward(self, ctx, *grads):
        values = list(ctx.values)
        for i, t in zip(self.tensor_pos, ctx.saved_tensors):
            values[i] = t
        gradients = self.vjp_op(*values, [g.contiguous() for g in grads])
        result = [None] * len(values)
        for k, i in enumerate(self._present(values)):
            if ctx.needs_input_grad[i] and values[i].is_floating_point():
                result[i] = gradients[k]
        return tuple(result)

    def no_double_backward(self, ctx, *grads):
        raise JaxOpError(
            f"torchtpu.jax_op {self.name}: its backward is not differentiable again (double backward, "
            "create_graph=True through it, is not supported)"
        )

    # ------------------------------------------------------------------------- inferred in_specs
    def inferring_specs(self, func):
        """The handler of `func` (the op or its vjp op) when the op has out_specs and no in_specs:
        the inputs' placements become in_specs, then `func` runs as any other op (its plan's
        executable in eager, its lowering on tracers)."""

        def handler(args, kwargs):
            values = self._bind(args, kwargs)
            specs = tuple(
                P() if values[i] is None else self._placement(values[i], self.names[i]) for i in self.tensor_pos
            )
            token = _INFERRED_SPECS.set(specs)
            try:
                out = run(plan_for(func), func, args, kwargs)
            finally:
                _INFERRED_SPECS.reset(token)
            return wrap(out, device_index_of(args, kwargs))

        return handler

    def _placement(self, t, name):
        if not isinstance(t, TpuTensor):
            return P()
        arr = array_of(t)
        if not is_tracing():
            sharding = arr.sharding
            return sharding.spec if isinstance(sharding, NamedSharding) else P()
        dist = storage_of(t).dist
        if dist is not None and not t._vw and isinstance(dist.sharding, NamedSharding):
            return dist.sharding.spec
        typed = getattr(jax.typeof(arr), "sharding", None)
        if typed is not None and mesh_of(arr) is None:
            return P()  # not on a mesh: one device
        raise JaxOpError(
            f"torchtpu.jax_op {self.name}: the placement of input {name!r} is not known inside this program (a value "
            "computed in it, not a sharded input or parameter); pass in_specs= to jax_op"
        )


def _static_shape(name, t) -> tuple:
    try:
        return tuple(int(s) for s in t.shape)
    except Exception:  # an unbacked symbolic size
        raise JaxOpError(f"torchtpu.jax_op {name}: takes tensors of static shapes, got {tuple(t.shape)}") from None


def _check_spec(name, what, shape, spec, sizes):
    spec = tuple(spec)
    if len(spec) > len(shape):
        raise JaxOpError(
            f"torchtpu.jax_op {name}: in_spec {P(*spec)} of {what} has more entries than its {len(shape)} dims"
        )
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        axes = entry if isinstance(entry, tuple) else (entry,)
        unknown = [a for a in axes if a not in sizes]
        if unknown:
            raise JaxOpError(
                f"torchtpu.jax_op {name}: in_spec {P(*spec)} of {what} names mesh axes {unknown} the mesh "
                f"{tuple(sizes)} does not have"
            )
        parts = 1
        for a in axes:
            parts *= sizes[a]
        if shape[d] % parts:
            raise JaxOpError(
                f"torchtpu.jax_op {name}: {what}'s dim {d} of size {shape[d]} does not split into the {parts} shards "
                f"of {P(*spec)} over mesh {sizes}"
            )
