"""torchtitan's DeepSeek-V3 on tpu: preparation and parallelize plan.

The model is torchtitan's `DeepSeekV3Model`: multi-head latent attention (MLA: queries through an
optional low-rank projection, keys and values from one compressed latent, a rotary part of each
head kept apart from the rest), `n_dense_layers` dense feed-forward blocks first, then
Mixture-of-Experts blocks with shared and routed experts, and the auxiliary-loss-free load
balancing (each MoE layer's `expert_bias`, moved before every optimizer step by the trainer:
`ModelFamily.moe_load_balancing`).

`prepare_deepseek_v3(model)` changes two things, the numbers staying the same:

- the rotary table: torchtitan keeps it complex64 and rotates with `view_as_complex`; on tpu it is
  (cos, sin) pairs stored as int32 bits (as Llama 3's, torchtpu.models.llama3.rope), and each
  `Attention` becomes `RealRopeMLA` (a subclass, same parameters and names) that rotates the
  rotary part of the queries and the shared rotary key in real arithmetic;
- the routed experts run as grouped matmuls on unpadded groups (torchtpu.models.moe).

The plan (torchtpu.models.moe.parallelize_moe_family) is torchtitan's: tensor parallelism with
its MLA plan (`mla_tp_plan`: the query projection `wq`, or `wq_b` after the low-rank `wq_a`, and the
latent's up-projection `wkv_b` colwise, so each rank holds whole heads; the latent's down-projection
`wkv_a` and the norms replicated; the attention kernel's q, k, v split on heads; `wo` rowwise), the
Llama 3 plan for the dense feed-forward and embeddings, torchtitan's plan for the MoE layers
(expert parallelism, tensor parallelism of the router and shared and routed experts), FSDP/HSDP per
block with mixed precision, activation checkpointing, and the layer scan over the run of identical
MoE blocks (the dense layers in front stay outside it). Refused with one line: attention through
flex_attention (the 16B, 236B and 671B flavors' block-causal document masks), unless the job sets
`[model] attn_type = "sdpa"`.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

from ..llama3.rope import apply_real_rotary_emb
from ..moe import parallelize_moe_family, use_ragged_experts

__all__ = ["RealRopeMLA", "mla_tp_plan", "parallelize_deepseek_v3", "prepare_deepseek_v3"]


def _model_module():
    from torchtitan.models.deepseek_v3.model import model

    return model


def _real_table(complex_table: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(complex_table).contiguous().view(torch.int32)


class RealRopeMLA(_model_module().Attention):
    """torchtitan's DeepSeek-V3 multi-head latent attention (SDPA, causal) with the rotary
    embedding in real arithmetic."""

    def forward(self, x, freqs_cis, attention_masks=None, positions=None):
        if self.attn_type != "sdpa" or attention_masks is not None or positions is not None:
            raise NotImplementedError(
                f"DeepSeek-V3 attention on tpu runs SDPA without masks or positions (got attn_type="
                f"{self.attn_type!r}); set [model] attn_type = 'sdpa'"
            )
        if freqs_cis.is_complex():
            freqs_cis = torch.view_as_real(freqs_cis)
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seqlen, -1, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv = self.wkv_a(x)
        kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        # one rotary key per position, shared by every head
        q_pe, k_pe = apply_real_rotary_emb(q_pe, k_pe.unsqueeze(2), freqs_cis)
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


def _model_class():
    return _model_module().DeepSeekV3Model


class RealRopeDeepSeekV3(_model_class()):
    """torchtitan's DeepSeekV3Model whose rotary table is real (int32 bits of (cos, sin)); its
    `init_weights` is torchtitan's, followed by the same conversion of the table it rebuilds."""

    def init_weights(self, buffer_device=None):
        super().init_weights(buffer_device)
        if self.freqs_cis.is_complex():
            self.freqs_cis = _real_table(self.freqs_cis)


def prepare_deepseek_v3(model: torch.nn.Module) -> torch.nn.Module:
    """torchtitan's DeepSeekV3Model ready for tpu (real rotary arithmetic, experts as grouped
    matmuls on unpadded groups), in place; returns it. The model may be on `meta`."""
    m = _model_module()
    if type(model) is not m.DeepSeekV3Model:
        raise TypeError(f"prepare_deepseek_v3 expects torchtitan's DeepSeekV3Model, got {type(model).__name__}")
    table = model.freqs_cis
    if table.device.type == "meta":
        real = torch.empty(*table.shape, 2, dtype=torch.int32, device="meta")
    else:
        real = _real_table(table)
    model.register_buffer("freqs_cis", real, persistent=False)
    model.__class__ = RealRopeDeepSeekV3
    for module in model.modules():
        if type(module) is m.Attention:
            module.__class__ = RealRopeMLA
    return use_ragged_experts(model)


def parallelize_deepseek_v3(model: torch.nn.Module, mesh, **kw) -> torch.nn.Module:
    """Shard a torchtitan DeepSeekV3Model over `mesh`; the arguments are parallelize_llama's. The
    layer scan runs the MoE blocks; the dense layers in front of them stay outside it (each under
    full activation checkpointing), and with fewer than 2 MoE blocks every block runs unrolled."""
    n_dense = model.model_args.n_dense_layers
    kw["scan_start"] = n_dense
    if len(model.layers) - n_dense < 2:
        kw["scan_layers"] = False
    return parallelize_moe_family(model, mesh, attention_plan=mla_tp_plan, **kw)


def mla_tp_plan(block: torch.nn.Module) -> dict:
    """torchtitan's tensor-parallel plan for one block's multi-head latent attention, but its input
    and `wo` (the Llama 3 block plan's): the query and key/value up-projections colwise (whole heads
    per rank), the kernel's q, k, v split on heads; `wq_a`, `wkv_a` and the norms stay replicated."""
    q = "attention.wq" if block.attention.q_lora_rank == 0 else "attention.wq_b"
    heads = (Shard(1),) * 3
    return {
        q: ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.inner_attention": PrepareModuleInput(input_layouts=heads, desired_input_layouts=heads),
    }
