"""Attention on TPU through Pallas flash-attention kernels (pure JAX functions).

`F.scaled_dot_product_attention` on tpu lowers to the fused attention in nn.py. When the
program is compiled for TPU, nn.py routes it here (through `jax.lax.platform_dependent`, so
one traced program still compiles for CPU or GPU with the blocked pure-JAX attention):

- forward: torchtpu's forward kernel (attention_kernels.py), which also writes the softmax's
  log-sum-exp; it goes back to PyTorch's autograd as the fused op's `logsumexp` output;
- backward: its one-pass backward kernel, fed that log-sum-exp, which recomputes the scores
  block by block once for dQ, dK and dV, accumulating a whole query head's dQ and a whole
  key/value head's dK and dV in VMEM. Where the chip's VMEM cannot hold those (v4's 16 MiB,
  or long sequences: `_one_pass_vmem_limit`), or TORCHTPU_FLASH_BACKWARD=two-kernel asks, the
  dK/dV and dQ kernels run instead, each recomputing the scores.

The kernels take grouped-query attention's key/value heads as they are (each query head reads
its group's head; the backward sums a group's gradients inside the kernel) and keep the softmax
statistics as rows (see attention_kernels.py).

Each kernel carries the cost it declares to XLA (`kernel_costs`): the FLOPs of the score and
output matmuls over the blocks it actually visits (a causal kernel skips the blocks above the
diagonal), its exponentials and the bytes it reads and writes; XLA's cost analysis counts
them.

Head dims: the kernels take one head dim for q, k and v, of 64, 128 or 256. Other head dims
from 64 to 256, and a value head dim that differs from the query/key one (DeepSeek-V3's
multi-head latent attention: 192 and 128), run the kernels on zero-padded operands: q and k
padded to the next of those sizes leave q.k unchanged (the softmax scale stays the one of the
original head dim), v padded to the same size gives extra output columns that are sliced off,
and the gradients' padding columns are sliced away. The declared costs are the padded work
(`padded_head_dim`).

Where the kernel cannot apply (see `unsupported_reason`), nn.py keeps the blocked path:
sequence lengths that are not multiples of 128, query/key head dims below 64 or any head dim
above 256, dtypes other than float32/bfloat16, and dropout.

Sharding: a Pallas kernel is a custom call that XLA's partitioner cannot split, so inside a
program over a device mesh the kernel runs per shard under `jax.shard_map`: batch over the
mesh's data-parallel axes, heads over "tp" (the layout FSDP and tensor parallelism give
attention's inputs). Attention is independent per (batch, head), so any such split gives the
same values; a layout that differs from XLA's only costs a reshard. Key/value heads split over
"tp" as the query heads are; where "tp" does not divide them, they are repeated to one per
query head first (and their gradients summed back). The mesh is the one JAX
records in the inputs' types inside a jit over mesh-sharded arrays (torchtpu.compile, eager
ops, torch.compile alike). A multi-device program whose attention inputs carry no mesh cannot
run the kernel: JAX then raises "Mosaic kernels cannot be automatically partitioned"; run it
with TORCHTPU_PALLAS_ATTENTION=0.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from torchtpu.backend.ops import attention_kernels
from torchtpu.hardware import TP_AXIS

from ..pallas_mode import interpret_kernels, interpreting, mesh_of  # noqa: F401  (the kernels here and in *_tpu.py use them)

__all__ = [
    "enabled",
    "backward_mode",
    "unsupported_reason",
    "attention_forward",
    "attention_backward",
    "kernel_costs",
    "padded_head_dim",
    "interpret_kernels",
    "interpreting",
    "MASK_VALUE",
    "mesh_of",
    "bind_pallas",
]

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # the kernels' "minus infinity" (finite: exp() stays defined)
_LANES = 128  # Mosaic tiles: sequence blocks are multiples of 128
_HEAD_DIMS = (64, 128, 256)
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


# ----------------------------------------------------------------------------- when it applies


def enabled() -> bool:
    """TORCHTPU_PALLAS_ATTENTION=0 keeps the blocked JAX attention on TPU too (to compare, or to
    step around a kernel problem); read when a program is traced."""
    return os.environ.get("TORCHTPU_PALLAS_ATTENTION", "1").strip().lower() not in ("0", "false", "no", "off")


def unsupported_reason(q_shape, k_shape, v_shape, dtype) -> str | None:
    """Why the kernel cannot run attention of these (B, H, L, D) shapes, or None if it can."""
    if not enabled():
        return "TORCHTPU_PALLAS_ATTENTION=0"
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        return "inputs are not 4-D (batch, heads, seq, head_dim)"
    if jnp.dtype(dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(dtype)} (the kernel takes float32 or bfloat16)"
    (b, h, L, d), (bk, hk, S, dk), (bv, hv, Sv, dv) = q_shape, k_shape, v_shape
    if not (b == bk == bv and hk == hv and S == Sv and d == dk):
        return f"q {q_shape}, k {k_shape}, v {v_shape} differ in batch, kv heads, kv length or q/k head dim"
    if hk == 0 or h % hk:
        return f"{h} query heads are not a multiple of {hk} key/value heads"
    if L % _LANES or S % _LANES or L == 0 or S == 0:
        return f"sequence lengths {L}, {S} are not multiples of {_LANES}"
    if d < _HEAD_DIMS[0] or max(d, dv) > _HEAD_DIMS[-1] or dv == 0:
        return (
            f"q/k head dim {d}, v head dim {dv} (the kernel is used for q/k head dims from {_HEAD_DIMS[0]} and"
            f" head dims up to {_HEAD_DIMS[-1]}, zero-padded to {_HEAD_DIMS})"
        )
    return None


def padded_head_dim(qk_dim: int, v_dim: int) -> int:
    """The head dim the kernels run q, k and v at: the smallest of 64/128/256 that holds both."""
    return next(p for p in _HEAD_DIMS if p >= max(qk_dim, v_dim))


def _pad_last(x, size):
    extra = size - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _block(n: int) -> int:
    for b in (512, 256):
        if n % b == 0:
            return b
    return _LANES


# ----------------------------------------------------------------------------- declared costs


def _visited_fraction(L: int, S: int, bq: int, bk: int, causal: bool) -> float:
    """Share of (query block, key block) pairs a kernel computes (all, or those on or below
    the diagonal when causal, as the library's kernels decide)."""
    if not causal:
        return 1.0
    nq, nk = L // bq, S // bk
    run = sum(1 for i in range(nq) for j in range(nk) if (i + 1) * bq - 1 > j * bk)
    return run / (nq * nk)


def kernel_costs(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    *,
    causal: bool,
    itemsize: int = 2,
    with_bias: bool = False,
    library: bool = False,
) -> dict:
    """The costs the kernels declare to XLA for attention of these sizes (per program
    that runs them: pass per-shard sizes for a sharded program), as
    {"forward"|"backward"|"backward_dkv"|"backward_dq": pallas CostEstimate}.

    FLOPs are 2*M*N*K per matmul over the visited blocks: forward s = qk^T and o = pv (2);
    dK/dV kernel s, dv += p^T do, dp = do v^T, dk += ds^T q (4); dQ kernel s, dp, dq += ds k (3);
    the one-pass backward s, dv, dp, dk and dq (5).
    Transcendentals are the exp of each visited score (once per kernel). Bytes are each
    kernel's inputs and outputs, once, keys and values once per query head (each query head's
    pass reads its key/value head's blocks), except the one-pass backward's q, do and their
    statistics, read again for each key block it visits, and the float32 softmax statistics: torchtpu's
    kernels write one row (the log-sum-exp) and read two (it and di); with `library`, the
    costs of JAX's library kernels for the same attention, which write l and m and read l, m
    and di, each broadcast to 128 lanes. `head_dim` is the one the kernels run at
    (`padded_head_dim` of the q/k and v head dims): zero-padded columns are computed too."""
    from jax.experimental import pallas as pl

    frac = _visited_fraction(q_len, kv_len, _block(q_len), _block(kv_len), causal)
    pairs = batch * heads * q_len * kv_len * frac
    mm = 2.0 * pairs * head_dim  # one (L, S, D) matmul
    qkv = batch * heads * head_dim * itemsize
    q_bytes, kv_bytes = qkv * q_len, qkv * kv_len
    stats = batch * heads * q_len * (_LANES if library else 1) * 4  # one float32 statistic per query row
    n_fwd, n_bwd = (2, 3) if library else (1, 2)
    bias = batch * heads * q_len * kv_len * 4 if with_bias else 0

    def est(flops, trans, nbytes):
        return pl.CostEstimate(flops=int(flops), transcendentals=int(trans), bytes_accessed=int(nbytes))

    # the one-pass backward reads q, do and their statistics again for each key block it visits
    q_reads = max(1.0, (kv_len // _block(kv_len)) * frac)
    return {
        "forward": est(2 * mm, pairs, 2 * q_bytes + 2 * kv_bytes + n_fwd * stats + bias),
        "backward_dkv": est(4 * mm, pairs, 2 * q_bytes + 4 * kv_bytes + n_bwd * stats + bias),
        "backward_dq": est(3 * mm, pairs, 3 * q_bytes + 2 * kv_bytes + n_bwd * stats + 2 * bias),
        "backward": est(5 * mm, pairs, q_reads * (2 * q_bytes + n_bwd * stats) + q_bytes + 4 * kv_bytes + bias),
    }


def bind_pallas(fn, args, costs, interpret):
    """Run `fn(*args)` with its pallas_calls given `costs` (in call order) and, when
    interpreting, run as plain JAX (Pallas interpret mode) instead of Mosaic."""
    closed = jax.make_jaxpr(fn)(*args)
    costs = list(costs)
    eqns = []
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            params = dict(eqn.params)
            if costs:
                params["cost_estimate"] = costs.pop(0)
            if interpret:
                params["interpret"] = True
            eqn = eqn.replace(params=params)
        eqns.append(eqn)
    jaxpr = closed.jaxpr.replace(eqns=eqns)
    return jax.core.eval_jaxpr(jaxpr, closed.consts, *jax.tree.leaves(args))


# ----------------------------------------------------------------------------- interpret mode


# interpret_kernels, interpreting: backend/pallas_mode.py (jax_op.py shares them)


# ----------------------------------------------------------------------------- per-shard calls


@dataclasses.dataclass(frozen=True)
class _Split:
    mesh: object
    batch: object  # PartitionSpec entry for the batch dim
    heads: object  # ... and for the heads dim

    def spec(self, ndim):
        return P(self.batch, self.heads, *([None] * (ndim - 2)))


def _split_for(batch: int, heads: int, *arrays) -> _Split | None:
    mesh = mesh_of(*arrays)
    if mesh is None or mesh.size == 1:
        return None
    sizes = dict(mesh.shape)
    head_axis = TP_AXIS if sizes.get(TP_AXIS, 1) > 1 and heads % sizes[TP_AXIS] == 0 else None
    batch_axes = tuple(a for a in mesh.axis_names if a != TP_AXIS and sizes[a] > 1)
    if batch_axes and batch % math.prod(sizes[a] for a in batch_axes):
        batch_axes = ()  # an odd batch stays whole on each device (correct, only slower)
    if not batch_axes and head_axis is None:
        return _Split(mesh, None, None)
    return _Split(mesh, batch_axes[0] if len(batch_axes) == 1 else (batch_axes or None), head_axis)


def _per_shard(fn, split: _Split | None, in_ndims, out_ndims):
    if split is None:
        return fn
    return jax.shard_map(
        fn,
        mesh=split.mesh,
        in_specs=tuple(split.spec(n) for n in in_ndims),
        out_specs=tuple(split.spec(n) for n in out_ndims),
        check_vma=False,
    )


# ----------------------------------------------------------------------------- forward / backward


def _bias_of(mask, shape, scale):
    """The kernels' additive bias of `shape` (B, H, L, S) from a boolean or float attention
    mask, and which entries are kept (PyTorch gives a row with no key a zero output).

    The kernels add the bias to q.k before multiplying by the scale, so the bias is divided by
    it here; masked entries become a finite large negative number (exp gives 0), because -inf
    would make the kernels' running maximum -inf and exp(-inf - -inf) NaN."""
    floor = jnp.float32(MASK_VALUE / max(1.0, scale))
    if mask.dtype == jnp.bool_:
        keep = jnp.broadcast_to(mask, shape)
        return jnp.where(keep, jnp.float32(0), floor), keep
    bias = jnp.broadcast_to(mask.astype(jnp.float32), shape)
    return jnp.maximum(bias / jnp.float32(scale), floor), bias > -jnp.inf


def _rows_alive(keep, causal):
    if causal:
        L, S = keep.shape[-2:]
        keep = keep & jnp.tril(jnp.ones((L, S), jnp.bool_))
    return jnp.any(keep, axis=-1)


def _kv_heads_for(split, heads: int, kv_heads: int) -> int:
    """How many key/value heads the kernels get: k and v as they are (each query head reads its
    group's head), unless the heads are split over the tensor-parallel axis and that split
    does not divide the key/value heads; then they are repeated to one per query head first."""
    if split is None or split.heads is None or kv_heads % dict(split.mesh.shape)[split.heads] == 0:
        return kv_heads
    return heads


def _repeat_heads(x, heads):
    rep = heads // x.shape[1]
    return x if rep == 1 else jnp.repeat(x, rep, axis=1)


def attention_forward(q, k, v, mask=None, *, causal: bool, scale: float):
    """Attention of q (B, H, L, D) over k, v (B, Hkv, S, D) with Pallas kernels: (out, lse),
    lse (B, H, L) float32 (-inf for rows with no key). `mask`: boolean (True = attend) or
    additive float, broadcastable to (B, H, L, S)."""
    B, H, L, D = q.shape
    S, Hkv, Dv = k.shape[2], k.shape[1], v.shape[-1]
    Dp = padded_head_dim(D, Dv)
    interpret = interpreting()
    bq, bk = _block(L), _block(S)
    bias = alive = None
    if mask is not None:
        bias, keep = _bias_of(mask, (B, H, L, S), scale)
        alive = _rows_alive(keep, causal)
    split = _split_for(B, H, q, k, v)
    kv_heads = _kv_heads_for(split, H, Hkv)
    k, v = _repeat_heads(k, kv_heads), _repeat_heads(v, kv_heads)
    b_loc, h_loc = _local(B, H, split)
    costs = kernel_costs(b_loc, h_loc, L, S, Dp, causal=causal, itemsize=q.dtype.itemsize, with_bias=bias is not None)

    def kernel(q, k, v, *rest):
        bias = rest[0] if rest else None
        q, k, v = (_pad_last(x, Dp) for x in (q, k, v))

        def impl(q, k, v, bias):
            return attention_kernels.forward(
                q, k, v, bias, causal=causal, scale=scale, mask_value=MASK_VALUE, block_q=bq, block_k=bk
            )

        with jax.enable_x64(False):  # Mosaic index maps are 32-bit
            o, lse = bind_pallas(impl, (q, k, v, bias), [costs["forward"]], interpret)
        return o[..., :Dv], lse[:, :, 0]

    operands = (q, k, v) + ((bias,) if bias is not None else ())
    out, lse = _per_shard(kernel, split, [4] * len(operands), [4, 3])(*operands)
    if alive is not None:
        out = jnp.where(alive[..., None], out, jnp.zeros((), out.dtype))
        lse = jnp.where(alive, lse, -jnp.inf)
    return out, lse


def attention_backward(grad_out, q, k, v, out, lse, mask=None, *, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of `attention_forward`, from its output and log-sum-exp."""
    B, H, L, D = q.shape
    S, Hkv, Dv = k.shape[2], k.shape[1], v.shape[-1]
    Dp = padded_head_dim(D, Dv)
    interpret = interpreting()
    bq, bk = _block(L), _block(S)
    g = grad_out.astype(q.dtype)
    bias = None
    if mask is not None:
        bias, _ = _bias_of(mask, (B, H, L, S), scale)
    # rows with no key (lse -inf) have a zero output that does not depend on q, k, v: their
    # incoming gradient is dropped and their statistics made finite, so they add nothing
    alive = jnp.isfinite(lse)
    g = jnp.where(alive[..., None], g, jnp.zeros((), g.dtype))
    m = jnp.where(alive, lse, 0.0).astype(jnp.float32)
    di = jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32), axis=-1)
    split = _split_for(B, H, q, k, v)
    kv_heads = _kv_heads_for(split, H, Hkv)
    k_in, v_in = _repeat_heads(k, kv_heads), _repeat_heads(v, kv_heads)
    b_loc, h_loc = _local(B, H, split)
    costs = kernel_costs(b_loc, h_loc, L, S, Dp, causal=causal, itemsize=q.dtype.itemsize, with_bias=bias is not None)

    vmem_limit = _one_pass_vmem_limit(L, S, Dp, q.dtype.itemsize, bq, bk, bias is not None, q, k)

    def kernels(q, k, v, g, m, di, *rest):
        bias = rest[0] if rest else None
        q, k, v, g = (_pad_last(x, Dp) for x in (q, k, v, g))
        rows = m[:, :, None, :], di[:, :, None, :]  # (b, h, 1, L): the kernels read them as rows
        options = dict(causal=causal, scale=scale, mask_value=MASK_VALUE, block_q=bq, block_k=bk)

        def one_pass(q, k, v, bias, m, g, di):
            return attention_kernels.backward(q, k, v, bias, m, g, di, vmem_limit_bytes=vmem_limit, **options)

        def dkv(q, k, v, bias, m, g, di):
            return attention_kernels.backward_dkv(q, k, v, bias, m, g, di, **options)

        def dq(q, k, v, bias, m, g, di):
            return (attention_kernels.backward_dq(q, k, v, bias, m, g, di, **options),)

        with jax.enable_x64(False):
            args = (q, k, v, bias, rows[0], g, rows[1])
            if vmem_limit is not None:
                dq_, dk, dv = bind_pallas(one_pass, args, [costs["backward"]], interpret)
            else:
                dk, dv = bind_pallas(dkv, args, [costs["backward_dkv"]], interpret)
                (dq_,) = bind_pallas(dq, args, [costs["backward_dq"]], interpret)
        return dq_[..., :D], dk[..., :D], dv[..., :Dv]  # the padding's gradients are dropped

    operands = (q, k_in, v_in, g, m, di) + ((bias,) if bias is not None else ())
    ndims = [4, 4, 4, 4, 3, 3] + ([4] if bias is not None else [])
    dq, dk, dv = _per_shard(kernels, split, ndims, [4, 4, 4])(*operands)
    rep = kv_heads // Hkv
    if rep > 1:  # k, v were repeated for a head split: fold each repeat's gradient back
        dk = dk.reshape(B, Hkv, rep, S, -1).sum(2)
        dv = dv.reshape(B, Hkv, rep, S, -1).sum(2)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# VMEM per TensorCore by the device kind libtpu reports (jax's pallas tpu_info)
_VMEM_BY_KIND = {"TPU v4": 16 << 20, "TPU v5 lite": 128 << 20, "TPU v5": 64 << 20, "TPU v6 lite": 128 << 20}


def _device_kind(*arrays) -> str | None:
    """The kind of TPU the program is for: from the mesh JAX records in the arrays' types, else
    the default backend's first device when it is a TPU; None when neither says (a CPU program)."""
    for a in arrays:
        mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
        device = getattr(mesh, "abstract_device", None)
        if device is not None and device.platform == "tpu":
            return device.device_kind
    device = jax.devices()[0]
    return device.device_kind if device.platform == "tpu" else None


def backward_mode() -> str:
    """TORCHTPU_FLASH_BACKWARD: "auto" (the default: the one-pass backward where its accumulators
    fit the chip's VMEM), "one-pass" or "two-kernel"; read when a program is traced."""
    mode = os.environ.get("TORCHTPU_FLASH_BACKWARD", "auto").strip().lower()
    if mode not in ("auto", "one-pass", "two-kernel"):
        raise ValueError(f"TORCHTPU_FLASH_BACKWARD={mode!r}: use auto, one-pass or two-kernel")
    return mode


def _one_pass_vmem_limit(L, S, D, itemsize, bq, bk, with_bias, *arrays) -> int | None:
    """The scoped VMEM limit to run the one-pass backward kernel with, or None to run the dK/dV and
    dQ kernels instead: where the chip's VMEM (three quarters of it, the kernel's limit) holds the
    kernel's accumulators and blocks (`attention_kernels.backward_vmem_bytes`) with a quarter to
    spare. Where the program does not say which chip it is for (a single-device program compiled
    for a topology's device), the two kernels run, unless interpreting (tests on CPU count 64 MiB);
    a kind not in _VMEM_BY_KIND counts as 16 MiB."""
    mode = backward_mode()
    if mode == "two-kernel":
        return None
    kind = _device_kind(*arrays)
    if kind is None and not interpreting() and mode == "auto":
        return None
    vmem = _VMEM_BY_KIND.get(kind, 64 << 20 if kind is None else 16 << 20)
    limit = vmem * 3 // 4
    need = attention_kernels.backward_vmem_bytes(L, S, D, itemsize, bq, bk, with_bias)
    if mode == "one-pass" or need <= limit * 3 // 4:
        return limit
    return None


def _local(batch, heads, split):
    if split is None:
        return batch, heads
    sizes = dict(split.mesh.shape)

    def n(entry):
        if entry is None:
            return 1
        return math.prod(sizes[a] for a in ((entry,) if isinstance(entry, str) else entry))

    return batch // n(split.batch), heads // n(split.heads)
