"""The trainer's loss: mean token cross entropy of a language model, plain or chunked.

    loss = cross_entropy_loss(model(inputs), labels)             # logits [b, s, vocab] in, as torchtitan
    loss = chunked_cross_entropy_loss(model, inputs, labels, 2048)  # the same value, logits never whole

Why chunked: the plain loss materializes the logits of every token in float32 ([tokens, vocab]:
for Llama 3 8B at seq 8192, 128,256 x 8,192 x 4 bytes = 4.2 GB per sequence), and its backward
keeps them (or the softmax) alive until the gradient reaches the output projection. The chunked
loss runs the model up to its final norm, then, for each chunk of `chunk_size` sequence
positions, the output projection and the cross entropy under recomputation: the forward keeps only
each chunk's summed loss, and the backward recomputes one chunk's logits at a time. The value is
the same mean over the non-ignored tokens (F.cross_entropy's ignore_index = -100), summed in a
different order.

Chunks split the sequence dim, not the batch dim, so each chunk stays spread over the
data-parallel ranks as the batch is. The output projection is the model's own module (its
tensor-parallel and FSDP hooks run as usual); only its matmul is moved out of its forward, with
the input and the weight it reads there (mixed precision's bf16 copy), so the recomputation in
backward uses that same weight.

With tensor parallelism the projection's weight is split over the vocabulary, so each chunk's
logits are vocab-sharded, and under `loss_parallel` each chunk's cross entropy reduces across the
tp shards without gathering them, as the plain loss does. The recomputation in backward runs
under that same `loss_parallel` (activation_checkpoint re-enters the forward's torch function
modes), even when backward is called after its `with` block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cross_entropy_loss", "chunked_cross_entropy_loss", "language_model_loss", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # F.cross_entropy's default, torchtitan's too


def cross_entropy_loss(logits, labels):
    """torchtitan's loss: mean token cross entropy, computed in float32."""
    # PyTorch wants int64 class indices; the trainer's token ids are int32 on the device
    # (docs/DESIGN_NOTES.md), and the widening is folded away by the compiler.
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1).long())


class _ChunkCrossEntropy(torch.nn.Module):
    """Summed float32 cross entropy of one chunk: logits = h @ w.T (+ b), never kept for backward
    once wrapped by checkpoint_module."""

    def forward(self, h, weight, labels, bias=None):
        logits = F.linear(h, weight, bias).float()
        return F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(0, 1).long(), ignore_index=IGNORE_INDEX, reduction="sum"
        )


def _hidden_and_head(model, inputs):
    """(h, weight, bias): the input of `model.output` (after the final norm) and the weight/bias
    its forward would use, from one call of `model` with the projection itself skipped."""
    head = model.output
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(
            f"chunked_cross_entropy_loss: model.output is a {type(head).__name__}, not an nn.Linear; "
            "set [tpu] loss_chunk_size = 0 for the plain loss"
        )
    seen = {}

    def forward(h):
        # read inside the module's forward: FSDP / mixed precision put the bf16 copy there
        seen["h"], seen["weight"], seen["bias"] = h, head.weight, head.bias
        return h

    head.forward = forward  # an instance attribute, removed below: the module's hooks still run
    try:
        out = model(inputs)
    finally:
        del head.forward
    if "weight" not in seen:
        raise RuntimeError(
            "chunked_cross_entropy_loss: the model's forward did not call model.output; "
            "set [tpu] loss_chunk_size = 0 for the plain loss"
        )
    h = seen["h"]
    if out.shape != h.shape:
        raise RuntimeError(
            f"chunked_cross_entropy_loss: the model's forward changes the output of model.output (shape "
            f"{tuple(out.shape)} from {tuple(h.shape)}); set [tpu] loss_chunk_size = 0 for the plain loss"
        )
    # h is what the projection's forward receives, after its input hooks (tensor parallelism lays
    # it out as the matmul wants it, replicated over tp); the hooks after it treat its return as
    # the logits (vocab-sharded over tp) and are left to act on `out`, which the loss does not use.
    return h, seen["weight"], seen["bias"]


def chunked_cross_entropy_loss(model, inputs, labels, chunk_size: int):
    """cross_entropy_loss(model(inputs), labels), with the output projection and the loss computed
    `chunk_size` sequence positions at a time under recomputation (see the module docstring).

    `model` is a decoder whose forward ends with `model.output` (an nn.Linear), as torchtitan's."""
    if chunk_size < 1:
        raise ValueError(
            f"chunked_cross_entropy_loss: chunk_size must be >= 1, got {chunk_size}; use "
            "cross_entropy_loss for the plain loss"
        )
    from torchtpu.backend.activation_checkpoint import checkpoint_module

    chunk_loss = checkpoint_module(_ChunkCrossEntropy())
    h, weight, bias = _hidden_and_head(model, inputs)
    seq = h.shape[1]
    if labels.shape != h.shape[:2]:
        raise ValueError(
            f"chunked_cross_entropy_loss: labels of shape {tuple(labels.shape)} do not match the "
            f"model's (batch, seq) = {tuple(h.shape[:2])}"
        )
    total = None
    for start in range(0, seq, chunk_size):
        stop = min(start + chunk_size, seq)
        args = (h[:, start:stop], weight, labels[:, start:stop]) + ((bias,) if bias is not None else ())
        part = chunk_loss(*args)
        total = part if total is None else total + part
    count = (labels != IGNORE_INDEX).sum().to(total.dtype)
    return total / count


def language_model_loss(model, inputs, labels, chunk_size: int = 0):
    """The trainer's loss of `model` on (inputs, labels): chunked when chunk_size > 0 and the
    sequence is longer than one chunk, else the plain loss on the whole logits."""
    if chunk_size and inputs.shape[1] > chunk_size:
        return chunked_cross_entropy_loss(model, inputs, labels, chunk_size)
    return cross_entropy_loss(model(inputs), labels)
