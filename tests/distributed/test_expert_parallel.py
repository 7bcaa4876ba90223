"""The expert dispatch's autograd node (distributed.expert_parallel): its backward's residuals are
PyTorch saved tensors, so saved-tensor hooks (and with them non-reentrant activation
checkpointing) see them, and its gradients are PyTorch's on CPU."""

from __future__ import annotations

import jax
import pytest
import torch
import torch.utils.checkpoint

import torchtpu  # noqa: F401
from torchtpu.distributed import init_device_mesh
from torchtpu.distributed.expert_parallel import expert_parallel_ffn
from torchtpu.distributed.mesh import expert_parallel_mesh

from ..conftest import assert_close_to_cpu

pytestmark = pytest.mark.usefixtures("keep_current_mesh")

E, DIM, ROWS = 4, 8, 32


def _experts(weights, x, tokens_per_expert):
    """Each group of rows of `x` times its expert's (DIM, DIM) matrix (an expert keeps the width), then tanh, in float32;
    rows past the last group come out zero."""
    (w,) = weights
    ends = torch.cumsum(tokens_per_expert, 0)
    pos = torch.arange(x.shape[0], device=x.device)
    group = (pos[:, None] >= ends[None, :]).sum(1).clamp(max=w.shape[0] - 1)
    inside = (pos < ends[-1]).to(x.dtype)[:, None]
    return torch.tanh(torch.einsum("rd,rhd->rh", x, w[group])) * inside


def _case(k):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS // k, DIM, generator=g)
    ids = torch.randint(0, E, (ROWS,), generator=g)
    w = torch.randn(E, DIM, DIM, generator=g)
    scores = torch.rand(ROWS // k, k, generator=g)
    grad = torch.randn(ROWS // k if k > 1 else ROWS, DIM, generator=g)
    return x, ids, w, scores, grad


def _cpu_oracle(x, ids, w, scores, grad, k):
    """Row t*k + j is token t through expert ids[t*k + j]; with k > 1 the rows weighted by the
    scores and summed per token. The output and the gradients of x, w (and scores)."""
    x, w, scores = (t.clone().requires_grad_() for t in (x, w, scores))
    rows = x.repeat_interleave(k, 0)
    out = torch.tanh(torch.einsum("rd,rhd->rh", rows, w[ids]))
    if k > 1:
        out = (out.reshape(-1, k, DIM) * scores[:, :, None]).sum(1)
    out.backward(grad)
    return [out.detach(), x.grad, w.grad] + ([scores.grad] if k > 1 else [])


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("ep", [1, 2])
def test_dispatch_residuals_are_saved_tensors_and_gradients_are_pytorchs(ep, k):
    """With an "ep" dim of 2 ranks (all-to-alls) and without (`dim=None`, each chip its own rows),
    one output per row (k = 1) and each token's k = 2 outputs combined by its scores: the forward
    packs its residuals through `saved_tensors_hooks` (here moved to the host and back, so the
    backward can only have them from the hooks), and with them and under non-reentrant
    checkpointing the output and the gradients equal PyTorch's CPU computation."""
    x, ids, w, scores, grad = _case(k)
    want = _cpu_oracle(x, ids, w, scores, grad, k)
    mesh = init_device_mesh("tpu", (4,), mesh_dim_names=("dp_shard",), devices=jax.devices("cpu")[:4])
    if ep > 1:
        mesh = expert_parallel_mesh(mesh, ep)

    def run(xt, wt, st):
        dim = "ep" if ep > 1 else None
        kw = dict(top_k=k, scores=st) if k > 1 else {}
        return expert_parallel_ffn(xt, ids.to("tpu"), [wt], _experts, mesh, num_experts=E, dim=dim, **kw)

    packed = []

    def pack(t):
        packed.append(t.numel())
        return t.to("cpu")

    tol = dict(rtol=1e-5, atol=1e-5)
    for hooks in (True, False):
        inputs = [t.to("tpu").requires_grad_() for t in (x, w, scores)]
        if hooks:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.to("tpu")):
                out = run(*inputs)
            assert sum(packed) >= ROWS * DIM, packed  # the sorted rows at least
        else:
            out = torch.utils.checkpoint.checkpoint(run, *inputs, use_reentrant=False)
        out.backward(grad.to("tpu"))
        got = [out, inputs[0].grad, inputs[1].grad] + ([inputs[2].grad] if k > 1 else [])
        for a, b in zip(got, want, strict=True):
            assert_close_to_cpu(a, b, **tol)


def _hidden(weights, x, tokens_per_expert):
    """The split experts' first stage: `_experts` with the first of two weights."""
    return _experts(weights[:1], x, tokens_per_expert)


def _hidden_bf16(weights, x, tokens_per_expert):
    return _hidden(weights, x, tokens_per_expert).bfloat16()


def _two_stage_experts(weights, x, tokens_per_expert):
    """`_hidden_bf16`, then each group of rows times its expert's second (DIM, DIM) matrix,
    transposed (torch._grouped_mm takes bfloat16 only): what `front=_hidden_bf16` promises."""
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    h = _hidden_bf16(weights, x, tokens_per_expert)
    return torch._grouped_mm(h, weights[-1].to(h.dtype).transpose(-2, -1), offs=offsets).type_as(x)


@pytest.mark.parametrize("hooks", [True, False])
@pytest.mark.parametrize("ep", [1, 2])
def test_combined_outputs_backward_without_the_expert_outputs_gives_pytorchs_gradients(ep, hooks):
    """With scores and a `front`, with expert parallelism (the token gradients and the scores
    travel to the experts by all-to-all, the scores' gradients back) and without, the dispatch
    runs the experts' last matmul and the combine as one step whose backward computes each score's
    gradient from the hidden states and the rows' gradient instead of from the experts' outputs,
    and scales the hidden states instead of the gradient for the last weight's gradient. In float32 (`front`
    without its bfloat16 rounding), output and every gradient (x, both weights, the scores) equal
    PyTorch's CPU computation of the plain formula, with the residuals through saved-tensor hooks
    or under non-reentrant checkpointing. With hooks, the residuals are the plain dispatch's (the
    experts run whole, in bfloat16) less the experts' outputs."""
    k = 2
    x, ids, w1, scores, grad = _case(k)
    w2 = torch.randn(E, DIM, DIM, generator=torch.Generator().manual_seed(5))
    xs, w1s, w2s, ss = (t.clone().requires_grad_() for t in (x, w1, w2, scores))
    rows = xs.repeat_interleave(k, 0)
    h = torch.tanh(torch.einsum("rd,rhd->rh", rows, w1s[ids]))
    out = (torch.einsum("rh,rdh->rd", h, w2s[ids]).reshape(-1, k, DIM) * ss[:, :, None]).sum(1)
    out.backward(grad)
    want = [out.detach(), xs.grad, w1s.grad, w2s.grad, ss.grad]

    mesh = init_device_mesh("tpu", (4,), mesh_dim_names=("dp_shard",), devices=jax.devices("cpu")[:4])
    if ep > 1:
        mesh = expert_parallel_mesh(mesh, ep)

    def run(xt, w1t, w2t, st, front=_hidden):
        return expert_parallel_ffn(
            xt, ids.to("tpu"), [w1t, w2t], _two_stage_experts, mesh,
            num_experts=E, dim="ep" if ep > 1 else None, top_k=k, scores=st, front=front,
        )  # fmt: skip

    def leaves(dtype=torch.float32):
        return [t.to("tpu", dtype).requires_grad_() for t in (x, w1, w2, scores)]

    inputs = leaves()
    if hooks:

        def residuals(front, inputs):
            packed = []

            def pack(t):
                packed.append(tuple(t.shape))
                return t.to("cpu")

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.to("tpu")):
                out = run(*inputs, front=front)
            return out, packed

        got, _ = residuals(_hidden, inputs)
        _, plain = residuals(None, leaves(torch.bfloat16))
        _, split = residuals(_hidden_bf16, leaves(torch.bfloat16))
        assert split.count((ROWS, DIM)) == plain.count((ROWS, DIM)) - 1, (split, plain)
    else:
        got = torch.utils.checkpoint.checkpoint(run, *inputs, use_reentrant=False)
    got.backward(grad.to("tpu"))
    for a, b in zip([got] + [t.grad for t in inputs], want, strict=True):
        assert_close_to_cpu(a, b, rtol=1e-5, atol=1e-5)
