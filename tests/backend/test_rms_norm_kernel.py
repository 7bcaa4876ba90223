"""RMS norm on tpu: rms_norm's autograd kernel (the fused op and its backward) and the Pallas
kernels it runs on TPU (torchtpu/backend/ops/rms_norm_tpu.py).

Numerics run the kernels in Pallas interpret mode on CPU against PyTorch's own `rms_norm` on
CPU (forward, the input's and the weight's gradients); compilation for a TPU topology checks
that a train step's norms run as the kernels there and not on CPU.
"""

from __future__ import annotations

import jax
import pytest
import torch

import torchtpu
from torchtpu.backend.ops import attention_tpu, rms_norm_tpu


def _reference(x, weight, eps, grad):
    xc = x.clone().requires_grad_()
    wc = weight.clone().requires_grad_() if weight is not None else None
    out = torch.nn.functional.rms_norm(xc, (x.shape[-1],), wc, eps)
    out.backward(grad)
    return out.detach(), xc.grad, (wc.grad if wc is not None else None)


def _on_tpu(x, weight, eps, grad):
    xt = x.to("tpu").requires_grad_()
    wt = weight.to("tpu").requires_grad_() if weight is not None else None
    out = torch.nn.functional.rms_norm(xt, (x.shape[-1],), wt, eps)
    out.backward(grad.to("tpu"))
    return out.detach().cpu(), xt.grad.cpu(), (wt.grad.cpu() if wt is not None else None)


def _counting(monkeypatch):
    """Counts the kernels' row functions as they are traced (interpret mode runs them as JAX)."""
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = rms_norm_tpu._forward_rows, rms_norm_tpu._backward_rows

    def forward_rows(*a):
        calls["forward"] += 1
        return fwd(*a)

    def backward_rows(*a):
        calls["backward"] += 1
        return bwd(*a)

    monkeypatch.setattr(rms_norm_tpu, "_forward_rows", forward_rows)
    monkeypatch.setattr(rms_norm_tpu, "_backward_rows", backward_rows)
    return calls


@pytest.mark.parametrize(
    "shape, dtype, with_weight",
    [
        ((2, 64, 4, 128), torch.float32, True),  # q/k-norm shaped: one block
        ((4, 512, 2, 128), torch.float32, True),  # 4096 rows of 128: two blocks of 2048
        ((2, 1024, 256), torch.float32, False),  # 2048 rows of 256, no weight: two blocks
        ((4, 256, 2, 256), torch.bfloat16, True),  # bfloat16, 2048 rows of 256: two blocks of 1024
    ],
    ids=str,
)
def test_kernels_match_torch_cpu(monkeypatch, shape, dtype, with_weight):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=g).to(dtype) if with_weight else None
    grad = torch.randn(*shape, generator=g).to(dtype)
    want = _reference(x, weight, 1e-6, grad)
    calls = _counting(monkeypatch)
    with attention_tpu.interpret_kernels():
        got = _on_tpu(x, weight, 1e-6, grad)
    assert calls == {"forward": 1, "backward": 1}
    exact = dtype == torch.float32
    tol = dict(atol=2e-5, rtol=2e-5) if exact else dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    if with_weight:  # a sum over every row: float32 partial sums per block, in another order
        torch.testing.assert_close(got[2], want[2], atol=1e-4 if exact else 0.5, rtol=1e-4 if exact else 1.6e-2)


def test_xla_lowering_matches_torch_cpu_where_the_kernel_does_not_apply(monkeypatch):
    """A norm over two dims, a last dim other than 128 and 256 (a hidden size, or off multiples of
    128) and a float64 input take the XLA lowering (no kernel) and give PyTorch's values, through
    the same autograd kernel."""
    g = torch.Generator().manual_seed(4)
    calls = _counting(monkeypatch)
    for shape, norm_dims, dtype in (
        ((8, 16, 128), 2, torch.float32),
        ((8, 96), 1, torch.float32),
        ((8, 512), 1, torch.float32),
        ((8, 128), 1, torch.float64),
    ):
        x = torch.randn(*shape, generator=g, dtype=dtype)
        w = torch.randn(*shape[-norm_dims:], generator=g, dtype=dtype)
        grad = torch.randn(*shape, generator=g, dtype=dtype)
        xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.nn.functional.rms_norm(xc, shape[-norm_dims:], wc, 1e-5).backward(grad)
        xt, wt = x.to("tpu").requires_grad_(), w.to("tpu").requires_grad_()
        with attention_tpu.interpret_kernels():
            out = torch.nn.functional.rms_norm(xt, shape[-norm_dims:], wt, 1e-5)
            out.backward(grad.to("tpu"))
        torch.testing.assert_close(out.detach().cpu(), torch.nn.functional.rms_norm(x, shape[-norm_dims:], w, 1e-5))
        torch.testing.assert_close(xt.grad.cpu(), xc.grad)
        torch.testing.assert_close(wt.grad.cpu(), wc.grad)
    assert calls == {"forward": 0, "backward": 0}


def test_double_backward_matches_torch_cpu():
    """create_graph: the backward is differentiable again (a gradient penalty through a norm)."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 8, 128, generator=g), torch.randn(128, generator=g)

    def penalty(x, w):
        out = torch.nn.functional.rms_norm(x, (128,), w, 1e-6)
        (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()

    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    penalty(xc, wc)
    xt, wt = x.to("tpu").requires_grad_(), w.to("tpu").requires_grad_()
    with attention_tpu.interpret_kernels():
        penalty(xt, wt)
    torch.testing.assert_close(xt.grad.cpu(), xc.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(wt.grad.cpu(), wc.grad, atol=1e-4, rtol=1e-4)


def test_sharded_program_runs_kernels_per_shard(monkeypatch):
    """Inside a compiled program over an 8-device data-parallel mesh the kernels run per shard
    (rows split with the batch) and give the unsharded values; the weight's gradient sums every
    shard's rows. Under a tensor-parallel mesh the XLA lowering runs, with the same values."""
    from torchtpu.distributed import Replicate, Shard, distribute_tensor, init_device_mesh

    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(8, 256, 128, generator=g), torch.randn(128, generator=g)
    grad = torch.randn(8, 256, 128, generator=g)
    want = _reference(x, w, 1e-6, grad)

    def step(x, w, grad):
        out = torch.nn.functional.rms_norm(x, (128,), w, 1e-6)
        gx, gw = torch.autograd.grad(out, (x, w), grad)
        return out.detach(), gx, gw

    for dims, names, placements, kernels in (
        ((8,), ("dp_shard",), (Shard(0),), 1),
        ((4, 2), ("dp_shard", "tp"), (Shard(0), Replicate()), 0),
    ):
        calls = _counting(monkeypatch)
        mesh = init_device_mesh("tpu", dims, mesh_dim_names=names)
        xs = distribute_tensor(x, mesh, placements).requires_grad_()
        ws = distribute_tensor(w, mesh, (Replicate(),) * len(dims)).requires_grad_()
        gs = distribute_tensor(grad, mesh, placements)
        compiled = torchtpu.compile(step)
        with attention_tpu.interpret_kernels():
            compiled(xs, ws, gs)  # eager warm-up
            got = [t.cpu() for t in compiled(xs, ws, gs)]  # traced over the mesh
        assert calls["forward"] >= kernels and calls["backward"] >= kernels and (kernels or not any(calls.values()))
        for name, a, b in zip(("out", "dx", "dw"), want, got):
            torch.testing.assert_close(
                b, a, atol=1e-4, rtol=1e-4, msg=lambda m, name=name, dims=dims: f"{dims} {name}: {m}"
            )


def _prologue_step_for(mesh):
    """A query projection's per-head norm and a hidden-size norm, forward and backward, compiled
    ahead of time over `mesh` (batch over dp_shard)."""
    from torchtpu.distributed import Replicate, Shard, empty

    def step(x, wq, wn, wh):
        q = (x @ wq).view(x.shape[0], x.shape[1], 4, 128)
        out = (
            torch.nn.functional.rms_norm(q, (128,), wn, 1e-6).sum() + torch.nn.functional.rms_norm(x, (512,), wh).sum()
        )
        return torch.autograd.grad(out, (x, wq, wn, wh))

    batch = empty((8, 256, 512), torch.bfloat16, mesh=mesh, placements=(Shard(0),))
    params = [
        empty(s, torch.bfloat16, mesh=mesh, placements=(Replicate(),)).requires_grad_()
        for s in ((512, 512), (128,), (512,))
    ]
    return torchtpu.compile(step).compile_for(batch.requires_grad_(), *params)


def test_tpu_step_runs_the_kernels_and_cpu_step_does_not():
    """Compiled ahead of time for TPU over v5p:2x2x1 (batch over dp_shard 4), the per-head norm runs
    as the forward kernel and its backward kernel, per shard, and the hidden-size norm as XLA's
    fusions; the same step compiled for CPU has no kernel."""
    from tests.backend.test_pallas_attention import _topology_devices
    from torchtpu.distributed import init_device_mesh

    mesh = init_device_mesh("tpu", (4,), mesh_dim_names=("dp_shard",), devices=_topology_devices())
    hlo = _prologue_step_for(mesh).as_text()
    calls = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(calls) == 2, calls
    assert sum(rms_norm_tpu.KERNEL_NAMES["backward"] in c for c in calls) == 1
    # one shard's rows: 2 sequences x 256 positions x 4 heads
    assert all("bf16[2048,128]" in c.split(" custom-call(")[0] for c in calls), calls
    cpu_mesh = init_device_mesh("tpu", (4,), mesh_dim_names=("dp_shard",), devices=jax.devices("cpu")[:4])
    assert rms_norm_tpu.KERNEL_NAMES["forward"] not in _prologue_step_for(cpu_mesh).as_text()
