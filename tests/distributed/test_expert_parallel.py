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


def _case():
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(ROWS, DIM, generator=g)
    ids = torch.randint(0, E, (ROWS,), generator=g)
    w = torch.randn(E, DIM, DIM, generator=g)
    grad = torch.randn(ROWS, DIM, generator=g)
    return rows, ids, w, grad


def _cpu_oracle(rows, ids, w, grad):
    rows, w = rows.clone().requires_grad_(), w.clone().requires_grad_()
    out = torch.tanh(torch.einsum("rd,rhd->rh", rows, w[ids]))
    out.backward(grad)
    return out.detach(), rows.grad, w.grad


@pytest.mark.parametrize("ep", [1, 2])
def test_dispatch_residuals_are_saved_tensors_and_gradients_are_pytorchs(ep):
    """With an "ep" dim of 2 ranks (all-to-alls) and without (`dim=None`, each chip its own rows):
    the forward packs its residuals through `saved_tensors_hooks` (here moved to the host and back,
    so the backward can only have them from the hooks), and under non-reentrant checkpointing the
    output and both gradients equal PyTorch's CPU computation."""
    rows, ids, w, grad = _case()
    want = _cpu_oracle(rows, ids, w, grad)
    mesh = init_device_mesh("tpu", (4,), mesh_dim_names=("dp_shard",), devices=jax.devices("cpu")[:4])
    if ep > 1:
        mesh = expert_parallel_mesh(mesh, ep)

    def run(r, weight):
        return expert_parallel_ffn(
            r, ids.to("tpu"), [weight], _experts, mesh, num_experts=E, dim="ep" if ep > 1 else None
        )

    packed = []

    def pack(t):
        packed.append(t.numel())
        return t.to("cpu")

    r = rows.to("tpu").requires_grad_()
    wt = w.to("tpu").requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.to("tpu")):
        out = run(r, wt)
    assert sum(packed) >= ROWS * DIM, packed  # the sorted rows at least
    out.backward(grad.to("tpu"))
    tol = dict(rtol=1e-5, atol=1e-5)
    for got, expected in zip((out, r.grad, wt.grad), want):
        assert_close_to_cpu(got, expected, **tol)

    r = rows.to("tpu").requires_grad_()
    wt = w.to("tpu").requires_grad_()
    out = torch.utils.checkpoint.checkpoint(run, r, wt, use_reentrant=False)
    out.backward(grad.to("tpu"))
    for got, expected in zip((out, r.grad, wt.grad), want):
        assert_close_to_cpu(got, expected, **tol)
