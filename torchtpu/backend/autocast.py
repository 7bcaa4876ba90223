"""`torch.autocast("tpu")`: CUDA's cast policy, registered at the AutocastPrivateUse1 key.

PyTorch runs an op's autocast kernel before autograd and the backend when autocast is on for the
op's device. For tpu there are none, so the op lists and policies of ATen's autocast_mode.h for
CUDA are registered here as Python kernels: each casts its floating tpu arguments (never float64)
and calls the op again with the autocast key excluded, as ATen's WrapFunction does. Every other op
falls through. The casts are ordinary ops, so autograd, `torchtpu.compile` and
`torch.compile(backend="tpu")` see them like any other.

CUDA's policy rather than CPU autocast's: CPU keeps softmax, layer_norm, exp/log and sums in the
lower precision, which on TPU gives up accuracy for nothing (XLA fuses the float32 arithmetic).
"""

from __future__ import annotations

import torch

_KEY = "AutocastPrivateUse1"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

# ATen's autocast_mode.h (AT_FORALL_LOWER_PRECISION_FP): run in the autocast dtype
LOWER_PRECISION = (
    "_convolution.deprecated",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
)
# AT_FORALL_FP32: run in float32
FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)
# AT_FORALL_FP32_SET_OPT_DTYPE: a lower-precision input computes with dtype=float32 unless the
# caller chose a dtype
FP32_SET_OPT_DTYPE = (
    "prod",
    "prod.dim_int",
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
)
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: the overload with a dtype, called with float32
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
# AT_FORALL_PROMOTE: mixed float32/lower-precision arguments all become the widest
PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)


def _overload(name: str):
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _eligible(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "tpu" and x.is_floating_point() and x.dtype != torch.float64


def _cast(value, dtype):
    if _eligible(value):
        return value if value.dtype == dtype else value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _flat_tensors(values):
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from _flat_tensors(v)
        elif isinstance(v, torch.Tensor):
            yield v


def _lower_precision(op):
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("tpu")
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*_cast(args, dtype), **_cast(kwargs, dtype))

    return kernel


def _fp32(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*_cast(args, torch.float32), **_cast(kwargs, torch.float32))

    return kernel


def _fp32_set_opt_dtype(op):
    arguments = op._schema.arguments
    index = next(i for i, a in enumerate(arguments) if a.name == "dtype")
    positional = not arguments[index].kwarg_only

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if _eligible(args[0]):
                if positional and len(args) > index:
                    if args[index] is None:
                        args = (*args[:index], torch.float32, *args[index + 1 :])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _fp32_append_dtype(op, with_dtype):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if _eligible(args[0]):
                return with_dtype(*args, **kwargs, dtype=torch.float32)
            return op(*args, **kwargs)

    return kernel


def _promote(op):
    def kernel(*args, **kwargs):
        lower = torch.get_autocast_dtype("tpu")
        widest = lower
        for t in _flat_tensors((*args, *kwargs.values())):
            if _eligible(t) and t.dtype != lower:
                widest = torch.float32
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*_cast(args, widest), **_cast(kwargs, widest))

    return kernel


def _banned(*args, **kwargs):
    raise RuntimeError(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast: the "
        "lower-precision sigmoid before them can round probabilities to 0 or 1. Combine the two with "
        "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, which autocast "
        "computes in float32."
    )


def register() -> None:
    """Register the policy (once: the Library objects are kept on this function)."""
    if getattr(register, "libs", None):
        return
    everything = torch.library.Library("_", "IMPL")
    everything.fallback(torch.library.fallthrough_kernel, _KEY)
    lib = torch.library.Library("aten", "IMPL")
    for name in LOWER_PRECISION:
        lib.impl(name, _lower_precision(_overload(name)), _KEY)
    for name in FP32:
        lib.impl(name, _fp32(_overload(name)), _KEY)
    for name in FP32_SET_OPT_DTYPE:
        lib.impl(name, _fp32_set_opt_dtype(_overload(name)), _KEY)
    for name, with_dtype in FP32_APPEND_DTYPE.items():
        lib.impl(name, _fp32_append_dtype(_overload(name), _overload(with_dtype)), _KEY)
    for name in PROMOTE:
        lib.impl(name, _promote(_overload(name)), _KEY)
    lib.impl("binary_cross_entropy", _banned, _KEY)
    register.libs = (everything, lib)
