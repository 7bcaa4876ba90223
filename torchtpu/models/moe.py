"""torchtitan's Mixture-of-Experts layer (`torchtitan.models.moe`) on the tpu device.

The router (scores, token-choice top-k, tokens per expert by `torch.histc`), the token reordering
and the combine run as torchtitan writes them. The experts run through torchtitan's own
`_run_experts_grouped_mm`: three `torch._grouped_mm` calls over the tokens each expert received,
which the op table lowers to megablox's grouped-matmul kernels on TPU and to loops over row tiles
elsewhere (backend/ops/linalg.py). Nothing is dropped and no expert computes a token it was not
routed.

One thing differs from torchtitan's path on CUDA, without changing a number: there, before the
grouped matmul, `indices_padding_wrapper` pads every expert's group of tokens to a multiple of 8
rows (what CUDA's grouped GEMM needs for alignment) with a triton kernel that only runs on CUDA.
The op table's grouped matmul takes groups of any size, so `use_ragged_experts(model)` makes each `GroupedExperts`
call the grouped matmul on the unpadded groups, as torchtitan does itself under expert parallelism.
The padding rows are zeros whose outputs are dropped, so the results are the same. The experts
always run as that grouped matmul: parallelizing a model whose MoE layers set use_grouped_mm=False
(torchtitan's for-loop experts in the weights' dtype, which read each expert's token count on the
host) raises a one-line error.

Expert parallelism (`apply_expert_parallel(model, mesh)`, for any family built on torchtitan's
`MoE`): each MoE layer's routed experts are split over the mesh dim "ep" on their expert dim (and
sharded over the rest of the FSDP dim, "efsdp", as FSDP would), and the layer routes as torchtitan
writes it, then sends each (token, expert) row to the chip holding its expert and back with
all-to-alls (torchtpu.distributed.expert_parallel), where torchtitan's same grouped matmul computes
it. The combine (the scores' weighting and the sum over the top-k in float32, rounded once, as
torchtitan's batched matmul; the shared experts added) is torchtitan's arithmetic on the same
rows, so a step under expert parallelism computes what it computes without. Under this dispatch the
experts' w1 and w3 run as one grouped matmul over their concatenation (`_grouped_experts`: the same
products, one kernel instead of two, forward and backward), and w2's runs with the combine, whose
backward takes the scores' gradients without the experts' outputs (`_experts_hidden` is the dispatch's
`front`).
With tensor parallelism the mesh dim "ep" spans the "tp" axis too (torchtitan's
expert_tensor_parallel_degree 1, distributed.mesh.expert_parallel_mesh), and each chip of a
tensor-parallel group dispatches its own part of the rows.

Tensor parallelism (`apply_moe_tp(model, mesh)`, torchtitan's plan for the MoE layers): the layer's
input gathered from its sequence split and its sum split again, the router's gate replicated, the
shared experts colwise / rowwise, and the routed experts split on their hidden dim without expert
parallelism, whole with it. `moe_block_plan` fits the Llama 3 block plan to a family's MoE blocks
(and, for DeepSeek-V3, to its attention), and `parallelize_moe_family` puts the pieces together
with FSDP and activation checkpointing.

Without expert parallelism or tensor parallelism, on more than one data-parallel chip
(`use_local_dispatch(model, mesh)`, applied by `apply_expert_parallel`), the layer runs the same way with no all-to-all: each
chip sorts its own rows by expert and runs the whole experts on them. torchtitan's reordering sorts
and gathers over the whole batch, which XLA partitions into all-gathers of every chip's routed rows
(2 GiB per layer for Qwen3 30B-A3B on 16 chips, forward and backward); the rows each expert
computes, and so the numbers, are the same.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
)
from torchtitan.models.moe.moe import GroupedExperts, MoE, _run_experts_grouped_mm

from ..distributed import parallelize_module
from ..distributed.batch import data_parallel_axes
from ..distributed.expert_parallel import expert_axes, expert_parallel_ffn
from ..distributed.mesh import DeviceMesh
from ..distributed.parallel import split_parameter
from ..distributed.params import apply_layout, set_layout
from ..hardware import TP_AXIS

__all__ = [
    "RaggedGroupedExperts",
    "use_ragged_experts",
    "apply_expert_parallel",
    "ExpertParallelMoE",
    "apply_moe_tp",
    "moe_block_plan",
    "parallelize_moe_family",
    "use_local_dispatch",
]


class RaggedGroupedExperts(GroupedExperts):
    """torchtitan's GroupedExperts whose grouped matmul runs on the unpadded groups of tokens (a
    subclass: same parameters, names and state_dict)."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if not self.use_grouped_mm:
            return super().forward(x, num_tokens_per_expert)
        return _run_experts_grouped_mm(self.w1, self.w2, self.w3, x, num_tokens_per_expert)


def use_ragged_experts(model: torch.nn.Module) -> torch.nn.Module:
    """Make every torchtitan `GroupedExperts` in `model` run its grouped matmul on unpadded groups
    of tokens, in place; returns `model`. A model without experts is returned unchanged."""
    for module in model.modules():
        if type(module) is GroupedExperts:
            module.__class__ = RaggedGroupedExperts
    return model


def _grouped_experts(weights, x, tokens_per_expert):
    """torchtitan's `_run_experts_grouped_mm` with w1 and w3 as one grouped matmul: `weights` is
    (w13, w2), w13 = cat(w1, w3) on the hidden dim (`_fused_weights`). Each hidden unit's product
    is the same dot over the same inputs as in torchtitan's two calls, then silu(h1) * h3 and w2 as
    torchtitan computes them. In backward this is one grouped matmul for the rows' gradient
    (dh1 w1 + dh3 w3 summed inside the kernel instead of a sum of two (rows, dim) products) and one
    for w1's and w3's gradients, and the rows are read once, not twice."""
    h = _experts_hidden(weights, x, tokens_per_expert)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    return torch._grouped_mm(h, weights[-1].to(h.dtype).transpose(-2, -1), offs=offsets).type_as(x)


def _experts_hidden(weights, x, tokens_per_expert):
    """`_grouped_experts` up to w2: silu(x w1^T) * (x w3^T) in bfloat16 (the dispatch's `front`)."""
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    h13 = torch._grouped_mm(x.bfloat16(), weights[0].bfloat16().transpose(-2, -1), offs=offsets)
    h1, h3 = h13.chunk(2, dim=-1)
    return F.silu(h1) * h3


def _fused_weights(experts: GroupedExperts) -> list[torch.Tensor]:
    """(cat(w1, w3) on the hidden dim, w2): `_grouped_experts`'s weights, concatenated before the
    dispatch gathers them. Where w1 and w3 are split on another dim than the hidden one (the expert
    dim, as FSDP and expert parallelism split them when it divides), each chip concatenates its own
    shards; split on the hidden dim, XLA moves rows to concatenate. Autograd splits the gradient back
    into w1's and w3's."""
    return [torch.cat([experts.w1, experts.w3], dim=1), experts.w2]


class ExpertParallelMoE(MoE):
    """torchtitan's MoE whose routed experts are split over an expert-parallel mesh dim, or whose
    data-parallel chips each dispatch their own rows (dim None; same parameters, buffers, names and
    state_dict); made by `apply_expert_parallel` and `use_local_dispatch`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh, dim = self.__dict__["_torchtpu_ep"]
        bs, slen, width = x.shape
        x = x.view(-1, width)
        top_scores, chosen, counts = self.router(x, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        k = self.router.top_k
        experts = self.experts
        ffn = functools.partial(
            expert_parallel_ffn,
            weights=_fused_weights(experts),
            run_experts=_grouped_experts,
            front=_experts_hidden,
            mesh=mesh,
            num_experts=experts.num_experts,
            dim=dim,
        )
        if self.score_before_experts:
            # one row per (token, choice), in token order (row t*k + j is token t for its j-th
            # expert), scaled by its score before the experts
            rows = x.unsqueeze(1).expand(-1, k, width).reshape(-1, width)
            rows = (rows.to(torch.float32) * top_scores.reshape(-1, 1)).to(x.dtype)
            mixed = ffn(rows, chosen.reshape(-1)).reshape(-1, k, width).sum(dim=1)
        else:  # each token's k outputs weighted by its scores and summed in float32 (torchtitan's bmm)
            mixed = ffn(x, chosen.reshape(-1), top_k=k, scores=top_scores.reshape(-1, k))
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if shared is not None:
            mixed = shared + mixed
        return mixed.reshape(bs, slen, width)


def _check_grouped_experts(model: torch.nn.Module) -> None:
    """A one-line ValueError if an MoE layer of `model` sets use_grouped_mm=False: torchtitan's
    for-loop experts (that setting: each expert's rows in the weights' dtype, float32 for float32
    weights) split the rows by token counts read on the host, which a compiled step does not have,
    and `ExpertParallelMoE` runs torchtitan's grouped matmul (bfloat16 products) whatever the setting."""
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts) and not module.use_grouped_mm:
            raise ValueError(
                f"torchtpu MoE: {name or 'the model'} sets use_grouped_mm=False (torchtitan's for-loop experts), "
                "which needs each expert's token count on the host inside the compiled step; torchtpu runs the "
                "experts as torchtitan's grouped matmul (bfloat16 products): set moe_args.use_grouped_mm=True"
            )


def apply_expert_parallel(model: torch.nn.Module, mesh: DeviceMesh, dim: str = "ep") -> torch.nn.Module:
    """Expert parallelism for every torchtitan `MoE` layer in `model` (in place; returns `model`):
    the routed experts' weights (E, ...) are split on the expert dim over the mesh dim `dim` and,
    within each expert-parallel rank, sharded over the rest of the job's FSDP dim ("efsdp": on the
    expert dim too when it divides, else on another dim that divides), and each layer dispatches and
    combines its tokens with all-to-alls. Call it before `fully_shard` (which then leaves the experts'
    layout alone and casts them for mixed precision as the rest of the block) on the job's mesh
    split by `distributed.mesh.split_dim` (the trainer does this for
    `[parallelism] expert_parallel_degree`). On a mesh without `dim`, or with one rank on it, each
    data-parallel chip dispatches its own rows (`use_local_dispatch`), except under tensor parallelism.
    A layer whose experts set use_grouped_mm=False is refused (`_check_grouped_experts`)."""
    _check_grouped_experts(model)
    ep_axes = expert_axes(mesh, dim)
    if not ep_axes:
        # without expert parallelism each data-parallel chip dispatches its own rows, unless tensor
        # parallelism splits the experts on their hidden dim (apply_moe_tp: torchtitan's layer)
        tp = TP_AXIS in mesh.mesh_dim_names and mesh.size(TP_AXIS) > 1
        return model if tp else use_local_dispatch(model, mesh)
    root = mesh.root()
    n_ep = math.prod(root.jax_mesh.shape[a] for a in ep_axes)
    shard_dim = "dp_shard" if "dp_shard" in root.mesh_dim_names else None
    efsdp = [a for a in (root.dims[root.mesh_dim_names.index(shard_dim)] if shard_dim else ()) if a not in ep_axes]
    n_efsdp = math.prod(root.jax_mesh.shape[a] for a in efsdp)
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        if type(module) not in (MoE, ExpertParallelMoE):
            raise TypeError(
                f"apply_expert_parallel: {type(module).__name__} is a subclass of torchtitan's MoE whose forward "
                "torchtpu does not know; only torchtitan's MoE layer itself is supported"
            )
        experts = module.experts
        n = experts.num_experts
        if n % n_ep:
            raise ValueError(f"apply_expert_parallel: {n} experts per layer do not split over {n_ep} ranks of {dim!r}")
        for name in ("w1", "w2", "w3"):
            shape = tuple(getattr(experts, name).shape)
            entries: list[list[str]] = [list(ep_axes)] + [[] for _ in shape[1:]]
            if n_efsdp > 1:
                fits = [d for d in range(len(shape)) if (shape[d] // (n_ep if d == 0 else 1)) % n_efsdp == 0]
                if fits:
                    entries[0 if 0 in fits else max(fits, key=lambda d: shape[d])].extend(efsdp)
            set_layout(experts, name, root, entries)
            apply_layout(experts, name)
        module.__dict__["_torchtpu_ep"] = (root, dim)
        module.__class__ = ExpertParallelMoE
    return model


def apply_moe_tp(model: torch.nn.Module, mesh: DeviceMesh, sequence_parallel: bool = True) -> torch.nn.Module:
    """torchtitan's tensor-parallel plan for every torchtitan `MoE` layer in `model` (in place; returns
    `model`; a mesh without a "tp" dim of more than one rank leaves it unchanged): the layer gathers
    its sequence-split input and leaves its sum sequence-split again (all-gather in, reduce-scatter
    out); the router's gate is replicated (its computation repeats on each tensor-parallel rank); the
    shared experts are split colwise (w1, w3) and rowwise (w2); the routed experts, without expert
    parallelism, are split on their hidden dim (w1, w3 on dim 1, w2 on dim 2: torchtitan's
    `TensorParallel`), and with it (`apply_expert_parallel` first) are left whole, expert parallelism
    taking the tensor-parallel ranks (torchtitan's expert_tensor_parallel_degree 1: each rank
    dispatches its part of the tokens). Call it before `fully_shard`."""
    if TP_AXIS not in mesh.mesh_dim_names or mesh.size(TP_AXIS) == 1:
        return model
    tp = mesh[TP_AXIS]
    act = Shard(1) if sequence_parallel else Replicate()
    layer_io = PrepareModuleInputOutput(
        input_layouts=(act,),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Partial(),),
        desired_output_layouts=(act,),
    )
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        parallelize_module(module, tp, layer_io)
        if module.shared_experts is not None:
            shared = {"w1": ColwiseParallel(), "w2": RowwiseParallel(output_layouts=Partial()), "w3": ColwiseParallel()}
            parallelize_module(module.shared_experts, tp, shared)
        if not isinstance(module, ExpertParallelMoE):
            for name, dim in (("w1", 1), ("w2", 2), ("w3", 1)):
                split_parameter(module.experts, name, tp, dim)
    return model


def moe_block_plan(attention_plan=None):
    """parallelize_llama's `block_plan` for a Mixture-of-Experts family: a MoE block keeps the Llama 3
    block plan but its feed-forward entries (its MoE layer is `apply_moe_tp`'s); `attention_plan(block)`,
    if given, replaces the plan's q/k/v projections (the output projection's entry stays)."""

    def plan(layer, block):
        qkv = ("attention.wq", "attention.wk", "attention.wv")
        out = {
            k: v
            for k, v in block.items()
            if not (getattr(layer, "moe_enabled", False) and k.startswith("feed_forward"))
            and not (attention_plan is not None and k in qkv)
        }
        if attention_plan is not None:
            out.update(attention_plan(layer))
        return out

    return plan


def parallelize_moe_family(model: torch.nn.Module, mesh, attention_plan=None, **kw) -> torch.nn.Module:
    """parallelize_llama for a torchtitan Mixture-of-Experts family (Qwen3 MoE, DeepSeek-V3, Llama 4): expert
    parallelism when the mesh has an "ep" dim (`apply_expert_parallel`), torchtitan's tensor-parallel
    plan for the MoE layers (`apply_moe_tp`) and the Llama 3 one for the rest (`moe_block_plan`), FSDP/
    HSDP, activation checkpointing and the layer scan (which carries the blocks' buffers, expert_bias
    and tokens_per_expert); a family whose blocks differ sets `scan_layers=False` itself."""
    from .llama3.parallelize import parallelize_llama

    apply_expert_parallel(model, mesh)
    apply_moe_tp(model, mesh, kw.get("sequence_parallel", True))
    return parallelize_llama(model, mesh, block_plan=moe_block_plan(attention_plan), **kw)


def use_local_dispatch(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Without expert parallelism, on a mesh of more than one data-parallel chip: every torchtitan
    `MoE` layer of `model` routes as torchtitan writes it, and each chip then sorts its own (token,
    expert) rows by expert, runs torchtitan's grouped matmul on them and puts them back
    (expert_parallel_ffn with dim None), instead of torchtitan's reordering over the whole batch,
    which XLA partitions into all-gathers of every chip's rows. In place; returns `model`."""
    _check_grouped_experts(model)
    root = mesh.root()
    if math.prod(root.jax_mesh.shape[a] for a in data_parallel_axes(root)) <= 1:
        return model
    for module in model.modules():
        if type(module) is MoE:
            module.__dict__["_torchtpu_ep"] = (root, None)
            module.__class__ = ExpertParallelMoE
    return model
