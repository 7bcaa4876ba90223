"""Per-device code: `local_map`, PyTorch's functional collectives, and loss parallelism.

Everywhere else a tpu tensor is the *global* value and XLA places the collectives. Code
that wants to talk about each device's piece and exchange pieces explicitly runs inside
`local_map(fn, out_placements, in_placements, device_mesh)` (PyTorch's
`torch.distributed.tensor.experimental.local_map`): the inputs are split by
`in_placements`, `fn` sees one device's local tensors, and its outputs are stitched back by
`out_placements`. It lowers to `jax.shard_map`, is differentiable, and works in eager mode,
under `torchtpu.compile` and inside `torch.compile` graphs.

Inside `fn`, PyTorch's functional collectives on tpu tensors
(`torch.distributed._functional_collectives.all_reduce`, `all_gather_tensor`,
`reduce_scatter_tensor`, `all_to_all_single`) become XLA collectives over named mesh axes:
`lax.psum` / `all_gather` / `psum_scatter` / `all_to_all`. The group is a mesh dimension:
one of torchtpu's `DeviceMesh`es (1-D, or `(mesh, dim)`), or its dimension name ("tp").
"""

from __future__ import annotations

import contextlib

import jax
import torch
from jax import lax
from torch.distributed.tensor import Partial, Replicate, Shard

from ..backend import TpuTensor, array_of, custom, lower, new_base, tracing
from ..hardware import TP_AXIS
from . import placements as pl
from .mesh import DeviceMesh, current_mesh
from .vjp_saved import save_vjp, saved_vjp

__all__ = ["local_map", "loss_parallel", "vocab_parallel_cross_entropy"]

_c10d = torch.ops._c10d_functional


# ----------------------------------------------------------------------------- group names

_PREFIX = "tpu:"


def group_name(group) -> str:
    """The collective group name for a mesh dimension: "tpu:<axis>+<axis>"."""
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, dim = group
        return _PREFIX + "+".join(mesh.dims[mesh._index(dim)])
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"a collective over {group} needs one mesh dimension: pass (mesh, dim) or mesh['name']")
        return _PREFIX + "+".join(group.dims[0])
    if isinstance(group, str):
        return group
    raise TypeError(f"unsupported collective group {group!r} on tpu: use a torchtpu DeviceMesh dimension or its name")


def _axes(name: str) -> tuple[str, ...]:
    if name.startswith(_PREFIX):
        return tuple(name[len(_PREFIX) :].split("+"))
    mesh = current_mesh()
    if mesh is not None:
        root = mesh.root()
        if name in root.mesh_dim_names:
            return root.dims[root.mesh_dim_names.index(name)]
        if name in root._flattened:
            return root._flattened[name]
    return (name,)


def _install_group_resolution():
    import torch.distributed._functional_collectives as funcol

    original = funcol._resolve_group
    if getattr(original, "_torchtpu", False):
        return

    def resolve(group, tag=""):
        if isinstance(group, DeviceMesh) or (isinstance(group, tuple) and group and isinstance(group[0], DeviceMesh)):
            return group_name(group)
        return original(group, tag)

    resolve._torchtpu = True
    funcol._resolve_group = resolve

    c10d = funcol.c10d
    size_by_name = c10d._get_group_size_by_name

    def group_size(name):
        axes = _known_axes(name)
        if axes is None:
            return size_by_name(name)
        mesh = current_mesh()
        shape = mesh.jax_mesh.shape if mesh is not None else {}
        n = 1
        for a in axes:
            n *= shape[a]
        return n

    c10d._get_group_size_by_name = group_size


def _known_axes(name):
    if name.startswith(_PREFIX):
        return _axes(name)
    mesh = current_mesh()
    if mesh is not None and (name in mesh.root().mesh_dim_names or name in mesh.root()._flattened):
        return _axes(name)
    return None


_install_group_resolution()


def _collective(fn, name, what):
    try:
        return fn(_axes(name))
    except NameError as e:
        raise RuntimeError(
            f"{what} over mesh axes {_axes(name)} acts on per-device values: call it inside "
            "torchtpu.distributed.local_map(...) (outside, tensors are global and XLA places the collectives)"
        ) from e


_REDUCE = {"sum": lax.psum, "avg": lax.pmean, "max": lax.pmax, "min": lax.pmin}


def _reducer(op: str):
    f = _REDUCE.get(op.lower())
    if f is None:
        raise NotImplementedError(f"reduce op {op!r} is not supported on tpu; use one of {sorted(_REDUCE)}")
    return f


@lower(_c10d.all_reduce.default)
def _all_reduce(input, reduce_op, group_name):
    return _collective(lambda axes: _reducer(reduce_op)(input, axes), group_name, "all_reduce")


@lower(_c10d.all_gather_into_tensor.default)
def _all_gather(input, group_size, group_name):
    return _collective(lambda axes: lax.all_gather(input, axes, axis=0, tiled=True), group_name, "all_gather")


@lower(_c10d.reduce_scatter_tensor.default)
def _reduce_scatter(input, reduce_op, group_size, group_name):
    if reduce_op.lower() not in ("sum", "avg"):
        raise NotImplementedError(f"reduce_scatter with {reduce_op!r} is not supported on tpu (sum, avg)")

    def f(axes):
        out = lax.psum_scatter(input, axes, scatter_dimension=0, tiled=True)
        return out / group_size if reduce_op.lower() == "avg" else out

    return _collective(f, group_name, "reduce_scatter")


@lower(_c10d.all_to_all_single.default)
def _all_to_all(input, output_split_sizes, input_split_sizes, group_name):
    if len(set(output_split_sizes or [0])) > 1 or len(set(input_split_sizes or [0])) > 1:
        raise NotImplementedError("all_to_all_single with uneven splits is not supported on tpu")
    return _collective(lambda axes: lax.all_to_all(input, axes, 0, 0, tiled=True), group_name, "all_to_all")


@lower(_c10d.wait_tensor.default)
def _wait(input):
    return input


@custom(_c10d._wrap_tensor_autograd.default)
def _no_async_wrapper(args, kwargs):
    # XLA orders collectives inside the program; there is nothing to wait for
    return args[0]


# ----------------------------------------------------------------------------- local_map


def _spec(mesh, placements, ndim):
    if placements is None:
        return None
    if any(isinstance(p, Partial) for p in placements):
        raise NotImplementedError("local_map: Partial in/out placements are not supported on tpu; reduce inside fn")
    return pl.spec_for(mesh, placements, ndim)


def local_map(
    func, out_placements, in_placements=None, in_grad_placements=None, device_mesh=None, *, redistribute_inputs=True
):
    """Run `func` on each device's local pieces (torch's experimental `local_map`)."""
    mesh = device_mesh or current_mesh()
    if mesh is None:
        raise RuntimeError("local_map needs a device mesh: call torchtpu.distributed.init_device_mesh first")

    def wrapped(*args):
        tensor_idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ins = in_placements if in_placements is not None else [(Replicate(),) * mesh.ndim] * len(args)
        in_specs = []
        for i in tensor_idx:
            p = ins[i]
            if p is None:
                raise ValueError(f"local_map: argument {i} is a tensor but its in_placements entry is None")
            in_specs.append(_spec(mesh, p, args[i].dim()))
        single = not isinstance(out_placements, (list, tuple)) or (
            out_placements and isinstance(out_placements[0], (Shard, Replicate, Partial))
        )
        outs = [out_placements] if single else list(out_placements)
        tensors = [args[i] if isinstance(args[i], TpuTensor) else args[i].to("tpu") for i in tensor_idx]
        result = _LocalMap.apply(func, args, tensor_idx, mesh, in_specs, outs, *tensors)
        return result[0] if single else tuple(result)

    return wrapped


class _LocalMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, func, args, tensor_idx, mesh, in_specs, outs, *tensors):
        info = {}

        def body(*local_arrays):
            call = list(args)
            for i, a, t in zip(tensor_idx, local_arrays, tensors):
                call[i] = new_base(a, 0, t.dtype)
            with tracing(), torch.no_grad():
                out = func(*call)
            out = out if isinstance(out, (list, tuple)) else (out,)
            out = [o.wait() if type(o).__name__ == "AsyncCollectiveTensor" else o for o in out]
            info["dtypes"] = [o.dtype for o in out]
            return tuple(array_of(o) for o in out)

        arrays = [array_of(t) for t in tensors]
        # shapes of the local outputs, to build their specs
        local_in = [jax.ShapeDtypeStruct(_local_shape(a.shape, s, mesh), a.dtype) for a, s in zip(arrays, in_specs)]
        env = [(a, n) for a, n in mesh.jax_mesh.shape.items()]
        shapes = jax.make_jaxpr(body, axis_env=env, return_shape=True)(*local_in)[1]
        out_specs = tuple(_spec(mesh, p, len(s.shape)) for p, s in zip(outs, shapes))
        f = jax.shard_map(
            lambda *xs: body(*xs), mesh=mesh.jax_mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False
        )
        res, vjp = jax.vjp(f, *arrays)
        save_vjp(ctx, vjp)  # residuals as saved tensors: activation checkpointing drops and recomputes them
        return tuple(new_base(r, 0, dt) for r, dt in zip(res, info["dtypes"]))

    @staticmethod
    def backward(ctx, *grads):
        cot = tuple(array_of(g) for g in grads)
        gins = saved_vjp(ctx)(cot)
        return (None, None, None, None, None, None) + tuple(new_base(g, 0) for g in gins)


def _local_shape(shape, spec, mesh):
    shape = list(shape)
    for d, e in enumerate(spec):
        axes = () if e is None else ((e,) if isinstance(e, str) else tuple(e))
        for a in axes:
            shape[d] //= mesh.jax_mesh.shape[a]
    return tuple(shape)


# ----------------------------------------------------------------------------- loss parallelism


def vocab_parallel_cross_entropy(
    logits, target, *, ignore_index=-100, reduction="mean", mesh=None, vocab_placements=None
):
    """Cross-entropy of logits whose last (vocabulary) dim is sharded, without gathering them:
    the log-sum-exp reduces over the vocabulary shards and the target logit is picked by a
    one-hot mask (an elementwise product), so only per-row scalars cross devices."""
    if mesh is not None and vocab_placements is not None:
        from .batch import activation_batch_axes
        from .dtensor import shard_as

        # The token dim (0) goes over the data-parallel axes, as the batch the tokens come from:
        # logits the model laid out so already keep their layout, and the logits of a chunk of
        # positions (torchtpu.train.loss) are not gathered over the batch.
        logits = shard_as(
            logits,
            mesh,
            vocab_placements,
            unconstrained=tuple(range(logits.dim() - 1)),
            batch_axes=activation_batch_axes(mesh),
        )
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    hit = target.unsqueeze(-1) == vocab
    picked = (logits * hit).sum(-1)
    loss = lse - picked
    valid = target != ignore_index
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp(min=1)


class _LossParallelMode(torch.overrides.TorchFunctionMode):
    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.cross_entropy:
            inp, target = args[0], args[1]
            if (
                kwargs.get("weight") is None
                and not kwargs.get("label_smoothing")
                and target.dtype != inp.dtype
                and inp.device.type == "tpu"
            ):
                tp = self.mesh
                placements = (Shard(-1),) if tp is not None and tp.ndim == 1 else None
                # (the mode is off while this runs, so the torch calls below dispatch normally)
                return vocab_parallel_cross_entropy(
                    inp,
                    target,
                    ignore_index=kwargs.get("ignore_index", -100),
                    reduction=kwargs.get("reduction", "mean"),
                    mesh=tp,
                    vocab_placements=placements,
                )
        return func(*args, **kwargs)


@contextlib.contextmanager
def loss_parallel(mesh: DeviceMesh | None = None):
    """Within this context `F.cross_entropy` on tpu logits computes over vocabulary-sharded
    logits without gathering them (torch's `loss_parallel`). `mesh`: the tensor-parallel mesh
    dim the vocabulary is split over (default: the root mesh's "tp" dim, if any)."""
    if mesh is None:
        root = current_mesh()
        mesh = root[TP_AXIS] if root is not None and TP_AXIS in root.mesh_dim_names else None
    with _LossParallelMode(mesh):
        yield
