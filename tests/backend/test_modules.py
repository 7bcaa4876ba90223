"""torch.nn modules and functionals on the tpu device, with PyTorch on CPU as the oracle.

Each test builds the module on CPU with a fixed seed, deep-copies it to `tpu`, feeds both the
same inputs, and compares the outputs, the gradients of every parameter and of every floating
input, and (where the module has them) the buffers after the step.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

import torchtpu  # noqa: F401
from tests.conftest import assert_close_to_cpu

DEV = "tpu"
TOL = dict(rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- helpers


def _leaf_copy(x: torch.Tensor, device) -> torch.Tensor:
    y = x.detach().clone().to(device)
    if x.is_floating_point() and x.requires_grad:
        y.requires_grad_(True)
    return y


def _float_outputs(out):
    return [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.is_floating_point()]


def _weighted_loss(outs, weights):
    loss = None
    for o, w in zip(outs, weights):
        term = (o * w.to(o.device)).sum()
        loss = term if loss is None else loss + term
    return loss


assert_close_cpu = partial(assert_close_to_cpu, **TOL)


def check_module(module, *inputs, kwargs=None, seed=0, tol=None, grad_tol=None, forward_fn=None):
    """Forward + backward of `module` on CPU and on tpu; compare outputs, grads and buffers.

    Floating inputs with requires_grad=True get their gradients compared too. `forward_fn`,
    if given, is called as forward_fn(module, *inputs, **kwargs) instead of module(...).
    """
    tol = tol or {}
    grad_tol = grad_tol or tol
    kwargs = kwargs or {}
    cpu_mod = module
    tpu_mod = copy.deepcopy(module).to(DEV)
    for p in tpu_mod.parameters():
        assert p.device.type == DEV
    fwd = forward_fn or (lambda m, *a, **k: m(*a, **k))

    cpu_in = [_leaf_copy(x, "cpu") if isinstance(x, torch.Tensor) else x for x in inputs]
    tpu_in = [_leaf_copy(x, DEV) if isinstance(x, torch.Tensor) else x for x in inputs]
    cpu_kw = {k: (v.to("cpu") if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    tpu_kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}

    cpu_out = fwd(cpu_mod, *cpu_in, **cpu_kw)
    tpu_out = fwd(tpu_mod, *tpu_in, **tpu_kw)
    c_outs, t_outs = _float_outputs(cpu_out), _float_outputs(tpu_out)
    assert len(c_outs) == len(t_outs)
    for i, (t, c) in enumerate(zip(t_outs, c_outs)):
        assert_close_cpu(t, c, f"output {i}", **tol)

    # Buffers (running stats) after the forward.
    for (name, cb), (_, tb) in zip(cpu_mod.named_buffers(), tpu_mod.named_buffers()):
        assert_close_cpu(tb, cb, f"buffer {name}", **tol)

    if not any(o.requires_grad for o in c_outs):
        return cpu_out, tpu_out
    g = torch.Generator().manual_seed(seed + 1)
    weights = [torch.randn(o.shape, generator=g) for o in c_outs]
    pairs = [(c, t, w) for c, t, w in zip(c_outs, t_outs, weights) if c.requires_grad]
    _weighted_loss([p[0] for p in pairs], [p[2] for p in pairs]).backward()
    _weighted_loss([p[1] for p in pairs], [p[2] for p in pairs]).backward()

    for (name, cp), (_, tp) in zip(cpu_mod.named_parameters(), tpu_mod.named_parameters()):
        if cp.grad is None:
            assert tp.grad is None, f"param {name}: tpu has a grad, CPU has none"
            continue
        assert tp.grad is not None, f"param {name}: no grad on tpu"
        assert_close_cpu(tp.grad, cp.grad, f"grad of param {name}", **grad_tol)
    for i, (ci, ti) in enumerate(zip(cpu_in, tpu_in)):
        if isinstance(ci, torch.Tensor) and ci.requires_grad:
            assert ti.grad is not None, f"input {i}: no grad on tpu"
            assert_close_cpu(ti.grad, ci.grad, f"grad of input {i}", **grad_tol)
    return cpu_out, tpu_out


def randn(*shape, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(requires_grad)


class _Fn(nn.Module):
    """A parameterless module wrapping a functional, so check_module can drive it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


# ----------------------------------------------------------------------------- layers


@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias):
    torch.manual_seed(0)
    check_module(nn.Linear(16, 8, bias=bias), randn(4, 3, 16))


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(stride=2, padding=1),
        dict(padding="same", dilation=2),
        dict(groups=2, padding=1, bias=False),
    ],
)
def test_conv1d(cfg):
    torch.manual_seed(0)
    check_module(nn.Conv1d(4, 6, 3, **cfg), randn(2, 4, 11))


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(stride=2, padding=1),
        dict(padding=(1, 2), dilation=(2, 1)),
        dict(groups=2, padding=1, bias=False),
        dict(padding=1, padding_mode="reflect"),
    ],
)
def test_conv2d(cfg):
    torch.manual_seed(0)
    check_module(nn.Conv2d(4, 6, 3, **cfg), randn(2, 4, 9, 8))


def test_conv2d_depthwise():
    torch.manual_seed(0)
    check_module(nn.Conv2d(4, 4, 3, groups=4, padding=1), randn(2, 4, 7, 7))


def test_conv_transpose2d():
    torch.manual_seed(0)
    check_module(nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1), randn(2, 4, 5, 5))


@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm2d_train(affine):
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(5, affine=affine, momentum=0.3)
    cpu_bn = bn
    tpu_bn = copy.deepcopy(bn).to(DEV)
    # Several training steps: running stats must evolve identically.
    for step in range(3):
        x = randn(4, 5, 6, 6, seed=step) * (step + 1) + step
        xc, xt = _leaf_copy(x, "cpu"), _leaf_copy(x, DEV)
        yc, yt = cpu_bn(xc), tpu_bn(xt)
        assert_close_cpu(yt, yc, f"step {step} output")
        w = randn(*yc.shape, seed=100 + step, requires_grad=False)
        (yc * w).sum().backward()
        (yt * w.to(DEV)).sum().backward()
        assert_close_cpu(xt.grad, xc.grad, f"step {step} input grad")
        assert_close_cpu(tpu_bn.running_mean, cpu_bn.running_mean, f"step {step} running_mean")
        assert_close_cpu(tpu_bn.running_var, cpu_bn.running_var, f"step {step} running_var")
        assert int(tpu_bn.num_batches_tracked.cpu()) == int(cpu_bn.num_batches_tracked) == step + 1
    if affine:
        assert_close_cpu(tpu_bn.weight.grad, cpu_bn.weight.grad, "weight grad")
        assert_close_cpu(tpu_bn.bias.grad, cpu_bn.bias.grad, "bias grad")


def test_batchnorm2d_eval():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(5)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(5))
        bn.running_var.copy_(torch.rand(5) + 0.5)
        bn.weight.copy_(torch.randn(5))
        bn.bias.copy_(torch.randn(5))
    bn.eval()
    check_module(bn, randn(3, 5, 4, 4))


def test_batchnorm2d_momentum_none():
    torch.manual_seed(0)
    check_module(nn.BatchNorm2d(3, momentum=None), randn(4, 3, 5, 5))


def test_batchnorm1d():
    torch.manual_seed(0)
    check_module(nn.BatchNorm1d(6), randn(8, 6))


@pytest.mark.parametrize("shape", [(8,), (4, 8)])
def test_layernorm(shape):
    torch.manual_seed(0)
    ln = nn.LayerNorm(shape)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    check_module(ln, randn(3, 5, *shape))


def test_layernorm_no_affine():
    check_module(nn.LayerNorm(8, elementwise_affine=False), randn(3, 5, 8))


@pytest.mark.parametrize("eps", [None, 1e-5])
def test_rmsnorm(eps):
    torch.manual_seed(0)
    rms = nn.RMSNorm(8, eps=eps)
    with torch.no_grad():
        rms.weight.normal_()
    check_module(rms, randn(3, 5, 8))


def test_group_norm():
    torch.manual_seed(0)
    check_module(nn.GroupNorm(2, 6), randn(3, 6, 4, 4))


def test_embedding():
    torch.manual_seed(0)
    idx = torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9], [1, 1, 1, 0]])
    check_module(nn.Embedding(10, 6), idx)


def test_embedding_padding_idx():
    torch.manual_seed(0)
    idx = torch.tensor([[1, 0, 4, 5], [0, 3, 2, 9]])
    _, tpu_out = check_module(nn.Embedding(10, 6, padding_idx=0), idx)


def test_dropout_eval_is_identity():
    d = nn.Dropout(0.5).eval()
    x = randn(4, 5)
    check_module(d, x)


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention(batch_first, need_weights):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, dropout=0.0, batch_first=batch_first)
    shape = (2, 5, 16) if batch_first else (5, 2, 16)
    q, k, v = randn(*shape, seed=1), randn(*shape, seed=2), randn(*shape, seed=3)
    check_module(mha, q, k, v, kwargs=dict(need_weights=need_weights))


def test_multihead_attention_masks():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, dropout=0.0, batch_first=True)
    x = randn(2, 6, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    check_module(
        mha,
        x,
        kwargs=dict(attn_mask=causal, key_padding_mask=pad, need_weights=True, average_attn_weights=False),
        forward_fn=lambda m, x, **kw: m(x, x, x, **kw),
    )


def test_multihead_attention_kdim_vdim():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, kdim=8, vdim=12, batch_first=True)
    check_module(mha, randn(2, 5, 16, seed=1), randn(2, 7, 8, seed=2), randn(2, 7, 12, seed=3))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_encoder_layer(norm_first, activation):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        16, 4, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=norm_first, activation=activation
    )
    check_module(layer, randn(2, 6, 16), grad_tol=dict(rtol=1e-4, atol=1e-4))


def test_transformer_encoder_layer_masks():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    pad = torch.tensor([[False] * 6, [False] * 5 + [True]])
    check_module(
        layer,
        randn(2, 6, 16),
        kwargs=dict(src_mask=mask, src_key_padding_mask=pad),
        grad_tol=dict(rtol=1e-4, atol=1e-4),
    )


def test_transformer_encoder_layer_inference_fast_path():
    """eval + no_grad: PyTorch takes the fused encoder-layer path on supported devices."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True).eval()
    tpu_layer = copy.deepcopy(layer).to(DEV)
    x = randn(2, 6, 16, requires_grad=False)
    with torch.no_grad():
        expected = layer(x)
        actual = tpu_layer(x.to(DEV))
    assert_close_cpu(actual, expected, "fast path output")


def test_multihead_attention_inference_fast_path():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    tpu_mha = copy.deepcopy(mha).to(DEV)
    x = randn(2, 6, 16, requires_grad=False)
    with torch.no_grad():
        expected, _ = mha(x, x, x, need_weights=False)
        actual, _ = tpu_mha(x.to(DEV), x.to(DEV), x.to(DEV), need_weights=False)
    assert_close_cpu(actual, expected, "fast path output")


# ----------------------------------------------------------------------------- recurrent


@pytest.mark.parametrize(
    "cfg",
    [
        dict(num_layers=1, batch_first=True),
        dict(num_layers=2, batch_first=False),
        dict(num_layers=1, batch_first=True, bidirectional=True),
        dict(num_layers=1, batch_first=True, proj_size=3),
    ],
)
def test_lstm(cfg):
    torch.manual_seed(0)
    lstm = nn.LSTM(5, 6, **cfg)
    x = randn(2, 4, 5) if cfg.get("batch_first") else randn(4, 2, 5)
    check_module(lstm, x)


def test_lstm_initial_state():
    torch.manual_seed(0)
    lstm = nn.LSTM(5, 6, num_layers=2, batch_first=True)
    x = randn(2, 4, 5)
    h0, c0 = randn(2, 2, 6, seed=1), randn(2, 2, 6, seed=2)
    check_module(lstm, x, h0, c0, forward_fn=lambda m, x, h, c: m(x, (h, c)))


@pytest.mark.parametrize(
    "cfg",
    [
        dict(num_layers=1, batch_first=True),
        dict(num_layers=2, batch_first=False, bidirectional=True),
    ],
)
def test_gru(cfg):
    torch.manual_seed(0)
    gru = nn.GRU(5, 6, **cfg)
    x = randn(2, 4, 5) if cfg.get("batch_first") else randn(4, 2, 5)
    check_module(gru, x)


def test_rnn_tanh():
    torch.manual_seed(0)
    check_module(nn.RNN(5, 6, batch_first=True), randn(2, 4, 5))


def test_lstm_cell():
    torch.manual_seed(0)
    check_module(nn.LSTMCell(5, 6), randn(3, 5))


# ----------------------------------------------------------------------------- scaled_dot_product_attention


def _sdpa(**kw):
    return _Fn(lambda q, k, v, **k2: F.scaled_dot_product_attention(q, k, v, **kw, **k2))


def _qkv(b=2, h=4, hkv=None, lq=5, lk=7, e=8, ev=None):
    hkv = hkv or h
    return randn(b, h, lq, e, seed=1), randn(b, hkv, lk, e, seed=2), randn(b, hkv, lk, ev or e, seed=3)


def test_sdpa_plain():
    check_module(_sdpa(), *_qkv())


def test_sdpa_causal():
    check_module(_sdpa(is_causal=True), *_qkv(lq=6, lk=6))


def test_sdpa_causal_rectangular():
    # PyTorch's causal mask is top-left aligned (tril of an lq x lk ones matrix).
    check_module(_sdpa(is_causal=True), *_qkv(lq=4, lk=7))


def test_sdpa_bool_mask():
    q, k, v = _qkv()
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(5)) > 0.3
    mask[..., 0] = True  # no fully masked rows
    check_module(_sdpa(), q, k, v, kwargs=dict(attn_mask=mask))


def test_sdpa_float_mask():
    q, k, v = _qkv()
    mask = randn(5, 7, seed=6, requires_grad=False)
    check_module(_sdpa(), q, k, v, kwargs=dict(attn_mask=mask))


def test_sdpa_float_mask_grad():
    q, k, v = _qkv()
    mask = randn(1, 4, 5, 7, seed=6)
    check_module(_sdpa(), q, k, v, mask, forward_fn=lambda m, q, k, v, mask: m(q, k, v, attn_mask=mask))


def test_sdpa_scale_and_value_dim():
    check_module(_sdpa(scale=0.3), *_qkv(ev=6))


def test_sdpa_gqa():
    check_module(_sdpa(enable_gqa=True), *_qkv(h=8, hkv=2))


def test_sdpa_gqa_causal():
    check_module(_sdpa(enable_gqa=True, is_causal=True), *_qkv(h=4, hkv=2, lq=6, lk=6))


def test_sdpa_3d():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 5, 8, generator=g).requires_grad_() for _ in range(3))
    check_module(_sdpa(), q, k, v)


# ----------------------------------------------------------------------------- cross_entropy and friends


def _ce(**kw):
    return _Fn(lambda x, t: F.cross_entropy(x, t, **kw))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(reduction):
    t = torch.tensor([1, 0, 4, 2, 3, 3])
    check_module(_ce(reduction=reduction), randn(6, 5), t)


def test_cross_entropy_ignore_index():
    t = torch.tensor([1, -100, 4, 2, -100, 3])
    check_module(_ce(), randn(6, 5), t)
    t2 = torch.tensor([1, 2, 4, 2, 2, 3])
    check_module(_ce(ignore_index=2), randn(6, 5), t2)


def test_cross_entropy_label_smoothing():
    t = torch.tensor([1, 0, 4, 2, 3, 3])
    check_module(_ce(label_smoothing=0.1), randn(6, 5), t)
    t2 = torch.tensor([1, -100, 4, 2, 3, -100])
    check_module(_ce(label_smoothing=0.2), randn(6, 5), t2)


def test_cross_entropy_weight():
    t = torch.tensor([1, 0, 4, 2, 3, 3])
    w = torch.tensor([1.0, 2.0, 0.5, 1.5, 3.0])
    check_module(_Fn(lambda x, t, w: F.cross_entropy(x, t, weight=w)), randn(6, 5), t, w)


def test_cross_entropy_probability_targets():
    probs = torch.softmax(randn(6, 5, seed=3, requires_grad=False), -1)
    check_module(_ce(), randn(6, 5), probs)
    check_module(_ce(label_smoothing=0.1), randn(6, 5), probs)


def test_cross_entropy_spatial():
    t = torch.randint(0, 4, (2, 3, 3), generator=torch.Generator().manual_seed(0))
    check_module(_ce(), randn(2, 4, 3, 3), t)


def test_cross_entropy_3d_sequence():
    # (batch, classes, seq) as language models flatten it
    logits = randn(2, 7, 11)
    t = torch.randint(0, 11, (14,), generator=torch.Generator().manual_seed(0))
    check_module(_Fn(lambda x, t: F.cross_entropy(x.reshape(-1, 11), t)), logits, t)


def test_nll_and_mse_and_bce():
    t = torch.tensor([1, 0, 4, 2])
    check_module(_Fn(lambda x, t: F.nll_loss(F.log_softmax(x, -1), t)), randn(4, 5), t)
    check_module(_Fn(F.mse_loss), randn(4, 5, seed=1), randn(4, 5, seed=2, requires_grad=False))
    tgt = torch.rand(4, 5, generator=torch.Generator().manual_seed(3))
    check_module(_Fn(F.binary_cross_entropy_with_logits), randn(4, 5), tgt)
