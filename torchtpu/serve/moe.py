"""vLLM's fused Mixture-of-Experts layer (`FusedMoE`) on the tpu device, as grouped matmuls.

vLLM's MoE models (Qwen3-MoE, Mixtral, ...) build their experts as `FusedMoE`, whose expert
computation is the layer's quantization method: for unquantized weights
`UnquantizedFusedMoEMethod`, a `CustomOp`. On an out-of-tree platform vLLM selects no expert kernel
for it (its backend is "OOT"), so a platform registers its own method in its place
(`CustomOp.register_oot`): here `TpuFusedMoEMethod`.

It is monolithic in vLLM's terms: it takes the router's logits and routes itself, because vLLM's
routers call its CUDA/CPU C++ top-k kernels, which do not run on tpu tensors. Routing is vLLM's:
the scores are the softmax (or sigmoid, per the layer's `scoring_func`) of the logits in float32,
each token takes its `top_k` highest, and with `renormalize` their weights are divided by their
sum. Then every (token, expert) pair becomes a row, the rows are sorted by expert (a counting sort
in 32-bit integers, `_expert_order`), and the experts
run on the rows each received as two grouped matmuls, w13 ([gate; up]), the SiLU-gated
activation, then w2: one op (`torchtpu::moe_experts`) whose matmuls are the op table's
`torch._grouped_mm` lowering (megablox's kernels on TPU, loops over row tiles elsewhere:
backend/ops/linalg.py), for every float dtype (PyTorch's own checks of `_grouped_mm` take
bfloat16 only). The rows go back in token order and each token's outputs are summed with its
routing weights in float32. Nothing is dropped, no expert computes a token it was not routed,
and every size is fixed by the step's padding bucket, so the step never waits on the host.

Weights are vLLM's own layout, w13 [experts, 2 x intermediate, hidden] and w2 [experts, hidden,
intermediate]. Under tensor parallelism (`shard_experts`) they lie split on the intermediate dim
as vLLM's FusedMoE splits them over its ranks, w13's rows stored shard-major ([gate_i; up_i] on
device i, as sharding.py stores fused layers), and the experts run per device under
`jax.shard_map` (`torchtpu::moe_experts_tp`): each device computes its part of every expert's
intermediate dim, and a `psum` adds the partial outputs where vLLM's layer all-reduces. The
grouped matmul's kernel is a custom call XLA cannot partition, so the split is explicit.

What it refuses at start-up, in one line naming it: grouped top-k routing (DeepSeek), a score
correction bias, a custom routing function, a routed scaling factor, activations other than
SiLU-gated (gpt-oss's clamped SwiGLU), expert biases, router weights on the input, and an
expert map. Expert parallelism (`enable_expert_parallel`) and EPLB are refused by the platform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax.sharding import PartitionSpec as P
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from torchtpu import jax_op
from torchtpu.backend.ops import linalg
from torchtpu.distributed.params import apply_layout, set_layout
from torchtpu.hardware import TP_AXIS

from . import sharding


def _refuse(what: str) -> None:
    raise NotImplementedError(
        f"torchtpu serves vLLM's FusedMoE with softmax/sigmoid top-k routing and SiLU-gated experts; this model's "
        f"MoE layer uses {what}, which has no tpu implementation here"
    )


def check_supported(layer) -> None:
    """One line naming what a `FusedMoE` layer uses that `TpuFusedMoEMethod` does not compute."""
    if layer.use_grouped_topk:
        _refuse("grouped top-k routing (num_expert_group / topk_group)")
    if layer.custom_routing_function is not None:
        _refuse("a custom routing function")
    if layer.e_score_correction_bias is not None:
        _refuse("a score correction bias")
    if layer.scoring_func not in ("softmax", "sigmoid"):
        _refuse(f"scoring_func={layer.scoring_func!r}")
    if layer.routed_scaling_factor != 1.0:
        _refuse(f"routed_scaling_factor={layer.routed_scaling_factor}")
    if layer.activation != MoEActivation.SILU:
        _refuse(f"the activation {layer.activation.value!r}")
    if layer.moe_config.has_bias:
        _refuse("expert biases")
    if layer.apply_router_weight_on_input:
        _refuse("router weights applied on the input")
    if layer.expert_map is not None:
        _refuse("expert parallelism (an expert map)")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax"):
    """vLLM's top-k routing: (weights float32 [tokens, top_k], expert ids int64 [tokens, top_k])."""
    logits = router_logits.float()
    scores = logits.softmax(-1) if scoring_func == "softmax" else logits.sigmoid()
    weights, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def _experts(rows, w13, w2, ends):
    """The SiLU-gated experts on rows sorted by expert (JAX): w13 [experts, 2 x inter, hidden] as
    [gate; up], w2 [experts, hidden, inter]; `ends` each expert's exclusive end row."""
    h = linalg.grouped_mm(rows, jnp.swapaxes(w13, 1, 2), ends)
    gate, up = jnp.split(h, 2, axis=-1)
    return linalg.grouped_mm(jax.nn.silu(gate) * up, jnp.swapaxes(w2, 1, 2), ends)


_TENSOR_PARALLEL_MESH: list = [None]  # the jax Mesh the experts are split over (shard_experts)


def _experts_tensor_parallel(rows, w13, w2, ends):
    """`_experts` per device of the tensor-parallel mesh, each on its part of the intermediate dim
    (w13's rows stored [gate_i; up_i]), the partial outputs added over the devices as vLLM's
    FusedMoE all-reduces."""

    def shard(rows, w13, w2, ends):
        return jax.lax.psum(_experts(rows, w13, w2, ends), TP_AXIS)

    specs = (P(), P(None, TP_AXIS, None), P(None, None, TP_AXIS), P())
    mesh = _TENSOR_PARALLEL_MESH[0]
    return jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(rows, w13, w2, ends)


_SCHEMA = "(Tensor rows, Tensor w13, Tensor w2, Tensor ends) -> Tensor"


def _rows_like(rows, w13, w2, ends):
    return torch.empty_like(rows)


experts = jax_op("torchtpu::moe_experts", _experts, schema=_SCHEMA, fake=_rows_like, choose_platform=False)
experts_tensor_parallel = jax_op(
    "torchtpu::moe_experts_tp", _experts_tensor_parallel, schema=_SCHEMA, fake=_rows_like, choose_platform=False
)


def grouped_experts(x: torch.Tensor, w13, w2, weights, ids, tensor_parallel: bool = False) -> torch.Tensor:
    """Each token's routed experts' outputs summed with its routing weights (module docstring):
    x [tokens, hidden]; weights, ids [tokens, top_k]."""
    tokens, top_k = ids.shape
    pos, order, ends = _expert_order(ids.reshape(-1), w13.shape[0])
    run = experts_tensor_parallel if tensor_parallel else experts
    y = run(x[order // top_k], w13, w2, ends)
    unsorted = y[pos].reshape(tokens, top_k, -1)
    return (unsorted.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def _expert_order(flat: torch.Tensor, n_experts: int):
    """The (token, k) rows `flat` (each row's expert) sorted by expert, stably: (pos, order, ends),
    where row i goes to place pos[i], place j holds row order[j], and expert e's rows end at
    ends[e]. A counting sort in 32-bit integers, with compares, sums and prefix sums over a
    [rows, experts] table: XLA's TPU cost model gives no time for a sort or a scatter-add whose
    indices are 64-bit (PyTorch's argsort and scatter indices are), so with them the serving dry run
    of an MoE model had no step-time estimate."""
    rows = flat.numel()
    flat = flat.to(torch.int32)
    hit = flat[:, None] == torch.arange(n_experts, dtype=torch.int32, device=flat.device)
    counts = hit.sum(0, dtype=torch.int32)
    ends = counts.cumsum(0, dtype=torch.int32)
    seen = hit.to(torch.int32).cumsum(0, dtype=torch.int32)  # rows of each expert up to row i, row i included
    pos = ((ends - counts)[None, :] + seen - 1).mul(hit).sum(1, dtype=torch.int32)
    order = torch.empty(rows, dtype=torch.int32, device=flat.device)
    order[pos] = torch.arange(rows, dtype=torch.int32, device=flat.device)
    return pos, order, ends


def shard_experts(model: torch.nn.Module, mesh) -> None:
    """Lay the experts of every tpu FusedMoE layer over the mesh's axis as vLLM's FusedMoE splits
    them over its ranks: w13 on its intermediate rows, stored shard-major ([gate_i; up_i] on
    device i: `reorder_loaded_experts` puts the loaded weights in that order), w2 on its
    intermediate columns. An intermediate size the mesh does not divide stays whole."""
    n = mesh.size()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, TpuFusedMoEMethod) or module.w2_weight.shape[2] % n:
            continue
        set_layout(module, "w13_weight", mesh, [[], [TP_AXIS], []])
        set_layout(module, "w2_weight", mesh, [[], [], [TP_AXIS]])
        apply_layout(module, "w13_weight")
        apply_layout(module, "w2_weight")
        method.tensor_parallel = n
        _TENSOR_PARALLEL_MESH[0] = mesh.jax_mesh


def reorder_loaded_experts(model: torch.nn.Module) -> None:
    """w13's rows, loaded in the model's order [gate; up], in the shard-major order of `shard_experts`."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        n = getattr(method, "tensor_parallel", 1)
        if not isinstance(method, TpuFusedMoEMethod) or n == 1:
            continue
        inter = module.w2_weight.shape[2]
        rows = sharding.shard_major_rows([inter, inter], n)
        w13 = module.w13_weight
        with torch.no_grad():
            w13.copy_(w13.index_select(1, rows.to(w13.device)))
        # the loader's per-expert writes into the unallocated weights leave them whole: lay them
        # out as recorded
        apply_layout(module, "w13_weight")
        apply_layout(module, "w2_weight")


@UnquantizedFusedMoEMethod.register_oot
class TpuFusedMoEMethod(UnquantizedFusedMoEMethod):
    """`UnquantizedFusedMoEMethod` on tpu: routing and grouped-matmul experts (module docstring)."""

    @property
    def is_monolithic(self) -> bool:
        return True

    def process_weights_after_loading(self, layer) -> None:
        check_supported(layer)
        super().process_weights_after_loading(layer)

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        weights, ids = route(router_logits, layer.top_k, layer.renormalize, layer.scoring_func)
        tensor_parallel = getattr(self, "tensor_parallel", 1) > 1
        return grouped_experts(x, layer.w13_weight, layer.w2_weight, weights, ids, tensor_parallel)
