"""`torchtpu::head_norm_rope` (Qwen3's per-head query/key norm, rotary embedding and transpose as
one op) and its Pallas kernels (torchtpu/backend/ops/head_norm_rope_tpu.py).

The oracle is torchtitan's own Qwen3 code on CPU: `nn.functional.rms_norm` over each head, then
torchtitan's `apply_rotary_emb`, then the transpose. On tpu the op runs as XLA's fusions, or as
the kernels in Pallas interpret mode on CPU; compiled for a TPU topology, a train step runs the
kernels, per shard.
"""

from __future__ import annotations

import contextlib

import jax
import pytest
import torch
from torchtitan.models.qwen3.model.model import apply_rotary_emb, precompute_rope_cache

import torchtpu
from torchtpu.backend.ops import attention_tpu, head_norm_rope_tpu


def _inputs(batch, seq, heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, seq, heads * head_dim, generator=g) * 3).to(dtype)
    w = (1 + 0.5 * torch.randn(head_dim, generator=g)).to(dtype)
    grad = torch.randn(batch, heads, seq, head_dim, generator=g).to(dtype)
    rope = precompute_rope_cache(head_dim, 2 * seq)  # torchtitan's table, longer than the sequence
    return x, w, grad, rope


def _torchtitan(x, w, grad, rope, head_dim, eps=1e-6):
    """torchtitan's Qwen3 query path on CPU: (out, x's gradient, w's gradient)."""
    b, s, _ = x.shape
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch.nn.functional.rms_norm(xc.view(b, s, -1, head_dim), (head_dim,), wc, eps)
    out, _ = apply_rotary_emb(y, y, rope)
    out = out.transpose(1, 2)
    out.backward(grad)
    return out.detach(), xc.grad, wc.grad


def _op(x, w, grad, rope, head_dim, device, eps=1e-6):
    xt, wt = x.to(device).requires_grad_(), w.to(device).requires_grad_()
    out = torch.ops.torchtpu.head_norm_rope(xt, wt, eps, rope.to(device), head_dim)
    out.backward(grad.to(device))
    return out.detach().cpu(), xt.grad.cpu(), wt.grad.cpu()


def _counting(monkeypatch):
    """Counts the kernels' calls as they are traced (interpret mode runs them as JAX)."""
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = head_norm_rope_tpu._forward_local, head_norm_rope_tpu._backward_local

    def forward_local(*a):
        calls["forward"] += 1
        return fwd(*a)

    def backward_local(*a):
        calls["backward"] += 1
        return bwd(*a)

    monkeypatch.setattr(head_norm_rope_tpu, "_forward_local", forward_local)
    monkeypatch.setattr(head_norm_rope_tpu, "_backward_local", backward_local)
    return calls


def test_cpu_op_is_torchtitans_code():
    """On CPU the op and its gradient are torchtitan's ops, bit for bit."""
    x, w, grad, rope = _inputs(2, 16, 3, 128, torch.bfloat16)
    want = _torchtitan(x, w, grad, rope, 128)
    got = _op(x, w, grad, rope, 128, "cpu")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2])


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((2, 256, 4, 128), torch.float32),  # two grid steps of 128 positions... over 4 heads
        ((2, 256, 4, 128), torch.bfloat16),
        ((1, 1024, 2, 128), torch.bfloat16),  # key-shaped: 2 heads, 2 blocks of 512 positions
        ((2, 128, 2, 256), torch.bfloat16),  # head_dim 256
    ],
    ids=str,
)
@pytest.mark.parametrize("kernels", [False, True], ids=["xla", "kernels"])
def test_tpu_op_matches_torchtitan_on_cpu(monkeypatch, shape, dtype, kernels):
    b, s, h, d = shape
    x, w, grad, rope = _inputs(b, s, h, d, dtype)
    want = _torchtitan(x, w, grad, rope, d)
    calls = _counting(monkeypatch)
    with attention_tpu.interpret_kernels() if kernels else contextlib.nullcontext():
        got = _op(x, w, grad, rope, d, "tpu")
    if kernels:  # (without interpret mode, CPU runs XLA's branch of a platform_dependent)
        assert calls == {"forward": 1, "backward": 1}
    if dtype == torch.float32:
        tol = dict(atol=2e-5, rtol=2e-5)
    else:  # the norm's single rounding against PyTorch's: one bfloat16 step apart at most
        tol = dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    torch.testing.assert_close(got[2], want[2], atol=1e-3 * want[2].abs().max().item(), rtol=2e-2)


def test_kernels_take_what_fits_their_blocks():
    """Where the kernels do not apply the op runs as XLA's fusions: a sequence off multiples of 128,
    another head dim, or so many heads that 128 positions of them exceed a block (64 float32 heads)."""
    import jax.numpy as jnp

    def reason(b, s, h, d, dtype=jnp.bfloat16):
        return head_norm_rope_tpu.unsupported_reason(jnp.zeros((b, s, h * d), dtype), d)

    assert reason(2, 256, 32, 128) is None and reason(1, 128, 64, 128) is None
    assert "multiple of 128" in reason(2, 200, 4, 128)
    assert "head_dim 64" in reason(2, 256, 4, 64)
    assert "exceed a block" in reason(1, 128, 64, 128, jnp.float32)


def test_bad_rope_table_is_one_line():
    x, w, grad, rope = _inputs(1, 16, 2, 128, torch.float32)
    with pytest.raises(ValueError, match="does not cover 16 positions"):
        torch.ops.torchtpu.head_norm_rope(x, w, 1e-6, rope[:8], 128)


def test_sharded_program_runs_kernels_per_shard(monkeypatch):
    """Inside a compiled program over an 8-device data-parallel mesh the kernels run per shard
    (the batch split) and give the unsharded values; under a tensor-parallel mesh the XLA
    lowering runs, with the same values."""
    from torchtpu.distributed import Replicate, Shard, distribute_tensor, init_device_mesh

    x, w, grad, rope = _inputs(8, 128, 2, 128, torch.float32, seed=2)
    want = _torchtitan(x, w, grad, rope, 128)

    def step(x, w, rope, grad):
        out = torch.ops.torchtpu.head_norm_rope(x, w, 1e-6, rope, 128)
        gx, gw = torch.autograd.grad(out, (x, w), grad)
        return out.detach(), gx, gw

    for dims, names, kernels in (((8,), ("dp_shard",), 1), ((4, 2), ("dp_shard", "tp"), 0)):
        calls = _counting(monkeypatch)
        mesh = init_device_mesh("tpu", dims, mesh_dim_names=names)
        rep = (Replicate(),) * len(dims)
        batch = (Shard(0),) + rep[1:]
        xs = distribute_tensor(x, mesh, batch).requires_grad_()
        ws = distribute_tensor(w, mesh, rep).requires_grad_()
        with attention_tpu.interpret_kernels():
            got = [
                t.cpu()
                for t in torchtpu.compile(step)(
                    xs, ws, distribute_tensor(rope, mesh, rep), distribute_tensor(grad, mesh, batch)
                )
            ]
        assert (calls["forward"] >= 1 and calls["backward"] >= 1) if kernels else not any(calls.values()), calls
        for name, a, b in zip(("out", "dx", "dw"), want, got):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=lambda m, n=name, d=dims: f"{d} {n}: {m}")


def test_tpu_step_runs_the_kernels_and_cpu_step_does_not():
    """Compiled ahead of time for TPU over v5p:2x2x1 (batch over dp_shard 4), a query projection's
    norm and rotation run as the two kernels, per shard, and write attention's (batch, heads, seq,
    head_dim) layout; the same step compiled for CPU has no kernel."""
    from tests.backend.test_pallas_attention import _topology_devices
    from torchtpu.distributed import Replicate, Shard, empty, init_device_mesh

    def compiled_for(mesh):
        def step(x, wq, wn, rope):
            q = torch.ops.torchtpu.head_norm_rope(x @ wq, wn, 1e-6, rope, 128)
            return torch.autograd.grad(q.float().pow(2).sum(), (x, wq, wn))

        x = empty((8, 256, 512), torch.bfloat16, mesh=mesh, placements=(Shard(0),)).requires_grad_()
        wq = empty((512, 512), torch.bfloat16, mesh=mesh, placements=(Replicate(),)).requires_grad_()
        wn = empty((128,), torch.bfloat16, mesh=mesh, placements=(Replicate(),)).requires_grad_()
        rope = empty((512, 256), torch.float32, mesh=mesh, placements=(Replicate(),))
        return torchtpu.compile(step).compile_for(x, wq, wn, rope).as_text()

    mesh = init_device_mesh("tpu", (4,), mesh_dim_names=("dp_shard",), devices=_topology_devices())
    calls = [line for line in compiled_for(mesh).splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    names = head_norm_rope_tpu.KERNEL_NAMES
    bwd = [c for c in calls if names["backward"] in c]
    fwd = [c for c in calls if names["forward"] in c and c not in bwd]
    assert len(fwd) == 1 and len(bwd) == 1, calls
    fwd = fwd[0]
    assert "bf16[2,4,256,128]" in fwd.split(" custom-call(")[0], fwd  # one shard, head-major
    cpu_mesh = init_device_mesh("tpu", (4,), mesh_dim_names=("dp_shard",), devices=jax.devices("cpu")[:4])
    assert names["forward"] not in compiled_for(cpu_mesh)


def test_norm_rope_attention_is_torchtitans_attention():
    """NormRopeAttention (what prepare_qwen3 makes of torchtitan's Qwen3 attention) computes
    torchtitan's forward and gradients in float32: on CPU the output and the input's gradient bit for
    bit (the weights' gradients are sums in another order), on tpu within float32 tolerances; with
    explicit positions it runs torchtitan's own forward."""
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Attention

    from torchtpu.models.qwen3.attention import NormRopeAttention, use_norm_rope_attention

    args = Qwen3ModelArgs(dim=256, n_heads=4, n_kv_heads=2, head_dim=128, qk_norm=True, max_seq_len=256)
    torch.manual_seed(0)
    ref = Attention(args)
    for p in ref.parameters():  # norm weights away from 1, so their gradients are tested too
        torch.nn.init.normal_(p, std=0.5)
    fused = use_norm_rope_attention(torch.nn.Sequential(Attention(args)))[0]
    assert type(fused) is NormRopeAttention
    fused.load_state_dict(ref.state_dict())
    rope = precompute_rope_cache(128, 256)
    x = torch.randn(2, 128, 256)

    def run(module, x, rope, positions=None):
        x = x.clone().requires_grad_()
        out = module(x, rope, None, positions)
        out.pow(2).sum().backward()
        grads = [p.grad.clone() for p in module.parameters()]
        module.zero_grad()
        return out.detach(), x.grad, grads

    want = run(ref, x, rope)
    got = run(fused, x, rope)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, atol=1e-5 * b.abs().max().item(), rtol=1e-4)
    positions = torch.arange(128).flip(0)[None]
    assert torch.equal(run(fused, x, rope, positions)[0], run(ref, x, rope, positions)[0])

    fused.to("tpu")
    on_tpu = run(fused, x.to("tpu"), rope.to("tpu"))
    for a, b in zip(on_tpu[:2], want[:2]):  # (a squared-sum loss: gradients in the 1e5s)
        torch.testing.assert_close(a.cpu(), b, atol=1e-5 * b.abs().max().item(), rtol=1e-4)
    for a, b in zip(on_tpu[2], want[2]):
        torch.testing.assert_close(a.cpu(), b, atol=1e-5 * b.abs().max().item(), rtol=1e-4)
