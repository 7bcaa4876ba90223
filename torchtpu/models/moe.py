"""torchtitan's Mixture-of-Experts layer (`torchtitan.models.moe`) on the tpu device.

The router (scores, token-choice top-k, tokens per expert by `torch.histc`), the token reordering
and the combine run as torchtitan writes them. The experts run through torchtitan's own
`_run_experts_grouped_mm`: three `torch._grouped_mm` calls over the tokens each expert received,
which the op table lowers to `jax.lax.ragged_dot` (backend/ops/linalg.py). Nothing is dropped and
no expert computes a token it was not routed.

One thing differs from torchtitan's path on CUDA, without changing a number: there, before the
grouped matmul, `indices_padding_wrapper` pads every expert's group of tokens to a multiple of 8
rows (what CUDA's grouped GEMM needs for alignment) with a triton kernel that only runs on CUDA.
`ragged_dot` takes groups of any size, so `use_ragged_experts(model)` makes each `GroupedExperts`
call the grouped matmul on the unpadded groups, as torchtitan does itself under expert parallelism.
The padding rows are zeros whose outputs are dropped, so the results are the same.

Expert parallelism (`apply_expert_parallel(model, mesh)`, for any family built on torchtitan's
`MoE`): each MoE layer's routed experts are split over the mesh dim "ep" on their expert dim (and
sharded over the rest of the FSDP dim, "efsdp", as FSDP would), and the layer routes as torchtitan
writes it, then sends each (token, expert) row to the chip holding its expert and back with
all-to-alls (torchtpu.distributed.expert_parallel), where torchtitan's same grouped matmul computes
it. The combine (the scores' weighting, the sum over the top-k, the shared experts) is torchtitan's
arithmetic on the same rows, so a step under expert parallelism computes what it computes without.

Without expert parallelism, on more than one data-parallel chip (`use_local_dispatch(model, mesh)`,
applied by every MoE family's parallelize), the layer runs the same way with no all-to-all: each
chip sorts its own rows by expert and runs the whole experts on them. torchtitan's reordering sorts
and gathers over the whole batch, which XLA partitions into all-gathers of every chip's routed rows
(2 GiB per layer for Qwen3 30B-A3B on 16 chips, forward and backward); the rows each expert
computes, and so the numbers, are the same.
"""

from __future__ import annotations

import math

import torch
from torchtitan.models.moe.moe import GroupedExperts, MoE, _run_experts_grouped_mm

from ..distributed.batch import data_parallel_axes
from ..distributed.expert_parallel import expert_axes, expert_parallel_ffn
from ..distributed.mesh import DeviceMesh
from ..distributed.params import apply_layout, set_layout

__all__ = [
    "RaggedGroupedExperts",
    "use_ragged_experts",
    "apply_expert_parallel",
    "ExpertParallelMoE",
    "parallelize_without_tp",
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
    return _run_experts_grouped_mm(*weights, x, tokens_per_expert)


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
        # one row per (token, choice), in token order: row t*k + j is token t for its j-th expert
        rows = x.unsqueeze(1).expand(-1, k, width).reshape(-1, width)
        if self.score_before_experts:
            rows = (rows.to(torch.float32) * top_scores.reshape(-1, 1)).to(x.dtype)
        experts = self.experts
        routed = expert_parallel_ffn(
            rows,
            chosen.reshape(-1),
            [experts.w1, experts.w2, experts.w3],
            _grouped_experts,
            mesh,
            num_experts=experts.num_experts,
            dim=dim,
        ).reshape(-1, k, width)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.score_before_experts:
            mixed = routed.sum(dim=1)
        else:
            mixed = torch.bmm(top_scores.reshape(-1, 1, k), routed.float()).to(x.dtype).squeeze(1)
        if shared is not None:
            mixed = shared + mixed
        return mixed.reshape(bs, slen, width)


def apply_expert_parallel(model: torch.nn.Module, mesh: DeviceMesh, dim: str = "ep") -> torch.nn.Module:
    """Expert parallelism for every torchtitan `MoE` layer in `model` (in place; returns `model`):
    the routed experts' weights (E, ...) are split on the expert dim over the mesh dim `dim` and,
    within each expert-parallel rank, sharded over the rest of the job's FSDP dim ("efsdp": on the
    expert dim too when it divides, else on another dim that divides), and each layer dispatches and
    combines its tokens with all-to-alls. Call it before `fully_shard` (which then leaves the experts'
    layout alone and casts them for mixed precision as the rest of the block) on the job's mesh
    split by `distributed.mesh.split_dim` (the trainer does this for
    `[parallelism] expert_parallel_degree`). A mesh without `dim`, or with one rank on it, leaves
    the model unchanged."""
    ep_axes = expert_axes(mesh, dim)
    if not ep_axes:
        return use_local_dispatch(model, mesh)
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


def use_local_dispatch(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Without expert parallelism, on a mesh of more than one data-parallel chip: every torchtitan
    `MoE` layer of `model` routes as torchtitan writes it, and each chip then sorts its own (token,
    expert) rows by expert, runs torchtitan's grouped matmul on them and puts them back
    (expert_parallel_ffn with dim None), instead of torchtitan's reordering over the whole batch,
    which XLA partitions into all-gathers of every chip's rows. In place; returns `model`."""
    root = mesh.root()
    if math.prod(root.jax_mesh.shape[a] for a in data_parallel_axes(root)) <= 1:
        return model
    for module in model.modules():
        if type(module) is MoE:
            module.__dict__["_torchtpu_ep"] = (root, None)
            module.__class__ = ExpertParallelMoE
    return model


def parallelize_without_tp(model: torch.nn.Module, mesh, family: str, **kw) -> torch.nn.Module:
    """parallelize_llama's FSDP/HSDP and activation checkpointing for a MoE family with no tensor-
    parallel plan: a tensor-parallel mesh is refused in one line naming `family`, and the blocks run
    unrolled (they hold buffers, expert_bias and tokens_per_expert, that the layer scan does not carry)."""
    from .llama3.parallelize import parallelize_llama

    if "tp" in mesh.mesh_dim_names and mesh.size("tp") > 1:
        raise ValueError(
            f"tensor parallel degree {mesh.size('tp')}: {family} trains with FSDP/HSDP only on tpu; "
            "set parallelism.tensor_parallel_degree = 1"
        )
    kw["scan_layers"] = False
    if not expert_axes(mesh):
        use_local_dispatch(model, mesh)
    return parallelize_llama(model, mesh, **kw)
