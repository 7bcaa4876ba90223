"""The trainer's loss: mean token cross entropy of a language model, plain or chunked.

    loss = cross_entropy_loss(model(inputs), labels)             # logits [b, s, vocab] in, as torchtitan
    loss = chunked_cross_entropy_loss(model, inputs, labels, 2048)  # the same value, logits never whole

Why chunked: the plain loss materializes the logits of every token in float32 ([tokens, vocab]:
for Llama 3 8B at seq 8192, 128,256 x 8,192 x 4 bytes = 4.2 GB per sequence), and its backward
keeps them (or the softmax) alive until the gradient reaches the output projection. The chunked
loss runs the model up to its final norm, then, for each chunk of `chunk_size` sequence positions,
computes the logits in float32, the chunk's summed cross entropy and, right away, its gradients
(fused linear cross entropy): d(loss)/d(logits) = softmax - onehot (zero rows for ignored labels),
the chunk's part of d/dh = dlogits @ W, and d/dW += dlogits^T @ h (d/db likewise), summed in
float32. The forward keeps those gradients, no logits; backward only scales them by the incoming
gradient (the loss is a sum over chunks, so that is exact) and returns them in the dtypes of h and
W. Nothing is recomputed: the projection costs 6 N D V FLOPs as in the plain loss (2 forward, 4 for
the gradients), where recomputing each chunk's logits in backward cost 8. The value is the same
mean over the non-ignored tokens (F.cross_entropy's ignore_index = -100), summed in a different
order.

Chunks split the sequence dim, not the batch dim, so each chunk stays spread over the
data-parallel ranks as the batch is. The output projection is the model's own module (its
tensor-parallel and FSDP hooks run as usual); only its matmul is moved out of its forward, with
the input and the weight it reads there (mixed precision's bf16 copy), whose gradient then flows
back through FSDP's cast and layout as in the model's own forward. d/dW is summed in the weight parameter's layout
after each chunk; with FSDP alone, a chunk with fewer tokens than the vocabulary (Llama 3 8B at
chunk 2048 on 4 chips: 8,192 against 128,256) splits its logits over the vocabulary as the weight's
rows are, so d/dW is computed in that layout, never as a whole float32 [vocab, dim] per chip.

With tensor parallelism the projection's weight is split over the vocabulary, so each chunk's
logits are vocab-sharded; each chunk's cross entropy is F.cross_entropy, and under `loss_parallel`
it reduces across the tp shards without gathering them, as the plain loss does, and so does its
gradient. The chunk's logits and their gradient are pinned to that layout (tokens over the
data-parallel axes, the vocabulary over tp), which XLA would otherwise trade for a gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jax.sharding import PartitionSpec as P

from torchtpu.distributed import placements
from torchtpu.distributed.batch import data_parallel_axes
from torchtpu.distributed.params import get_layout, module_record, through_layout

__all__ = ["cross_entropy_loss", "chunked_cross_entropy_loss", "language_model_loss", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # F.cross_entropy's default, torchtitan's too


def cross_entropy_loss(logits, labels):
    """torchtitan's loss: mean token cross entropy, computed in float32."""
    # PyTorch wants int64 class indices; the trainer's token ids are int32 on the device
    # (docs/DESIGN_NOTES.md), and the widening is folded away by the compiler.
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1).long())


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum over the non-ignored tokens of cross_entropy(h @ weight.T + bias, labels), computed
    `chunk` sequence positions at a time, with its gradients computed in the same pass (see the
    module docstring). Backward only scales them by the incoming gradient: the result is a sum,
    linear in each chunk's gradient, so this is exact."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk, grads, layouts, bias=None):
        # `grads`: grad mode outside (under no_grad needs_input_grad is still true, and there is
        # no gradient to compute); `layouts`: of the weight and the bias, or None
        need_h, need_w, *_, need_b = (n and grads for n in ctx.needs_input_grad + (False,) * (bias is None))
        need = need_h or need_w or need_b
        total, dh_parts, dw, db = None, [], None, None
        pin_logits, pin_hidden = _chunk_pinners(layouts[0], h.shape[0] * min(chunk, h.shape[1]), weight.shape[0])
        for start in range(0, h.shape[1], chunk):
            h_c = h[:, start : start + chunk]
            if start:
                # one chunk at a time (see _after): the next chunk's input waits for the results so far
                h_c, (total, dw, db, last_dh) = _after(h_c, (total, dw, db, dh_parts[-1] if dh_parts else None))
                if dh_parts:
                    dh_parts[-1] = last_dh
            y = labels[:, start : start + chunk].flatten(0, 1).long()
            out = pin_logits(F.linear(h_c, weight, bias).flatten(0, 1))
            # A leaf of its own: F.cross_entropy's backward (loss_parallel's vocab-parallel one under
            # tensor parallelism) gives d(loss)/d(logits) = softmax - onehot, zero for ignored rows.
            logits = out.float().requires_grad_(need)
            with torch.enable_grad():
                part = F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
            total = part.detach() if total is None else total + part.detach()
            if not need:
                continue
            (dlogits,) = torch.autograd.grad(part, logits)
            # the cast autograd would make at .float(): the matmuls below run in the projection's dtype
            dl = pin_logits(dlogits.to(out.dtype))
            if need_h:
                dh_parts.append(pin_hidden(dl @ weight).unflatten(0, h_c.shape[:2]))
            if need_w:
                # float32 sums; each kept in the weight's own layout, so no chip holds the whole of it
                part_w = _matmul_float32(dl.t(), h_c.flatten(0, 1))
                dw = through_layout(part_w if dw is None else dw + part_w, layouts[0])
            if need_b:
                part_b = dl.sum(0, dtype=torch.float32)
                db = through_layout(part_b if db is None else db + part_b, layouts[1])
        ctx.dtypes = (h.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(torch.cat(dh_parts, dim=1) if dh_parts else None, dw, db)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        dh, dw, db = ctx.saved_tensors
        scaled = [None if g is None else (g.float() * grad_total).to(dt) for g, dt in zip((dh, dw, db), ctx.dtypes)]
        return scaled[0], scaled[1], None, None, None, None, scaled[2]


def _after(x, done):
    """(x, done) unchanged in value, with x available only once every tensor of `done` (None
    entries skipped) is computed: an optimization barrier on tpu, a no-op elsewhere.

    The chunks of the fused loss are independent of each other, and XLA's scheduler would start
    every chunk's logits before any chunk's gradients are done and hold them all: on Llama 3 8B
    with FSDP over v5p:2x2x1, four bf16 [8192, 32064] logit gradients at once and 2.5 GiB more
    temporaries per chip than one chunk at a time needs (docs/DESIGN_NOTES.md)."""
    live = [t for t in done if t is not None]
    if not live or x.device.type != "tpu":
        return x, done
    x, *live = torch.ops.torchtpu.optimization_barrier([x, *live])
    it = iter(live)
    return x, tuple(None if t is None else next(it) for t in done)


def _chunk_pinners(weight_layout, tokens: int, rows: int):
    """(pin_logits, pin_hidden): x -> x constrained to a layout, for a chunk's [tokens, vocab]
    logits or their gradient, and its [tokens, dim] gradient of the hidden states (tokens over the
    data-parallel axes, as the batch; dim whole).

    With tensor parallelism, loss_parallel's layout: the vocabulary over the tp axes, the tokens
    over the data-parallel ones, as the batch. Left free, XLA lays the logits' gradient out as the
    hidden states' gradient is wanted next (under sequence parallelism, tokens over every axis) and
    gathers it whole over the vocabulary to get there.

    Without it (FSDP), when the chunk has fewer tokens (over the whole batch) than the weight has
    rows, the vocabulary is split as the weight's rows, over the FSDP axes, and the tokens are
    gathered instead: the gradient of the weight is then computed in its own layout, where
    splitting the tokens computes a whole float32 [vocab, dim] partial sum per chip (1.96 GiB for
    Llama 3 8B) before reducing it. Moving the chunk's hidden states costs less than moving the
    weight's rows in that case; in the other, the tokens stay over the data-parallel axes."""
    if weight_layout is None or weight_layout.mesh is None:
        return (lambda x: x), (lambda x: x)
    mesh = weight_layout.mesh
    batch_axes = _batch_axes(weight_layout)
    row_axes = tuple(weight_layout.dims[0])
    vocab_axes = tuple(a for a in row_axes if a not in batch_axes)
    if _vocab_split_as_fsdp(weight_layout, tokens, rows):
        vocab_axes = row_axes
    token_axes = tuple(a for a in batch_axes if a not in vocab_axes)

    def pinner(first_axes, last):
        def pin(x):
            if x.device.type != "tpu":
                return x
            first = placements.batch_entry(mesh.jax_mesh, first_axes, x.shape[0])
            spec = placements.encode(mesh, P(first, last))
            return torch.ops.torchtpu.shard(x, spec, spec)

        return pin

    vocab = (vocab_axes[0] if len(vocab_axes) == 1 else vocab_axes) if vocab_axes else P.UNCONSTRAINED
    return pinner(token_axes, vocab), pinner(batch_axes, None)


def _batch_axes(weight_layout) -> tuple[str, ...]:
    return data_parallel_axes(weight_layout.mesh)


def _vocab_split_as_fsdp(weight_layout, tokens: int, rows: int) -> bool:
    """Whether a chunk's logits are split over the vocabulary as FSDP splits the weight's rows (no
    tensor parallelism on them, and fewer tokens in the chunk than vocabulary rows; see
    _chunk_pinners)."""
    if weight_layout is None or weight_layout.mesh is None or not weight_layout.dims[0]:
        return False
    batch_axes = _batch_axes(weight_layout)
    return all(a in batch_axes for a in weight_layout.dims[0]) and tokens < rows


def _matmul_float32(a, b):
    """a @ b as a float32 result: low-precision operands are multiplied as they are, the sums kept
    in float32 (on tpu the matrix unit's own float32 accumulation, no float32 matmul)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.device.type == "tpu":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


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
    `chunk_size` sequence positions at a time, their gradients in the same pass (see the module
    docstring).

    `model` is a decoder whose forward ends with `model.output` (an nn.Linear), as torchtitan's."""
    if chunk_size < 1:
        raise ValueError(
            f"chunked_cross_entropy_loss: chunk_size must be >= 1, got {chunk_size}; use "
            "cross_entropy_loss for the plain loss"
        )
    head = model.output
    if isinstance(head, torch.nn.Linear):
        # FSDP otherwise gathers the projection's weight for use; split over the vocabulary, each
        # chip computes its own rows of it (module_record's keep_split)
        tokens = inputs.shape[0] * min(chunk_size, inputs.shape[1])
        split = _vocab_split_as_fsdp(get_layout(head, "weight"), tokens, head.weight.shape[0])
        module_record(head, create=True).keep_split = split
    h, weight, bias = _hidden_and_head(model, inputs)
    if labels.shape != h.shape[:2]:
        raise ValueError(
            f"chunked_cross_entropy_loss: labels of shape {tuple(labels.shape)} do not match the "
            f"model's (batch, seq) = {tuple(h.shape[:2])}"
        )
    layouts = (get_layout(head, "weight"), get_layout(head, "bias"))
    args = (h, weight, labels, chunk_size, torch.is_grad_enabled(), layouts) + ((bias,) if bias is not None else ())
    total = _FusedLinearCrossEntropy.apply(*args)
    count = (labels != IGNORE_INDEX).sum().to(total.dtype)
    return total / count


def language_model_loss(model, inputs, labels, chunk_size: int = 0):
    """The trainer's loss of `model` on (inputs, labels): chunked when chunk_size > 0 and the
    sequence is longer than one chunk, else the plain loss on the whole logits."""
    if chunk_size and inputs.shape[1] > chunk_size:
        return chunked_cross_entropy_loss(model, inputs, labels, chunk_size)
    return cross_entropy_loss(model(inputs), labels)
