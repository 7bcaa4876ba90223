"""Int8 weight-only (w8a16) linear layers for vLLM on the tpu device.

vLLM reads a compressed-tensors checkpoint whose linear weights are int8, per output channel (or
per group of input columns), symmetric, with unquantized activations (`pack-quantized` format:
`weight_packed` int32 [out, in / 4], four int8 values offset by 128 in each, `weight_scale`
[out, groups]) as its `CompressedTensorsWNA16` scheme, which asks the platform for a
mixed-precision linear kernel (`choose_mp_linear_kernel`). `TpuW8A16LinearKernel` is that kernel
for vLLM's out-of-tree platforms (`register_linear_kernel`):

- after loading, once, the packed int32 words are unpacked into an int8 weight [out, in] on tpu;
- a forward with per-channel scales is one op, `torchtpu::w8a16_matmul`: `x @ int8_weight.T`
  with the weight converted to the activations' dtype inside the product, accumulated in float32,
  then the scales on the output columns. On TPU XLA compiles it as one fusion whose dot takes the
  int8 weight as its operand, so decode reads the weights from HBM as int8 (half of bfloat16's
  bytes), which is what weight-only quantization is for. Per-group scales dequantize the groups'
  weights before the product.

`check_quantization` refuses, in one line naming it, every other quantization: other methods,
other compressed-tensors schemes (activation quantization, other bit widths, asymmetric
weights) and quantized MoE experts. Under tensor parallelism the packed weights and their scales
are laid out as the plain weights are (sharding.py), and XLA partitions the product.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from vllm.model_executor.kernels.linear import register_linear_kernel
from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel, MPLinearLayerConfig
from vllm.model_executor.layers.quantization.utils import replace_parameter
from vllm.platforms import PlatformEnum
from vllm.scalar_type import scalar_types

from torchtpu import jax_op

QUANTIZATION = "compressed-tensors"
_FIX = (
    "torchtpu serves unquantized checkpoints (bfloat16/float16/float32) and compressed-tensors int8 weight-only "
    "ones (8-bit symmetric int weights per channel or group, pack-quantized, no activation quantization, dense "
    "layers); serve the unquantized model or use another vLLM platform"
)


def refusal(what: str) -> ValueError:
    return ValueError(f"{what} is not supported on tpu: {_FIX}")


def check_quantization(method: str, hf_quant_config: dict | None, is_moe: bool) -> None:
    """One-line ValueError unless the checkpoint is what `TpuW8A16LinearKernel` computes."""
    if method != QUANTIZATION:
        raise refusal(f"quantization={method!r}")
    config = hf_quant_config or {}
    fmt = config.get("format")
    if fmt != "pack-quantized":
        raise refusal(f"compressed-tensors format {fmt!r}")
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        scheme = (
            weights.get("num_bits"),
            weights.get("type"),
            weights.get("symmetric"),
            weights.get("strategy"),
            bool(weights.get("dynamic")),
        )
        if scheme[:3] != (8, "int", True) or scheme[3] not in ("channel", "group") or scheme[4]:
            raise refusal(f"compressed-tensors group {name!r} (weights {weights})")
        if group.get("input_activations") or group.get("output_activations"):
            raise refusal(f"compressed-tensors group {name!r} with quantized activations")
    if config.get("kv_cache_scheme"):
        raise refusal("a quantized KV cache (kv_cache_scheme)")
    if is_moe:
        raise refusal("a quantized Mixture-of-Experts model")


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """int32 [out, in / 4] words of four uint8 values (value + 128, the first in the low byte) ->
    int8 [out, in]."""
    # byte i of each word by floor division and remainder (exact for negative words too)
    places = torch.tensor([1, 1 << 8, 1 << 16, 1 << 24], dtype=torch.int32, device=packed.device)
    values = torch.remainder(torch.div(packed.unsqueeze(-1), places, rounding_mode="floor"), 256)
    return (values.flatten(-2) - 128).to(torch.int8)


def int8_matmul(x, w, scale):
    """x [..., in] (float) times the int8 weight w [out, in] transposed, in x's dtype, with the
    per-output-channel scales [out, 1] on the product's columns (JAX). The weight is converted to
    x's dtype inside the product: on TPU the dot reads the int8 weight (tests/serve/test_quantized.py
    compiles it for a TPU and checks)."""
    y = jnp.matmul(x, w.T.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale.reshape(-1).astype(jnp.float32)).astype(x.dtype)


w8a16_matmul = jax_op(
    "torchtpu::w8a16_matmul",
    int8_matmul,
    schema="(Tensor x, Tensor w, Tensor scale) -> Tensor",
    fake=lambda x, w, scale: x.new_empty((*x.shape[:-1], w.shape[0])),
    choose_platform=False,
)


class TpuW8A16LinearKernel(MPLinearKernel):
    """vLLM's mixed-precision linear kernel for int8 weights and float activations on tpu."""

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @classmethod
    def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
        if c.weight_type != scalar_types.uint8b128 or c.zero_points:
            return False, f"torchtpu's w8a16 kernel takes symmetric 8-bit weights, not {c.weight_type}"
        if c.group_size != -1 and c.partition_weight_shape[0] % c.group_size:
            return False, f"group size {c.group_size} does not divide the input size {c.partition_weight_shape[0]}"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        packed = getattr(layer, self.w_q_name)
        replace_parameter(layer, self.w_q_name, torch.nn.Parameter(unpack_int8(packed.data), requires_grad=False))

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w, scale = getattr(layer, self.w_q_name), getattr(layer, self.w_s_name)
        if scale.shape[-1] == 1:  # per output channel: scale the product's columns
            y = w8a16_matmul(x, w, scale)
        else:  # per group of input columns: scale the weights, then the product
            out, cols = w.shape
            groups = scale.shape[-1]
            deq = (w.reshape(out, groups, cols // groups).to(x.dtype) * scale.unsqueeze(-1).to(x.dtype)).reshape(
                out, cols
            )
            y = torch.matmul(x, deq.t())
        return y if bias is None else y + bias


register_linear_kernel(TpuW8A16LinearKernel, PlatformEnum.OOT, "mp")
