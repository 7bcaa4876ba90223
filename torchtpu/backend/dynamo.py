"""`torch.compile(model, backend="tpu")`: Dynamo + AOTAutograd graphs lowered to XLA.

Pipeline:
1. Dynamo captures a graph of the user's Python (graph breaks fall back to eager tpu, guards
   and recompilation are Dynamo's own).
2. AOTAutograd (with PyTorch's core-ATen decompositions) turns it into a forward graph and,
   when something requires grad, a backward graph, both in core ATen.
3. Each ATen graph becomes one `jax.jit` program: its placeholders are the jax arrays of the
   tpu tensors passed in (parameters and buffers included: Dynamo lifts them to graph inputs,
   so they are never baked in as constants), and the graph is run *on tpu tensors that wrap
   jax tracers*. Every node therefore goes through `TpuTensor.__torch_dispatch__` in traced
   mode, i.e. through the same op table (`optable.LOWERINGS`, dtype rules, decompositions)
   as eager mode; there is no second op table. Outputs come back as `TpuTensor`s.

Why Dynamo needs help to see tpu tensors, and why this fix:
Dynamo's `VariableBuilder._wrap` only treats a `torch.Tensor` as a tensor if its type keeps
`torch.Tensor.__torch_dispatch__` or if it is a *traceable wrapper subclass* (one with
`__tensor_flatten__`); anything else becomes a `UserDefinedObjectVariable`.
`config.traceable_tensor_subclasses` is only consulted by `utils.istensor`, which is why
setting it did not help. The alternatives considered:

- `__tensor_flatten__`/`__tensor_unflatten__` would make Dynamo and AOTAutograd treat a
  TpuTensor as a *composite* of inner torch tensors and desugar it into them. A TpuTensor has
  no inner torch tensors (its data is a jax.Array), so the graph would lose its inputs; it
  would also turn every guard into slow Python subclass-metadata guards.
- Re-implementing the device as a C++-backed PrivateUse1 tensor would make Dynamo see plain
  tensors, but it replaces the whole eager design.

What is actually true of a TpuTensor is what is true of a C++ PrivateUse1 tensor: its
`__torch_dispatch__` is the *backend kernel* of the `tpu` device, below autograd and below
every mode Dynamo and AOTAutograd use (fake, functional, proxy). Dynamo never runs real
kernels while tracing; it fakeifies inputs, and `MetaConverter` already fakeifies a
non-traceable subclass into a plain `FakeTensor` with `fake_device=tpu:0` (metadata only). So
the robust fix is to tell Dynamo's two classification points that this type is a plain
tensor: `VariableBuilder._type_dispatch()` maps `TpuTensor` to `wrap_tensor` (as it maps
`torch.Tensor` and `nn.Parameter`), and `infer_subclass_type` reports no subclass for it (so
it gets a `TensorVariable`, not a `__torch_function__` override variable; TpuTensor disables
`__torch_function__`). Everything downstream (fakeification, TENSOR_MATCH guards in C++,
parameter lifting, AOTAutograd) is PyTorch's ordinary tensor path. The shim is
installed once on import and touches no other type.

Static shapes by default: `torch.compile`'s `dynamic=None` normally means "automatic dynamic"
(a second shape recompiles with symbolic sizes). jax.jit needs concrete shapes, so a symbolic
graph would be silently re-specialised per shape: the invisible recompiles torch_xla users
complain about. While Dynamo fakeifies a tpu tensor for the tpu backend, automatic dynamic
shapes are therefore off unless the user asked for dynamism (`dynamic=True`, or
`torch._dynamo.mark_dynamic`, which still win). Every graph handed to the backend is counted
in `torchtpu.cache_stats()` (`dynamo_compiles`, `dynamo_recompiles`), every XLA program
trace (`dynamo_graph_traces`) and launch (`dynamo_graph_calls`), and with
`TORCHTPU_LOG_RECOMPILES=1` each recompile is printed with the inputs whose shape/dtype
changed (and Dynamo's own guard-failure reason).
"""

from __future__ import annotations

import os
import sys

import jax
import torch

from . import random as tpu_random
from .state import tracing
from .tensor import NOT_DENSE, TpuTensor, memory_order, new_base, storage_of
from .views import array_of

# ----------------------------------------------------------------------------- counters


class DynamoStats:
    def __init__(self):
        self.reset()

    def reset(self):
        self.compiles = 0  # graphs Dynamo handed to the tpu backend (first compiles + recompiles)
        self.recompiles = 0  # of which: recompiles of an already compiled frame
        self.graph_traces = 0  # ATen graphs traced into an XLA program (each one XLA compile)
        self.graph_calls = 0  # XLA executable launches of compiled ATen graphs

    def snapshot(self) -> dict:
        return {
            "dynamo_compiles": self.compiles,
            "dynamo_recompiles": self.recompiles,
            "dynamo_graph_traces": self.graph_traces,
            "dynamo_graph_calls": self.graph_calls,
        }


STATS = DynamoStats()


def _log_enabled() -> bool:
    return bool(os.environ.get("TORCHTPU_LOG_RECOMPILES"))


def _log(msg: str) -> None:
    print(f"[torchtpu] {msg}", file=sys.stderr)


# ----------------------------------------------------------------------------- Dynamo shim

_installed = False


def _is_tpu_backend(tx) -> bool:
    fn = getattr(tx.output, "compiler_fn", None)
    for _ in range(4):  # WrapBackendDebug -> _TorchCompileWrapper -> backend
        if fn is None:
            return False
        if fn is tpu_backend:
            return True
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
    return False


def install() -> None:
    """Teach Dynamo that a TpuTensor is a plain tensor (see the module docstring)."""
    global _installed
    if _installed:
        return
    from torch._dynamo import config as dconfig
    from torch._dynamo.variables import builder

    VariableBuilder = builder.VariableBuilder
    wrap_tensor = VariableBuilder.wrap_tensor

    def wrap_tpu_tensor(self, value):
        if not dconfig.assume_static_by_default or not dconfig.automatic_dynamic_shapes or not _is_tpu_backend(self.tx):
            return wrap_tensor(self, value)
        # dynamic=None with the tpu backend: static shapes (mark_dynamic still applies)
        with dconfig.patch(automatic_dynamic_shapes=False):
            return wrap_tensor(self, value)

    for trace_numpy in (False, True):
        VariableBuilder._type_dispatch_impl(trace_numpy)[TpuTensor] = wrap_tpu_tensor

    infer_subclass_type = builder.infer_subclass_type

    def infer_subclass_type_tpu(value):
        if type(value) is TpuTensor:
            return None
        return infer_subclass_type(value)

    builder.infer_subclass_type = infer_subclass_type_tpu
    dconfig.traceable_tensor_subclasses.add(TpuTensor)  # utils.istensor
    # The device's own Python (dispatch, lowerings, transfers) is backend code, like
    # torch's: code run eagerly at a graph break must not be captured by Dynamo.
    from torch._dynamo import trace_rules

    trace_rules.add("torchtpu.backend")

    # At run time AOTAutograd checks that each tangent has the type it traced (a plain
    # tensor); a tpu tensor *is* that plain tensor on the tpu device.
    def coerce_tangent(self, expected_meta, expected_type=None):
        if expected_meta is None and expected_type in (None, torch.Tensor):
            return self
        return None

    TpuTensor.__coerce_same_metadata_as_tangent__ = coerce_tangent
    _installed = True


# ----------------------------------------------------------------------------- ATen graph -> XLA


class _CompiledGraph:
    """One AOTAutograd graph (forward, backward or inference) as a jax.jit program.

    Called with AOTAutograd's boxed convention: a list of arguments (tpu tensors, Python ints
    for symbolic sizes), which is cleared so inputs can be freed early.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, name: str):
        self.gm = gm
        self.name = name
        self.out_specs: dict = {}  # statics -> [("T", dtype, device) | ("V", value)]
        self.n_random: dict = {}
        self.jitted = jax.jit(self._trace, static_argnums=(2, 3))

    def _trace(self, arrays, key_data, kinds, statics):
        STATS.graph_traces += 1
        if self.out_specs and _log_enabled():
            shapes = [list(a.shape) for a in arrays]
            _log(
                f"compiling the {self.name} graph again for new concrete sizes (symbolic sizes {list(statics)}, "
                f"input shapes {shapes}): the graph has dynamic shapes, XLA programs have static ones"
            )
        it_a = iter(arrays)
        it_s = iter(statics)
        args = []
        for kind in kinds:
            if kind[0] == "T":
                args.append(_strided(next(it_a), kind[2], kind[1], kind[3]))
            else:
                args.append(next(it_s))
        prev_keys = tpu_random.TRACED
        tpu_random.TRACED = keys = tpu_random.TracedKeys(key_data)
        try:
            with tracing(), torch.no_grad():
                outs = _LayoutInterpreter(self.gm).run(*args)
        finally:
            tpu_random.TRACED = prev_keys
        if not isinstance(outs, (list, tuple)):
            outs = (outs,)
        spec = []
        out_arrays = []
        for o in outs:
            if isinstance(o, TpuTensor):
                out_arrays.append(array_of(o))
                spec.append(("T", o.dtype, storage_of(o).device_index, o.stride()))
            elif isinstance(o, torch.Tensor):
                raise NotImplementedError(
                    f"torchtpu: a torch.compile graph produced a tensor on {o.device}; only tpu outputs are supported"
                )
            else:
                spec.append(("V", o))
        self.out_specs[(kinds, statics)] = spec
        self.n_random[(kinds, statics)] = keys.count
        return out_arrays

    def __call__(self, args):
        arrays = []
        kinds = []
        statics = []
        for a in args:
            if type(a) is TpuTensor:
                arrays.append(array_of(a))
                kinds.append(("T", a.dtype, storage_of(a).device_index, a.stride()))
            elif isinstance(a, torch.Tensor):
                if a.device.type != "cpu":
                    raise TypeError(f"torchtpu: torch.compile(backend='tpu') got a tensor on {a.device}")
                arrays.append(jax.numpy.asarray(a.detach().numpy()))
                kinds.append(("T", a.dtype, 0, a.stride()))
            else:
                v = int(a) if isinstance(a, torch.SymInt) else a
                statics.append(v)
                kinds.append(("S",))
        args.clear()
        kinds = tuple(kinds)
        statics = tuple(statics)
        gen = tpu_random.generator(0)
        key_data = tpu_random.key_data_for_step(gen)
        out_arrays = self.jitted(arrays, key_data, kinds, statics)
        STATS.graph_calls += 1
        gen.offset += self.n_random[(kinds, statics)]
        it = iter(out_arrays)
        outs = []
        for s in self.out_specs[(kinds, statics)]:
            if s[0] == "T":
                outs.append(_strided(next(it), s[2], s[1], s[3]))
            else:
                outs.append(s[1])
        return outs


class _LayoutInterpreter(torch.fx.Interpreter):
    """Runs an ATen graph on traced tpu tensors, giving each fresh result the strides the
    graph was traced with (`node.meta["val"]`, from PyTorch's meta functions).

    Our lowerings return row-major results, while PyTorch's pointwise ops keep their inputs'
    layout and some kernels promise their own (attention outputs in the query's layout). A
    later `view` in the graph was checked against the traced strides and fails (or means
    something else) on others. Only the wrapper's strides change: arrays hold logical values."""

    def run_node(self, n):
        out = super().run_node(n)
        val = n.meta.get("val")
        if type(out) is TpuTensor and isinstance(val, torch.Tensor):
            return _with_strides(out, val)
        return out


def _with_strides(t, val):
    strides = val.stride()
    if t._vw or strides == t.stride() or val.storage_offset() or tuple(val.shape) != tuple(t.shape):
        return t
    order = memory_order(tuple(t.shape), strides)
    if order is NOT_DENSE:
        return t
    if order is not None:
        storage_of(t).order = order
    return TpuTensor(storage_of(t), (), tuple(t.shape), t.dtype, strides=tuple(strides))


def _strided(array, device_index, dtype, strides):
    """A tpu tensor over `array` whose strides are `strides`: graphs are traced against the
    strides PyTorch's meta functions give (a transposed view, an attention output in its
    query's layout), and later view ops check them. The array holds the logical values
    whatever the strides say."""
    t = new_base(array, device_index, dtype)
    if tuple(strides) != t.stride():
        order = memory_order(tuple(array.shape), tuple(strides))
        if order is not None and order is not NOT_DENSE:
            storage_of(t).order = order
        t = TpuTensor(storage_of(t), (), tuple(array.shape), dtype, strides=tuple(strides))
    return t


def _compiler(name):
    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        graph = _CompiledGraph(gm, example_inputs, name)

        def run(args):
            return graph(args)

        run._boxed_call = True  # AOTAutograd's boxed calling convention (args list is cleared)
        run.graph = graph
        return run

    return compile_graph


# ----------------------------------------------------------------------------- recompile bookkeeping

_LAST_INPUTS: dict = {}  # Dynamo frame id -> {input source name: (shape, dtype)}


def _input_signature(gm: torch.fx.GraphModule) -> dict:
    sig = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        arg = node.meta.get("grapharg")
        source = getattr(arg, "source", None)
        name = source.name if source is not None and hasattr(source, "name") else node.name
        name = name() if callable(name) else name
        val = node.meta.get("example_value")
        if isinstance(val, torch.Tensor):
            sig[name] = (tuple(val.shape), val.dtype)
        elif isinstance(val, (int, float, bool, torch.SymInt)):
            sig[name] = ("value", str(val))
    return sig


def _describe_change(old: dict, new: dict) -> list[str]:
    changes = []
    for name, now in new.items():
        before = old.get(name)
        if before is None:
            changes.append(f"new input {name}")
        elif before != now:
            if before[0] == "value" or now[0] == "value":
                changes.append(f"{name} changed from {before[1]} to {now[1]}")
            elif before[1] != now[1]:
                changes.append(f"{name} dtype changed from {before[1]} to {now[1]}")
            else:
                changes.append(f"{name} shape changed from {list(before[0])} to {list(now[0])}")
    return changes


def _dynamo_reason() -> str | None:
    try:
        from torch._dynamo.utils import get_metrics_context

        return get_metrics_context()._metrics.get("recompile_reason")  # set by convert_frame
    except Exception:
        return None


def _record_compile(gm: torch.fx.GraphModule) -> None:
    STATS.compiles += 1
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    frame = getattr(cid, "frame_id", None)
    sig = _input_signature(gm)
    recompile = cid is not None and (getattr(cid, "frame_compile_id", 0) or 0) > 0
    old = _LAST_INPUTS.get(frame)
    _LAST_INPUTS[frame] = sig
    if not recompile:
        return
    STATS.recompiles += 1
    if _log_enabled():
        changes = _describe_change(old or {}, sig)
        what = "; ".join(changes) if changes else "input shapes and dtypes unchanged"
        reason = _dynamo_reason()
        extra = f" (Dynamo guard: {reason.strip()})" if reason else ""
        _log(f"torch.compile(backend='tpu') recompiling [{cid}]: {what}{extra}")


# ----------------------------------------------------------------------------- the backend


def _decompositions():
    from torch._decomp import core_aten_decompositions

    return core_aten_decompositions()


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The Dynamo backend registered as "tpu"."""
    from torch._dynamo.backends.common import aot_autograd

    _record_compile(gm)
    aot = aot_autograd(
        fw_compiler=_compiler("forward"),
        bw_compiler=_compiler("backward"),
        inference_compiler=_compiler("inference"),
        decompositions=_decompositions(),
    )
    return aot(gm, example_inputs)


def _on_tpu(gm: torch.fx.GraphModule, example_inputs) -> bool:
    """Whether a Dynamo graph computes on tpu: an input, or a value it makes, is a tpu tensor."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type == "tpu":
            return True
    for node in gm.graph.nodes:
        val = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(val, torch.Tensor) and val.device.type == "tpu":
            return True
    return False


def _route_tpu_graphs_past_inductor() -> None:
    """torch.compile's default backend, Inductor, generates no code for tpu (torchtitan compiles
    flex_attention, create_block_mask and varlen attention with it, whatever backend its job
    names): a graph that computes on tpu and reaches Inductor is compiled by the tpu backend."""
    wrapper = torch._TorchCompileInductorWrapper
    inductor = wrapper.__call__
    if getattr(inductor, "_torchtpu_routes", False):
        return

    def __call__(self, model_, inputs_, *, config_patches=None):
        if _on_tpu(model_, inputs_):
            return tpu_backend(model_, inputs_)
        return inductor(self, model_, inputs_, config_patches=config_patches)

    __call__._torchtpu_routes = True
    wrapper.__call__ = __call__


def register() -> None:
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    from . import flex_attention, rng_prims

    install()
    rng_prims.install_compiled()
    flex_attention.install_compiled()
    _route_tpu_graphs_past_inductor()
    if "tpu" not in _COMPILER_FNS:
        register_backend(name="tpu", compiler_fn=tpu_backend)


class _RegisterOnImport:
    """Registers the backend right after `torch._dynamo` is first imported (by torch.compile
    or by the user), so `import torchtpu` does not pay Dynamo's ~2.5 s import itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch._dynamo":
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            register()

        loader.exec_module = exec_then_register
        return spec


# ----------------------------------------------------------------------------- tensor literals under fake tensors


def _literals_made_on_cpu(mode) -> bool:
    # FakeTensorMode's answer to "would making a real tensor initialise a device?". With the
    # answer yes, `torch.tensor(data, device=d)` traced under fake tensors builds its data on
    # the CPU, lifts that, and moves it with a traced `_to_copy` (what PyTorch does for CUDA
    # code traced on a machine without a GPU). With the answer no (PyTorch's default when a
    # PrivateUse1 device is available), the literal is made as a *real* tpu tensor below the
    # Python key, and FakeTensorMode, which sees an unknown tensor subclass, hands it back
    # untraced: a real tpu tensor then meets fake ones (the KV cache's `torch.tensor([])` in
    # transformers). Literals on the CPU are right for every device: tracing never needs the
    # device's own copy of a constant.
    return True


def _install_fake_literal_rule() -> None:
    from torch._subclasses import fake_tensor

    fake_tensor.FakeTensorMode.avoid_device_init = property(_literals_made_on_cpu)


_install_fake_literal_rule()

if "torch._dynamo" in sys.modules:
    register()
else:
    sys.meta_path.insert(0, _RegisterOnImport())
