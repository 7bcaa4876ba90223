"""torch.func on the tpu device: the transforms of PyTorch's own tutorials (per-sample gradients,
Jacobians and Hessians, model ensembling) run on tpu tensors and give what PyTorch computes on the CPU.

The models are the tutorials' kinds of layers (convolution, linear, activations) plus the ones a
language model adds (LayerNorm, RMSNorm, SiLU, scaled dot-product attention), whose tpu kernels are
fused ops or autograd functions that torch.func would otherwise reject ("must override the
setup_context staticmethod", "Batching rule not implemented for
aten::_scaled_dot_product_fused_attention_overrideable").
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jvp, stack_module_state, vmap
from torch.utils._pytree import tree_leaves

import torchtpu  # noqa: F401  (the tpu device)


def _close(cpu, tpu, rtol=1e-4, atol=1e-5):
    a, b = tree_leaves(cpu), tree_leaves(tpu)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert y.device.type == "tpu"
        torch.testing.assert_close(y.detach().cpu(), x.detach(), rtol=rtol, atol=atol)


class _SimpleCNN(nn.Module):
    """The per-sample-gradients tutorial's model (MNIST-shaped), narrower."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.fc1 = nn.Linear(8 * 3 * 3, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


class _Block(nn.Module):
    """A pre-norm attention + SwiGLU block: RMSNorm, scaled dot-product attention, SiLU."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.w1, self.w3, self.w2 = nn.Linear(dim, 32), nn.Linear(dim, 32), nn.Linear(32, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.out(a)
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _per_sample_grads(model, x, y):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return F.nll_loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def test_per_sample_gradients_of_the_tutorial_cnn_match_the_cpu():
    torch.manual_seed(0)
    model = _SimpleCNN()
    x, y = torch.randn(6, 1, 20, 20), torch.randint(0, 10, (6,))
    want = _per_sample_grads(model, x, y)
    got = _per_sample_grads(copy.deepcopy(model).to("tpu"), x.to("tpu"), y.to("tpu"))
    _close(want, got)
    # each sample's gradient is that sample's plain backward
    m = copy.deepcopy(model)
    F.nll_loss(m(x[2:3]), y[2:3]).backward()
    torch.testing.assert_close(got["fc1.weight"][2].cpu(), m.fc1.weight.grad, rtol=1e-4, atol=1e-6)


def test_language_model_block_per_sample_gradients_and_jvp_match_the_cpu():
    torch.manual_seed(0)
    block = _Block()
    tblock = copy.deepcopy(block).to("tpu")
    x = torch.randn(2, 4, 16)

    def transforms(m, x):
        params = {k: v.detach() for k, v in m.named_parameters()}

        def loss(p, x):
            return functional_call(m, p, (x,)).pow(2).mean()

        return {
            "per-sample": vmap(grad(loss), in_dims=(None, 0))(params, x.unsqueeze(1)),
            "jvp": jvp(lambda xi: F.silu(m.norm1(xi)), (x,), (torch.ones_like(x),)),
        }

    want = transforms(block, x)
    got = transforms(tblock, x.to("tpu"))
    for name in want:
        _close(want[name], got[name])


@pytest.mark.parametrize("act", [F.silu, F.mish])
def test_activation_jacobians_and_hessians_match_the_cpu(act):
    x = torch.linspace(-4, 4, 9)
    _close(jacfwd(act)(x), jacfwd(act)(x.to("tpu")))
    _close(hessian(lambda v: act(v).sum())(x), hessian(lambda v: act(v).sum())(x.to("tpu")))


def test_model_ensembling_with_stacked_parameters_matches_the_cpu():
    """The model-ensembling tutorial: several models' parameters stacked, one vmap over them."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)) for _ in range(3)]
    x = torch.randn(5, 8)

    def ensemble(models, x):
        params, buffers = stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")
        return vmap(lambda p, b, xi: functional_call(base, (p, b), (xi,)), in_dims=(0, 0, None))(params, buffers, x)

    want = ensemble(models, x)
    got = ensemble([copy.deepcopy(m).to("tpu") for m in models], x.to("tpu"))
    _close(want, got)
    _close(torch.stack([m(x) for m in models]), got)


def test_in_place_views_take_the_overload_of_their_own_arguments():
    """squeeze_(dims) takes int[] dims, squeeze(dim) an int of the same name (vmap's own calls)."""
    for shape, op in [((2, 1, 3, 1), lambda t: t.squeeze_((1, 3))), ((2, 1, 3), lambda t: t.squeeze_(1))]:
        cpu = torch.arange(6.0).reshape(shape)
        tpu = cpu.to("tpu")
        op(cpu)
        op(tpu)
        assert tpu.shape == cpu.shape
        torch.testing.assert_close(tpu.cpu(), cpu)
