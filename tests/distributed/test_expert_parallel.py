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
