"""The training step, compiled as one XLA program: forward and backward over the gradient-accumulation
micro-batches, gradient clipping, the MoE expert-bias update, the optimizer update and zeroing the
gradients.

    parts = StepParts(cfg, model, optimizer, stacked, balanced_moe, moe_layers, loss_context)
    step_fn = compile_train_step(parts)     # torchtpu.compile(warmup="abstract") of train_step over parts
    loss, grad_norm, moe_counts = step_fn([(inputs, labels)] * grad_accum_steps)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .load_balance import update_expert_bias
from .loss import language_model_loss
from .moe_metrics import reset_counts, step_counts

__all__ = ["StepParts", "compile_train_step", "train_step"]


@dataclass(frozen=True)
class StepParts:
    """What the step reads: [tpu] loss_chunk_size and [training] max_norm from `cfg`, the model and its
    optimizer, the layer scan's stacked parameters, the MoE layers (`balanced_moe`: those whose expert
    bias the step moves; `moe_layers`: those whose load it counts) and the loss's context (build.loss_context)."""

    cfg: Any
    model: Any
    optimizer: Any
    stacked: list
    balanced_moe: list
    moe_layers: list
    loss_context: Callable


def train_step(parts: StepParts, microbatches):
    """Forward + backward over the micro-batches, clip, update, zero grads: (mean loss, gradient norm,
    MoE tokens per expert). One XLA program when compiled."""
    import torch

    from torchtpu.distributed.scan import stack_gradients

    n = len(microbatches)
    total = None
    reset_counts(parts.moe_layers)  # MoE load statistics: this step's tokens per expert
    for inputs, labels in microbatches:
        # With tensor parallelism the logits stay split over the vocabulary (torchtitan's
        # loss_parallel): the cross entropy reduces across the tp shards, never gathering them,
        # the whole logits' or each chunk's ([tpu] loss_chunk_size).
        with parts.loss_context():
            loss = language_model_loss(parts.model, inputs, labels, parts.cfg.tpu.loss_chunk_size)
        (loss / n if n > 1 else loss).backward()
        d = loss.detach()
        total = d if total is None else total + d
    stack_gradients(parts.stacked, parts.model)
    params = [p for g in parts.optimizer.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, parts.cfg.training.max_norm, foreach=True)
    counts = step_counts(parts.moe_layers)  # the MoE metrics' (a bias update zeroes the buffers)
    if parts.balanced_moe:  # torchtitan: an optimizer step pre-hook
        update_expert_bias(parts.balanced_moe)
    parts.optimizer.step()
    parts.optimizer.zero_grad(set_to_none=True)
    return (total / n if n > 1 else total), grad_norm, counts


def compile_train_step(parts: StepParts):
    """train_step over `parts` as one compiled program from its first call (`warmup="abstract"`: the
    optimizer's state exists before it and the step sets the gradients to None, so the state is found on
    shapes, with no op-by-op first step)."""
    import torchtpu

    def step(microbatches):
        return train_step(parts, microbatches)

    return torchtpu.compile(step, warmup="abstract")
