"""Loss functions (+ backward). `reduction`: 0 none, 1 mean, 2 sum (at::Reduction)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..registry import aten, lower

_LOW = (jnp.bfloat16, jnp.float16)


def _acc(x):
    return x.astype(jnp.float32) if x.dtype in _LOW else x


def _reduce(loss, reduction):
    if reduction == 1:
        return jnp.mean(loss)
    if reduction == 2:
        return jnp.sum(loss)
    return loss


def _vjp_backward(forward, grad_output, self, *rest):
    _, vjp = jax.vjp(lambda x: forward(x, *rest), self)
    return vjp(grad_output.astype(self.dtype))[0]


# ----------------------------------------------------------------------------- NLL


def _nll(self, target, weight, reduction, ignore_index):
    x = _acc(self)
    cdim = 0 if x.ndim == 1 else 1
    t = target.astype(jnp.int32)
    ignored = t == ignore_index
    safe = jnp.where(ignored, 0, t)
    picked = jnp.take_along_axis(x, jnp.expand_dims(safe, cdim), axis=cdim)
    picked = jnp.squeeze(picked, cdim)
    if weight is not None:
        w = jnp.take(_acc(weight), safe)
    else:
        w = jnp.ones(safe.shape, x.dtype)
    w = jnp.where(ignored, jnp.zeros((), x.dtype), w)
    loss = -picked * w
    total = jnp.sum(w)
    if reduction == 0:
        return loss.astype(self.dtype), total.astype(self.dtype)
    s = jnp.sum(loss)
    if reduction == 1:
        s = s / total
    return s.astype(self.dtype), total.astype(self.dtype)


@lower(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    return _nll(self, target, weight, reduction, ignore_index)


@lower(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    x = _acc(self)
    cdim = 0 if x.ndim == 1 else 1
    t = target.astype(jnp.int32)
    ignored = t == ignore_index
    safe = jnp.where(ignored, 0, t)
    if weight is not None:
        w = jnp.take(_acc(weight), safe)
    else:
        w = jnp.ones(safe.shape, x.dtype)
    w = jnp.where(ignored, jnp.zeros((), x.dtype), w)
    g = _acc(grad_output)
    if reduction == 1:
        g = g / _acc(total_weight)
    coeff = -w * g  # broadcast: g is scalar unless reduction none
    classes = jnp.arange(x.shape[cdim], dtype=jnp.int32).reshape((x.shape[cdim],) + (1,) * (x.ndim - cdim - 1))
    onehot = jnp.expand_dims(safe, cdim) == classes
    gi = jnp.where(onehot, jnp.expand_dims(coeff, cdim), jnp.zeros((), x.dtype))
    return gi.astype(self.dtype)


@lower(aten.nll_loss.default, aten.nll_loss_nd.default, aten.nll_loss2d.default)
def nll_loss(self, target, weight=None, reduction=1, ignore_index=-100):
    return _nll(self, target, weight, reduction, ignore_index)[0]


# ----------------------------------------------------------------------------- BCE


def _bce(self, target, weight, reduction):
    x = _acc(self)
    t = _acc(target)
    logx = jnp.maximum(jnp.log(x), -100.0)
    log1mx = jnp.maximum(jnp.log1p(-x), -100.0)
    loss = (t - 1) * log1mx - t * logx
    if weight is not None:
        loss = loss * _acc(weight)
    return _reduce(loss, reduction).astype(self.dtype)


@lower(aten.binary_cross_entropy.default)
def binary_cross_entropy(self, target, weight=None, reduction=1):
    return _bce(self, target, weight, reduction)


@lower(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=1):
    # PyTorch: grad * (x - t) / max((1 - x) * x, EPSILON), EPSILON = 1e-12
    x = _acc(self)
    t = _acc(target)
    g = _acc(grad_output)
    gi = g * (x - t) / jnp.maximum((1 - x) * x, 1e-12)
    if weight is not None:
        gi = gi * _acc(weight)
    if reduction == 1:
        gi = gi / x.size
    return jnp.broadcast_to(gi, x.shape).astype(self.dtype)


def _bce_logits(self, target, weight, pos_weight, reduction):
    x = _acc(self)
    t = _acc(target)
    if pos_weight is not None:
        lw = (_acc(pos_weight) - 1) * t + 1
        loss = (1 - t) * x + lw * (jnp.log1p(jnp.exp(-jnp.abs(x))) + jnp.maximum(-x, 0))
    else:
        loss = (1 - t) * x + jnp.maximum(-x, 0) + jnp.log1p(jnp.exp(-jnp.abs(x)))
    if weight is not None:
        loss = loss * _acc(weight)
    return _reduce(loss, reduction).astype(self.dtype)


@lower(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(self, target, weight=None, pos_weight=None, reduction=1):
    return _bce_logits(self, target, weight, pos_weight, reduction)


# ----------------------------------------------------------------------------- regression losses


def _elementwise_loss_grad(dloss, grad_output, reduction, self):
    """The gradient with respect to `self` of a loss of elementwise terms, from `dloss`, each
    term's derivative (shaped like the broadcast of self and target): times the incoming
    gradient, divided by the number of terms for a mean, at self's dtype."""
    g = dloss * _acc(grad_output)
    if reduction == 1:
        g = g / dloss.size
    return jnp.broadcast_to(g, dloss.shape).astype(self.dtype)


def _mse(self, target, reduction):
    d = _acc(self) - _acc(target)
    return _reduce(d * d, reduction).astype(jnp.result_type(self, target))


@lower(aten.mse_loss.default)
def mse_loss(self, target, reduction=1):
    return _mse(self, target, reduction)


@lower(aten.mse_loss_backward.default)
def mse_loss_backward(grad_output, self, target, reduction):
    d = _acc(self) - _acc(target)
    return _elementwise_loss_grad(2 * d, grad_output, reduction, self)


@lower(aten.smooth_l1_loss.default)
def smooth_l1_loss(self, target, reduction=1, beta=1.0):
    d = jnp.abs(_acc(self) - _acc(target))
    if beta == 0:
        loss = d
    else:
        loss = jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)
    return _reduce(loss, reduction).astype(jnp.result_type(self, target))


@lower(aten.smooth_l1_loss_backward.default)
def smooth_l1_loss_backward(grad_output, self, target, reduction, beta):
    x = _acc(self)
    d = x - _acc(target)
    if beta == 0:
        g = jnp.sign(d)
    else:
        g = jnp.where(d <= -beta, -1.0, jnp.where(d >= beta, 1.0, d / beta)).astype(x.dtype)
    return _elementwise_loss_grad(g, grad_output, reduction, self)


@lower(aten.huber_loss.default)
def huber_loss(self, target, reduction=1, delta=1.0):
    d = jnp.abs(_acc(self) - _acc(target))
    loss = jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))
    return _reduce(loss, reduction).astype(jnp.result_type(self, target))


@lower(aten.huber_loss_backward.default)
def huber_loss_backward(grad_output, self, target, reduction, delta):
    x = _acc(self)
    d = x - _acc(target)
    g = jnp.where(d <= -delta, -delta, jnp.where(d >= delta, delta, d)).astype(x.dtype)
    return _elementwise_loss_grad(g, grad_output, reduction, self)


def _soft_margin(self, target, reduction):
    loss = jnp.log1p(jnp.exp(-_acc(target) * _acc(self)))
    return _reduce(loss, reduction).astype(self.dtype)


@lower(aten.soft_margin_loss.default)
def soft_margin_loss(self, target, reduction=1):
    return _soft_margin(self, target, reduction)


@lower(aten.soft_margin_loss_backward.default)
def soft_margin_loss_backward(grad_output, self, target, reduction):
    x = _acc(self)
    t = _acc(target)
    z = jnp.exp(-t * x)
    g = -t * z / (1 + z) * _acc(grad_output)
    if reduction == 1:
        g = g / x.size
    return jnp.broadcast_to(g, x.shape).astype(self.dtype)


# ----------------------------------------------------------------------------- margin losses


def _multi_margin(self, target, p, margin, weight, reduction):
    x = _acc(self)
    # PyTorch's meta kernel (which the dispatcher follows) gives shape (1,) for unbatched input
    if x.ndim <= 1:
        x = x.reshape(1, -1)
        target = target.reshape(1)
    t = target.astype(jnp.int32)
    xt = jnp.take_along_axis(x, t[:, None], axis=1)
    z = jnp.maximum(margin - xt + x, 0)
    if p == 2:
        z = z * z
    if weight is not None:
        z = z * jnp.take(_acc(weight), t)[:, None]
    z = jnp.where(jnp.arange(x.shape[1])[None, :] == t[:, None], 0, z)
    loss = jnp.sum(z, axis=1) / x.shape[1]
    return _reduce(loss, reduction).astype(self.dtype)


@lower(aten.multi_margin_loss.default, static=("p", "margin"))
def multi_margin_loss(self, target, p=1, margin=1, weight=None, reduction=1):
    return _multi_margin(self, target, p, margin, weight, reduction)


@lower(aten.multi_margin_loss_backward.default, static=("p", "margin"))
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None, reduction=1):
    return _vjp_backward(lambda x: _multi_margin(x, target, p, margin, weight, reduction), grad_output, self)


def _multilabel_margin(self, target, reduction):
    x = _acc(self)
    orig_shape = x.shape
    squeeze = x.ndim <= 1
    if squeeze:
        x = x.reshape(1, -1)
        target = target.reshape(1, -1)
    t = target.astype(jnp.int32)
    n, c = x.shape
    # valid targets: those before the first -1
    valid = jnp.cumprod(t >= 0, axis=1).astype(bool)
    safe = jnp.where(valid, t, 0)
    is_target = jnp.zeros((n, c), bool).at[jnp.arange(n)[:, None], safe].max(valid)
    xt = jnp.take_along_axis(x, safe, axis=1)  # (n, c) target scores
    z = jnp.maximum(1 - xt[:, :, None] + x[:, None, :], 0)  # (n, j, i)
    z = jnp.where(valid[:, :, None] & ~is_target[:, None, :], z, 0)
    loss = jnp.sum(z, axis=(1, 2)) / c
    if squeeze:  # loss stays (1,) for unbatched input, as PyTorch's meta kernel says
        is_target = is_target.reshape(orig_shape)
    return _reduce(loss, reduction).astype(self.dtype), is_target


@lower(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(self, target, reduction):
    loss, is_target = _multilabel_margin(self, target, reduction)
    return loss, is_target.astype(target.dtype)


@lower(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    return _vjp_backward(lambda x: _multilabel_margin(x, target, reduction)[0], grad_output, self)


# ----------------------------------------------------------------------------- CTC


def _ctc_targets(targets, target_lengths, n):
    """Padded (N, S_max) targets from either layout PyTorch accepts."""
    import numpy as np

    lengths = [int(v) for v in target_lengths]
    smax = max(lengths) if lengths else 0
    if targets.ndim == 2:
        return targets[:, : max(smax, 1)].astype(jnp.int32), lengths, smax
    offs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    idx = offs[:, None] + np.arange(max(smax, 1))[None, :]
    idx = np.minimum(idx, max(targets.shape[0] - 1, 0))
    return jnp.take(targets, jnp.asarray(idx)).astype(jnp.int32), lengths, smax


def _lse(*xs):
    x = jnp.stack(xs)
    m = jnp.max(x, axis=0)
    ms = jnp.where(jnp.isfinite(m), m, 0)
    s = jnp.sum(jnp.exp(x - ms), axis=0)
    return jnp.where(jnp.isfinite(m), ms + jnp.log(jnp.where(jnp.isfinite(m), s, 1)), m)


def _ctc_forward(log_probs, targets, input_lengths, target_lengths, blank):
    lp = log_probs.astype(jnp.float32) if log_probs.dtype in _LOW else log_probs
    T, N, C = lp.shape
    tg, tl, smax = _ctc_targets(targets, target_lengths, N)
    S = 2 * smax + 1
    s_idx = jnp.arange(S)
    lab = jnp.where(
        s_idx[None, :] % 2 == 1,
        jnp.take_along_axis(tg, jnp.clip((s_idx[None, :] - 1) // 2, 0, tg.shape[1] - 1), axis=1),
        blank,
    )
    lab = jnp.broadcast_to(lab, (N, S))
    prev2 = jnp.concatenate([jnp.full((N, 2), -1, jnp.int32), lab[:, :-2]], axis=1)
    can_skip = (lab != blank) & (lab != prev2) & (s_idx[None, :] >= 2)
    tlen = jnp.asarray(tl, jnp.int32)
    valid_s = s_idx[None, :] < (2 * tlen[:, None] + 1)
    ninf = jnp.asarray(-jnp.inf, lp.dtype)
    emit = jnp.take_along_axis(lp, jnp.broadcast_to(lab[None], (T, N, S)), axis=2)  # (T, N, S)
    a0 = jnp.where((s_idx[None, :] < 2) & valid_s, emit[0], ninf)
    ilen = jnp.asarray([int(v) for v in input_lengths], jnp.int32)

    def step(a, xs):
        t, e = xs
        a1 = jnp.concatenate([jnp.full((N, 1), ninf), a[:, :-1]], axis=1)
        a2 = jnp.concatenate([jnp.full((N, 2), ninf), a[:, :-2]], axis=1)
        a2 = jnp.where(can_skip, a2, ninf)
        new = jnp.where(valid_s, _lse(a, a1, a2) + e, ninf)
        new = jnp.where((t < ilen)[:, None], new, a)  # past the input length: carry
        return new, new

    if T > 1:
        last, rest = lax.scan(step, a0, (jnp.arange(1, T), emit[1:]))
        log_alpha = jnp.concatenate([a0[None], rest], axis=0)
    else:
        last = a0
        log_alpha = a0[None]
    end = 2 * tlen
    l_end = jnp.take_along_axis(last, end[:, None], axis=1)[:, 0]
    l_end1 = jnp.where(tlen > 0, jnp.take_along_axis(last, jnp.maximum(end - 1, 0)[:, None], axis=1)[:, 0], ninf)
    nll = -_lse(l_end, l_end1)
    t_idx = jnp.arange(T)[:, None, None]
    log_alpha = jnp.where(t_idx < ilen[None, :, None], log_alpha, ninf)
    return nll, jnp.transpose(log_alpha, (1, 0, 2))


@lower(aten._ctc_loss.default)
def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    if not isinstance(input_lengths, (list, tuple)):
        raise NotImplementedError("torchtpu: ctc_loss needs input_lengths/target_lengths as Python ints or CPU tensors")
    nll, log_alpha = _ctc_forward(log_probs, targets, input_lengths, target_lengths, blank)
    if zero_infinity:
        nll = jnp.where(jnp.isinf(nll), 0, nll)
    return nll.astype(log_probs.dtype), log_alpha.astype(log_probs.dtype)


@lower(aten._ctc_loss_backward.default)
def _ctc_loss_backward(
    grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank, zero_infinity=False
):
    # PyTorch's CTC gradient is taken w.r.t. the logits of a log_softmax: exp(lp) - posterior.
    lp = log_probs.astype(jnp.float32) if log_probs.dtype in _LOW else log_probs
    nll_fn = lambda x: jnp.sum(_ctc_forward(x, targets, input_lengths, target_lengths, blank)[0])  # noqa: E731
    dnll = jax.grad(nll_fn)(lp)  # = -posterior
    nll = _ctc_forward(lp, targets, input_lengths, target_lengths, blank)[0]
    g = (jnp.exp(lp) + dnll) * grad.astype(lp.dtype)[None, :, None]
    T = lp.shape[0]
    ilen = jnp.asarray([int(v) for v in input_lengths], jnp.int32)
    g = jnp.where(jnp.arange(T)[:, None, None] < ilen[None, :, None], g, 0)
    if zero_infinity:
        g = jnp.where(jnp.isinf(nll)[None, :, None], 0, g)
    return g.astype(log_probs.dtype)


def _install_ctc_tensor_lengths():
    """ctc_loss with tensor lengths: the lengths decide shapes, so read them to the host."""
    import torch

    from .. import registry as D

    def lengths(v):
        if isinstance(v, torch.Tensor):
            return [int(i) for i in D.to_cpu(v).reshape(-1).tolist()]
        return v

    @D.custom(aten._ctc_loss.Tensor)
    def _ctc_loss_tensor(args, kwargs):
        args = list(args)
        args[2], args[3] = lengths(args[2]), lengths(args[3])
        return D.dispatch(aten._ctc_loss.default, args, kwargs)

    @D.custom(aten._ctc_loss_backward.Tensor)
    def _ctc_loss_backward_tensor(args, kwargs):
        args = list(args)
        args[3], args[4] = lengths(args[3]), lengths(args[4])
        return D.dispatch(aten._ctc_loss_backward.default, args, kwargs)


_install_ctc_tensor_lengths()
