"""Elementwise ops. Inputs are promoted the way PyTorch promotes them before computing.

Type promotion follows `torch.result_type`: operands fall in three priority groups
(tensors with dimensions, zero-dim tensors, Python scalars, which arrive here as weakly
typed JAX scalars or plain Python numbers) and a lower group only wins when it is of a
higher category (bool < integer < floating < complex). Float16/bfloat16 inputs compute
in float32 like PyTorch's CPU kernels; the dispatcher casts outputs back to the dtype
PyTorch's meta kernel reports.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
import torch
from jax import lax

from .. import dtypes
from ..registry import aten, lower

prims = torch.ops.prims

# ----------------------------------------------------------------------------- promotion


def _is_weak(x) -> bool:
    """Whether `x` is a weakly-typed JAX value: a Python number the executor traced (execute._scalar_array)."""
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return bool(getattr(jax.typeof(x), "weak_type", False))
    return False


def _default_float():
    return torch.get_default_dtype()


def _default_complex():
    return torch.complex128 if torch.get_default_dtype() == torch.float64 else torch.complex64


def _tdtype(x) -> torch.dtype:
    return dtypes.to_torch_dtype(x.dtype)


def _operand(x):
    """(group, torch dtype): group 0 = dimensioned tensor, 1 = zero-dim tensor, 2 = scalar."""
    if isinstance(x, bool):
        return 2, torch.bool
    if isinstance(x, int):
        return 2, torch.int64
    if isinstance(x, float):
        return 2, _default_float()
    if isinstance(x, complex):
        return 2, _default_complex()
    dt = _tdtype(x)
    if _is_weak(x):
        if dt.is_complex:
            return 2, _default_complex()
        if dt.is_floating_point:
            return 2, _default_float()
        return 2, (torch.bool if dt == torch.bool else torch.int64)
    return (0 if np.ndim(x) else 1), dt


def _to_complex(dt):
    return {torch.float64: torch.complex128, torch.float16: torch.complex32}.get(dt, torch.complex64)


def _combine(higher, lower_):
    if higher is None:
        return lower_
    if lower_ is None:
        return higher
    if higher.is_complex:
        return higher
    if lower_.is_complex:
        return _to_complex(higher) if higher.is_floating_point else lower_
    if higher.is_floating_point:
        return higher
    if higher == torch.bool or lower_.is_floating_point:
        return torch.promote_types(higher, lower_)
    return higher


def result_type(*xs) -> torch.dtype:
    groups = [None, None, None]
    for x in xs:
        if x is None:
            continue
        g, dt = _operand(x)
        groups[g] = dt if groups[g] is None else torch.promote_types(groups[g], dt)
    return _combine(groups[0], _combine(groups[1], groups[2]))


def _is_float(dt):
    return dt.is_floating_point


def _is_int(dt):
    return not dt.is_floating_point and not dt.is_complex and dt != torch.bool


def _int_to_float(dt):
    return dt if (dt.is_floating_point or dt.is_complex) else _default_float()


def _opmath(dt):
    if dt in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.float32
    if dt == torch.complex32:
        return torch.complex64
    return dt


def _j(dt):
    return dtypes.to_jax_dtype(dt)


def cast(x, dt):
    """x (array or Python number) as a JAX array of torch dtype dt."""
    jdt = _j(dt)
    if isinstance(x, (bool, int, float, complex)):
        if dt == torch.bool:
            return jnp.asarray(bool(x))
        if not dt.is_complex and isinstance(x, complex):
            x = x.real
        return jnp.asarray(x, jdt)
    x = jnp.asarray(x)
    if x.dtype != jdt:
        if jdt == jnp.bool_:
            return x != 0
        if x.dtype.kind == "c" and jnp.dtype(jdt).kind != "c":
            x = jnp.real(x)
        return x.astype(jdt)
    return x


def promote(*xs, float_=False, opmath=True, scalars_in_opmath=False):
    """Cast operands to PyTorch's common dtype (floating if float_); returns (arrays, dtype).

    With `scalars_in_opmath`, a Python number operand of a half-precision op is cast straight to
    the op's computation type (float32), as PyTorch's multiply and divide kernels read one:
    `half_tensor * 2**40` is 0 where the tensor is 0, not 0 * inf."""
    dt = result_type(*xs)
    if float_:
        dt = _int_to_float(dt)
    cdt = _opmath(dt) if opmath else dt
    if cdt == dt:
        return [None if x is None else cast(x, dt) for x in xs], dt

    def widened(x):
        if scalars_in_opmath and _operand(x)[0] == 2:
            return cast(x, cdt)
        # convert to the common dtype first (an int32 operand of a half op rounds to half), then widen
        return cast(x, dt).astype(_j(cdt))

    return [None if x is None else widened(x) for x in xs], dt


def _is_number(x):
    return isinstance(x, (bool, int, float, complex))


# ----------------------------------------------------------------------------- registration helpers


def _functional_overloads(packet):
    """The non-mutating overloads of a packet (out= and in-place variants are derived by the dispatcher)."""
    return [getattr(packet, o) for o in packet.overloads() if not getattr(packet, o)._schema.is_mutable]


def _unary(fn, *names, prim_names=(), **promotion):
    """Register fn(x) for the functional overloads of aten.<names> and for prims.<prim_names>,
    after promoting the operand (promote's keyword `promotion`)."""

    def low(self):
        (x,), _ = promote(self, **promotion)
        return fn(x)

    ops = [op for n in names if hasattr(aten, n) for op in _functional_overloads(getattr(aten, n))]
    ops += [getattr(prims, n).default for n in prim_names if hasattr(prims, n)]
    lower(*ops)(low)
    return low


def _float_unary(fn, *names, prim_names=()):
    return _unary(fn, *names, prim_names=prim_names, float_=True)


def _binary(fn, *ops, **promotion):
    """Register fn(a, b) for `ops`, after promoting both operands (promote's keyword `promotion`)."""

    def low(self, other):
        (a, b), _ = promote(self, other, **promotion)
        return fn(a, b)

    lower(*ops)(low)
    return low


_float_unary(jnp.exp, "exp", prim_names=["exp"])
_float_unary(jnp.exp2, "exp2", "special_exp2", prim_names=["exp2"])
_float_unary(jnp.expm1, "expm1", "special_expm1", prim_names=["expm1"])
_float_unary(jnp.log, "log", prim_names=["log"])
_float_unary(jnp.log2, "log2", prim_names=["log2"])
_float_unary(jnp.log10, "log10", prim_names=["log10"])
_float_unary(jnp.log1p, "log1p", "special_log1p", prim_names=["log1p"])
_float_unary(jnp.sqrt, "sqrt", prim_names=["sqrt"])
_float_unary(lax.rsqrt, "rsqrt", prim_names=["rsqrt"])
_float_unary(jnp.cbrt, prim_names=["cbrt"])
_float_unary(lambda x: 1 / x, "reciprocal", prim_names=["reciprocal"])
_float_unary(jnp.sin, "sin", prim_names=["sin"])
_float_unary(jnp.cos, "cos", prim_names=["cos"])
_float_unary(jnp.tan, "tan", prim_names=["tan"])
_float_unary(jnp.arcsin, "asin", "arcsin", prim_names=["asin"])
_float_unary(jnp.arccos, "acos", "arccos", prim_names=["acos"])
_float_unary(jnp.arctan, "atan", "arctan", prim_names=["atan"])
_float_unary(jnp.sinh, "sinh", prim_names=["sinh"])
_float_unary(jnp.cosh, "cosh", prim_names=["cosh"])
_float_unary(jnp.tanh, "tanh", prim_names=["tanh"])
_float_unary(jnp.arcsinh, "asinh", "arcsinh", prim_names=["asinh"])
_float_unary(jnp.arccosh, "acosh", "arccosh", prim_names=["acosh"])
_float_unary(jnp.arctanh, "atanh", "arctanh", prim_names=["atanh"])
_float_unary(jss.erf, "erf", "special_erf", prim_names=["erf"])
_float_unary(jss.erfc, "erfc", "special_erfc", prim_names=["erfc"])
_float_unary(jss.erfinv, "erfinv", "special_erfinv", prim_names=["erf_inv"])
_float_unary(jss.gammaln, "lgamma", "special_gammaln", prim_names=["lgamma"])
_float_unary(jss.i0, "i0", "special_i0", "special_modified_bessel_i0", prim_names=["bessel_i0"])
_float_unary(jss.i0e, "special_i0e", prim_names=["bessel_i0e"])
_float_unary(jss.i1, "special_i1", "special_modified_bessel_i1", prim_names=["bessel_i1"])
_float_unary(jss.i1e, "special_i1e", prim_names=["bessel_i1e"])
_float_unary(jss.ndtri, "special_ndtri", prim_names=["ndtri"])
_float_unary(jss.ndtr, "special_ndtr")
_float_unary(jss.log_ndtr, "special_log_ndtr")
_float_unary(jax.nn.sigmoid, "sigmoid", "special_expit")
_float_unary(lambda x: x * (math.pi / 180), "deg2rad")
_float_unary(lambda x: x * (180 / math.pi), "rad2deg")


def _erfcx(x):
    # exp(x^2) erfc(x), stable for large x through the continued-fraction-free asymptotic form.
    big = x > 25.0
    xs = jnp.where(big, 0.0, x)
    small = jnp.exp(xs * xs) * jss.erfc(xs)
    xb = jnp.where(big, x, 30.0)
    inv2 = 1.0 / (xb * xb)
    asym = (1.0 / (xb * math.sqrt(math.pi))) * (1 - 0.5 * inv2 + 0.75 * inv2 * inv2 - 1.875 * inv2**3)
    return jnp.where(big, asym, small)


_float_unary(_erfcx, "special_erfcx", prim_names=["erfcx"])


def _sinc(x):
    px = x * math.pi
    safe = jnp.where(x == 0, 1.0, px)
    return jnp.where(x == 0, jnp.ones_like(x), jnp.sin(safe) / safe)


_float_unary(_sinc, "sinc", "special_sinc")


def _spherical_j0(x):
    safe = jnp.where(x == 0, 1.0, x)
    return jnp.where(x == 0, jnp.ones_like(x), jnp.sin(safe) / safe)


_float_unary(_spherical_j0, "special_spherical_bessel_j0", prim_names=["spherical_bessel_j0"])


def _entr(x):
    safe = jnp.where(x > 0, x, 1.0)
    return jnp.where(jnp.isnan(x), x, jnp.where(x > 0, -x * jnp.log(safe), jnp.where(x == 0, 0.0, -jnp.inf)))


_float_unary(_entr, "special_entr")


def _digamma(x):
    # PyTorch: digamma(0) = -inf (with the sign of zero), negative integers give NaN.
    out = jss.digamma(x)
    out = jnp.where(x == 0, jnp.copysign(jnp.inf, -x), out)
    return jnp.where((x < 0) & (x == jnp.floor(x)), jnp.nan, out)


_float_unary(_digamma, "digamma", "special_psi", "special_digamma", prim_names=["digamma"])


def _hurwitz_zeta(s, q):
    """Hurwitz zeta with PyTorch's (Cephes) conventions, including negative non-integer q."""
    dt = jnp.promote_types(s.dtype, jnp.float32)
    s, q = jnp.broadcast_arrays(s.astype(jnp.float64), q.astype(jnp.float64))
    # shift q > 0 with zeta(s, q) = sum_{k<m} (q + k)^-s + zeta(s, q + m)
    need = jnp.isfinite(q) & (q <= 0) & (s == jnp.floor(s))

    def cond(c):
        return jnp.any(c[2])

    def body(c):
        qq, acc, active = c
        acc = acc + jnp.where(active, jnp.power(jnp.where(active, qq, 1.0), -s), 0.0)
        qq = jnp.where(active, qq + 1, qq)
        return qq, acc, active & (qq <= 0)

    qs, acc, _ = lax.while_loop(cond, body, (q, jnp.zeros_like(q), need))
    out = acc + jss.zeta(s, jnp.where(need, qs, q))
    pole = (q <= 0) & (q == jnp.floor(q))
    out = jnp.where(pole, jnp.inf, out)
    out = jnp.where((q <= 0) & ~pole & (s != jnp.floor(s)), jnp.nan, out)
    out = jnp.where(s == 1, jnp.inf, jnp.where(s < 1, jnp.nan, out))
    return out.astype(dt)


def _trigamma(x):
    # PyTorch's trigamma: reflection below 0.5, six recurrence steps, then the asymptotic series.
    neg = x < 0.5
    sx = jnp.sin(math.pi * x)
    result = jnp.where(neg, -(math.pi * math.pi) / (sx * sx), 0.0)
    x = jnp.where(neg, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1.0 / 6 - ixx * (1.0 / 30 - ixx * (1.0 / 42)))) / x
    return jnp.where(neg, -result, result)


@lower(aten.polygamma.default, aten.special_polygamma.default, static=("n",))
def polygamma(n, self):
    (x,), _ = promote(self, float_=True)
    if n == 0:
        return _digamma(x)
    if n == 1:
        return _trigamma(x)
    sign = -1.0 if n % 2 == 0 else 1.0
    return (sign * math.factorial(n) * _hurwitz_zeta(jnp.full(x.shape, n + 1.0, x.dtype), x)).astype(x.dtype)


@lower(aten.mvlgamma.default, static=("p",))
def mvlgamma(self, p):
    (x,), _ = promote(self, float_=True)
    j = jnp.arange(p, dtype=x.dtype)
    return jnp.sum(jss.gammaln(x[..., None] - j / 2), axis=-1) + p * (p - 1) / 4 * math.log(math.pi)


@lower(aten.logit.default, aten.special_logit.default)
def logit(self, eps=None):
    (x,), _ = promote(self, float_=True)
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


# -- unary ops that keep integer dtypes


def _abs(x):
    return jnp.abs(x) if x.dtype != jnp.bool_ else x


_unary(_abs, "abs", "absolute", prim_names=["abs"])
_unary(jnp.negative, "neg", "negative", prim_names=["neg"])
_unary(lambda x: x, "positive")


def _sign(x):
    if x.dtype == jnp.bool_:
        return x
    if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        return (x > 0).astype(x.dtype)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.where(jnp.isnan(x), 0.0, jnp.sign(x)).astype(x.dtype)
    return jnp.sign(x)


_unary(_sign, "sign", prim_names=["sign"])


def _sgn(x):
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        a = jnp.abs(x)
        return jnp.where(a == 0, 0, x / jnp.where(a == 0, 1, a))
    return _sign(x)


_unary(_sgn, "sgn")


def _keep_int(fn):
    return lambda x: fn(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x


_unary(_keep_int(jnp.floor), "floor", prim_names=["floor"])
_unary(_keep_int(jnp.ceil), "ceil", prim_names=["ceil"])
_unary(_keep_int(jnp.trunc), "trunc", "fix", prim_names=["trunc"])
_unary(lambda x: x - jnp.trunc(x), "frac")
_unary(
    lambda x: jnp.conj(x) if jnp.iscomplexobj(x) else x, "conj_physical", "_conj_physical", prim_names=["conj_physical"]
)
_unary(lambda x: jnp.square(x) if x.dtype != jnp.bool_ else x, "square")


@lower(aten.round.default)
def round_(self):
    (x,), _ = promote(self)
    return jnp.round(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x


@lower(prims.round.default)
def prims_round(a):
    # prims.round rounds half away from zero (C round)
    return jnp.where(jnp.abs(a - jnp.trunc(a)) == 0.5, jnp.trunc(a) + jnp.sign(a), jnp.round(a))


@lower(aten.round.decimals, static=("decimals",))
def round_decimals(self, decimals=0):
    (x,), _ = promote(self)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    if decimals < 0:
        p = float(10 ** (-decimals))
        return jnp.round(x / p) * p
    p = float(10**decimals)
    return jnp.round(x * p) / p


@lower(aten.bitwise_not.default, prims.bitwise_not.default)
def bitwise_not(self):
    return jnp.logical_not(self) if self.dtype == jnp.bool_ else jnp.bitwise_not(self)


@lower(aten.logical_not.default)
def logical_not(self):
    return self == 0


def _float_class_test(test, kind, otherwise, *ops):
    """Register `test` (isnan, isinf...) for `ops`. It applies to inputs of the dtype class `kind`;
    on any other dtype (integers, bool) no element can be what it tests for, or every element
    is, so the result is `otherwise` (jnp.zeros or jnp.ones) of the input's shape."""

    def low(self):
        return test(self) if jnp.issubdtype(self.dtype, kind) else otherwise(self.shape, bool)

    lower(*ops)(low)


_float_class_test(jnp.isnan, jnp.inexact, jnp.zeros, aten.isnan.default)
_float_class_test(jnp.isinf, jnp.inexact, jnp.zeros, aten.isinf.default)
_float_class_test(jnp.isfinite, jnp.inexact, jnp.ones, aten.isfinite.default, prims.isfinite.default)
_float_class_test(jnp.isposinf, jnp.floating, jnp.zeros, aten.isposinf.default)
_float_class_test(jnp.isneginf, jnp.floating, jnp.zeros, aten.isneginf.default)


@lower(aten.isreal.default)
def isreal(self):
    if jnp.iscomplexobj(self):
        return jnp.imag(self) == 0
    return jnp.ones(self.shape, bool)


@lower(aten.signbit.default, prims.signbit.default)
def signbit(self):
    if jnp.issubdtype(self.dtype, jnp.floating):
        return jnp.signbit(self.astype(jnp.float32) if self.dtype in (jnp.float16, jnp.bfloat16) else self)
    if self.dtype == jnp.bool_ or jnp.issubdtype(self.dtype, jnp.unsignedinteger):
        return jnp.zeros(self.shape, bool)
    return self < 0


@lower(aten.angle.default)
def angle(self):
    (x,), _ = promote(self, float_=True)
    if jnp.iscomplexobj(x):
        return jnp.angle(x)
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, math.pi, 0.0).astype(x.dtype))


@lower(aten.nan_to_num.default)
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    if not jnp.issubdtype(self.dtype, jnp.inexact):
        return self
    fi = jnp.finfo(self.dtype)
    x = self
    x = jnp.where(jnp.isnan(x), 0.0 if nan is None else nan, x)
    x = jnp.where(jnp.isposinf(x), fi.max if posinf is None else posinf, x)
    x = jnp.where(jnp.isneginf(x), fi.min if neginf is None else neginf, x)
    return x.astype(self.dtype)


@lower(aten.frexp.Tensor, prims.frexp.default)
def frexp(self):
    m, e = jnp.frexp(self)
    return m, e.astype(jnp.int32)


# ----------------------------------------------------------------------------- binary arithmetic


def _alpha(other, alpha):
    if _is_number(alpha) and alpha == 1:
        return other
    return other * alpha


@lower(aten.add.Tensor, aten.add.Scalar, prims.add.default)
def add(self, other, alpha=1):
    (a, b), dt = promote(self, other)
    if dt == torch.bool:
        return a | (b & (cast(alpha, torch.bool) if not _is_number(alpha) or alpha != 1 else True))
    return a + _alpha(b, cast(alpha, _opmath(dt)) if not _is_number(alpha) else alpha)


@lower(aten.sub.Tensor, aten.sub.Scalar, prims.sub.default)
def sub(self, other, alpha=1):
    (a, b), dt = promote(self, other)
    if _operand(self)[1] == torch.bool or _operand(other)[1] == torch.bool:
        raise RuntimeError(
            "Subtraction, the `-` operator, with a bool tensor is not supported. "
            "If you are trying to invert a mask, use the `~` or `logical_not()` operator instead."
        )
    return a - _alpha(b, cast(alpha, _opmath(dt)) if not _is_number(alpha) else alpha)


@lower(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(self, other, alpha=1):
    return sub(other, self, alpha)


@lower(aten.mul.Tensor, aten.mul.Scalar, prims.mul.default)
def mul(self, other):
    (a, b), dt = promote(self, other, scalars_in_opmath=True)
    if dt == torch.bool:
        return a & b
    return a * b


def _int_div_trunc(a, b):
    # C semantics, with x / 0 = -1 (all bits set, like CUDA) instead of a trap.
    a, b = jnp.broadcast_arrays(a, b)  # lax.div does not broadcast
    zero = b == 0
    safe = jnp.where(zero, 1, b)
    if jnp.issubdtype(a.dtype, jnp.signedinteger):
        # INT_MIN / -1 wraps to INT_MIN
        q = lax.div(a, safe)
    else:
        q = lax.div(a, safe)
    return jnp.where(zero, jnp.asarray(-1).astype(a.dtype), q)


def _int_div_floor(a, b):
    a, b = jnp.broadcast_arrays(a, b)  # lax.rem does not broadcast
    q = _int_div_trunc(a, b)
    if jnp.issubdtype(a.dtype, jnp.signedinteger):
        safe = jnp.where(b == 0, 1, b)
        r = lax.rem(a, safe)
        q = jnp.where((r != 0) & ((r < 0) != (safe < 0)), q - 1, q)
    return q


def _float_div_floor(a, b):
    mod = _fmod_float(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    fl = jnp.floor(div)
    fl = jnp.where(div - fl > 0.5, fl + 1, fl)
    fl = jnp.where(div == 0, jnp.copysign(jnp.zeros_like(div), a / b), fl)
    return jnp.where(b == 0, a / b, fl)


@lower(aten.div.Tensor, aten.div.Scalar, aten.true_divide.Tensor, aten.true_divide.Scalar)
def div(self, other):
    (a, b), dt = promote(self, other, float_=True, scalars_in_opmath=True)
    return a / b


@lower(aten.div.Tensor_mode, aten.div.Scalar_mode, static=("rounding_mode",))
def div_mode(self, other, rounding_mode=None):
    if rounding_mode is None:
        return div(self, other)
    (a, b), dt = promote(self, other)
    if dt == torch.bool:
        a, b = a.astype(jnp.uint8), b.astype(jnp.uint8)
    if rounding_mode == "trunc":
        if jnp.issubdtype(a.dtype, jnp.inexact):
            return jnp.trunc(a / b)
        return _int_div_trunc(a, b)
    if rounding_mode == "floor":
        if jnp.issubdtype(a.dtype, jnp.inexact):
            return _float_div_floor(a, b)
        return _int_div_floor(a, b)
    raise ValueError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but found '{rounding_mode}'")


@lower(prims.div.default)
def prims_div(self, other):
    (a, b), dt = promote(self, other)
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return a / b
    return _int_div_trunc(a, b)


@lower(aten.floor_divide.default, aten.floor_divide.Scalar)
def floor_divide(self, other):
    return div_mode(self, other, "floor")


def _fmod_float(a, b):
    # XLA's float remainder loses precision for large quotients; float64 is exact for float32 operands.
    if a.dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
        return jnp.fmod(a.astype(jnp.float64), b.astype(jnp.float64)).astype(a.dtype)
    return jnp.fmod(a, b)


def _remainder(a, b):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        mod = _fmod_float(a, b)
        return jnp.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)
    zero = b == 0
    safe = jnp.where(zero, 1, b)
    r = lax.rem(a, safe)
    if jnp.issubdtype(a.dtype, jnp.signedinteger):
        r = jnp.where((r != 0) & ((r < 0) != (safe < 0)), r + safe, r)
    return jnp.where(zero, a, r)


def _fmod(a, b):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return _fmod_float(a, b)
    zero = b == 0
    return jnp.where(zero, a, lax.rem(a, jnp.where(zero, 1, b)))


_binary(_remainder, aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor, prims.remainder.default)
_binary(_fmod, aten.fmod.Tensor, aten.fmod.Scalar, prims.fmod.default)


def _int_pow(base, exp):
    """Integer power with wraparound; negative exponents give 0 except for bases 1 and -1."""
    dt = base.dtype
    base, exp = jnp.broadcast_arrays(base, exp.astype(dt))
    bits = jnp.iinfo(dt).bits
    result = jnp.ones_like(base)
    b = base
    e = exp
    for _ in range(bits):
        result = jnp.where((e & 1) == 1, result * b, result)
        b = b * b
        e = e >> 1 if not jnp.issubdtype(dt, jnp.signedinteger) else lax.shift_right_logical(e, jnp.ones_like(e))
    if jnp.issubdtype(dt, jnp.signedinteger):
        neg = exp < 0
        odd = (exp & 1) == 1
        negval = jnp.where(base == 1, 1, jnp.where(base == -1, jnp.where(odd, -1, 1), 0)).astype(dt)
        result = jnp.where(neg, negval, result)
    return result


def _pow(a, b):
    if a.dtype == jnp.bool_:
        return a | (b == 0)
    if jnp.issubdtype(a.dtype, jnp.integer):
        return _int_pow(a, b)
    if jnp.iscomplexobj(a):
        return jnp.where(b == 0, jnp.ones_like(a), jnp.power(a, b))
    return jnp.power(a, b)


pow_ = _binary(_pow, aten.pow.Tensor_Tensor, aten.pow.Scalar, prims.pow.default)

# The exponents PyTorch's CPU and CUDA kernels special-case (pow_tensor_scalar_optimized_kernel)
# are folded into the program and computed as PyTorch computes them: integer powers by
# multiplication, 0.5 and -0.5 as square roots, exact where a general power (exp and log) is not,
# and cheaper. So is a negative integer, which an integer tensor refuses as PyTorch does. Other
# exponents stay traced, so one that changes from call to call never recompiles.
_SPECIAL_EXPONENTS = frozenset({-2, -1, -0.5, 0, 0.5, 1, 2, 3})


def _folded_exponent(value) -> bool:
    t = type(value)
    return (t is int or t is float) and value in _SPECIAL_EXPONENTS or (t is int and value < 0)


@lower(aten.pow.Tensor_Scalar, fold={"exponent": _folded_exponent})
def pow_tensor_scalar(self, exponent):
    (a, b), _ = promote(self, exponent)
    # a Python number: folded, or any exponent while torchtpu.compile traces (eager mode's other
    # exponents arrive as arrays)
    if type(exponent) in (int, float):
        if type(exponent) is int and exponent < 0 and not jnp.issubdtype(a.dtype, jnp.inexact):
            raise RuntimeError("Integers to negative integer powers are not allowed.")
        if jnp.issubdtype(a.dtype, jnp.floating):
            if type(exponent) is int or (exponent in _SPECIAL_EXPONENTS and float(exponent).is_integer()):
                return lax.integer_pow(a, int(exponent))
            if exponent == 0.5:
                return jnp.sqrt(a)
            if exponent == -0.5:
                return lax.rsqrt(a)
    return _pow(a, b)


@lower(aten.float_power.Tensor_Tensor, aten.float_power.Tensor_Scalar, aten.float_power.Scalar)
def float_power(self, exponent):
    dt = torch.complex128 if result_type(self, exponent).is_complex else torch.float64
    return _pow(cast(self, dt), cast(exponent, dt))


def _float_binary(fn, *ops):
    return _binary(fn, *ops, float_=True)


_float_binary(jnp.arctan2, aten.atan2.default, aten.arctan2.default, prims.atan2.default)
_float_binary(jnp.hypot, aten.hypot.default, prims.hypot.default)
_float_binary(jnp.copysign, aten.copysign.Tensor, aten.copysign.Scalar)
_float_binary(jnp.logaddexp, aten.logaddexp.default)
_float_binary(lambda a, b: jnp.logaddexp2(a, b), aten.logaddexp2.default)
_float_binary(
    _hurwitz_zeta,
    aten.special_zeta.default,
    aten.special_zeta.self_scalar,
    aten.special_zeta.other_scalar,
    prims.zeta.default,
)
_float_binary(jss.gammainc, aten.igamma.default, aten.special_gammainc.default, prims.igamma.default)
_float_binary(jss.gammaincc, aten.igammac.default, aten.special_gammaincc.default, prims.igammac.default)


def _xlogy(a, b):
    safe = jnp.where(a == 0, 1.0, b)
    return jnp.where(jnp.isnan(b), jnp.nan, jnp.where(a == 0, 0.0, a * jnp.log(safe))).astype(a.dtype)


def _xlog1py(a, b):
    safe = jnp.where(a == 0, 0.0, b)
    return jnp.where(jnp.isnan(b), jnp.nan, jnp.where(a == 0, 0.0, a * jnp.log1p(safe))).astype(a.dtype)


_float_binary(
    _xlogy,
    aten.xlogy.Tensor,
    aten.xlogy.Scalar_Self,
    aten.xlogy.Scalar_Other,
    aten.special_xlogy.default,
    aten.special_xlogy.self_scalar,
    aten.special_xlogy.other_scalar,
)
_float_binary(
    _xlog1py, aten.special_xlog1py.default, aten.special_xlog1py.self_scalar, aten.special_xlog1py.other_scalar
)


@lower(aten.nextafter.default, prims.nextafter.default)
def nextafter(self, other):
    (a, b), dt = promote(self, other, opmath=False)
    return jnp.nextafter(a, b)


@lower(aten.ldexp.Tensor)
def ldexp(self, other):
    (a, b), dt = promote(self, other, float_=True)
    return a * jnp.exp2(b)


def _max_nan(a, b):
    return jnp.maximum(a, b) if a.dtype != jnp.bool_ else a | b


def _min_nan(a, b):
    return jnp.minimum(a, b) if a.dtype != jnp.bool_ else a & b


def _binary_same(fn, *ops):
    def low(self, other):
        (a, b), dt = promote(self, other)
        return fn(a, b)

    lower(*ops)(low)
    return low


_binary_same(_max_nan, aten.maximum.default, aten.max.other, prims.maximum.default)
_binary_same(_min_nan, aten.minimum.default, aten.min.other, prims.minimum.default)
_binary_same(
    lambda a, b: jnp.fmax(a, b) if jnp.issubdtype(a.dtype, jnp.inexact) else _max_nan(a, b),
    aten.fmax.default,
    prims.fmax.default,
)
_binary_same(
    lambda a, b: jnp.fmin(a, b) if jnp.issubdtype(a.dtype, jnp.inexact) else _min_nan(a, b),
    aten.fmin.default,
    prims.fmin.default,
)


def _gcd(a, b):
    return jnp.gcd(a, b)


_binary_same(_gcd, aten.gcd.default, prims.gcd.default)
_binary_same(jnp.lcm, aten.lcm.default)
_binary_same(
    lambda a, b: (
        jnp.where(a == 0, b, (a > 0).astype(a.dtype)).astype(a.dtype)
        if a.dtype != jnp.bool_
        else jnp.where(a == 0, b, a)
    ),
    aten.heaviside.default,
)


# -- comparisons and logic


def _cmp(fn, *ops):
    return _binary(fn, *ops, opmath=False)


_cmp(jnp.equal, aten.eq.Tensor, aten.eq.Scalar, prims.eq.default)
_cmp(jnp.not_equal, aten.ne.Tensor, aten.ne.Scalar, prims.ne.default)
_cmp(jnp.less, aten.lt.Tensor, aten.lt.Scalar, aten.less.Tensor, aten.less.Scalar, prims.lt.default)
_cmp(jnp.less_equal, aten.le.Tensor, aten.le.Scalar, aten.less_equal.Tensor, aten.less_equal.Scalar, prims.le.default)
_cmp(jnp.greater, aten.gt.Tensor, aten.gt.Scalar, aten.greater.Tensor, aten.greater.Scalar, prims.gt.default)
_cmp(
    jnp.greater_equal,
    aten.ge.Tensor,
    aten.ge.Scalar,
    aten.greater_equal.Tensor,
    aten.greater_equal.Scalar,
    prims.ge.default,
)


def _logical(fn, *ops):
    def low(self, other):
        return fn(cast(self, torch.bool), cast(other, torch.bool))

    lower(*ops)(low)


_logical(jnp.logical_and, aten.logical_and.default)
_logical(jnp.logical_or, aten.logical_or.default)
_logical(jnp.logical_xor, aten.logical_xor.default)


def _bitwise(fn, *ops):
    def low(self, other):
        (a, b), dt = promote(self, other, opmath=False)
        if jnp.issubdtype(a.dtype, jnp.inexact):
            raise TypeError(f"torchtpu: bitwise ops need integer or bool tensors, got {dt}")
        return fn(a, b)

    lower(*ops)(low)


_bitwise(
    jnp.bitwise_and,
    aten.bitwise_and.Tensor,
    aten.bitwise_and.Scalar,
    aten.bitwise_and.Scalar_Tensor,
    aten.__and__.Tensor,
    aten.__and__.Scalar,
    prims.bitwise_and.default,
)
_bitwise(
    jnp.bitwise_or,
    aten.bitwise_or.Tensor,
    aten.bitwise_or.Scalar,
    aten.bitwise_or.Scalar_Tensor,
    aten.__or__.Tensor,
    aten.__or__.Scalar,
    prims.bitwise_or.default,
)
_bitwise(
    jnp.bitwise_xor,
    aten.bitwise_xor.Tensor,
    aten.bitwise_xor.Scalar,
    aten.bitwise_xor.Scalar_Tensor,
    aten.__xor__.Tensor,
    aten.__xor__.Scalar,
    prims.bitwise_xor.default,
)


def _lshift(a, b):
    bits = jnp.iinfo(a.dtype).bits
    ok = (b >= 0) & (b < bits)
    return jnp.where(ok, lax.shift_left(a, jnp.where(ok, b, 0).astype(a.dtype)), jnp.zeros_like(a))


def _rshift(a, b):
    info = jnp.iinfo(a.dtype)
    signed = jnp.issubdtype(a.dtype, jnp.signedinteger)
    max_shift = info.bits - (1 if signed else 0)
    ok = (b >= 0) & (b < max_shift)
    s = jnp.where(ok, b, max_shift).astype(a.dtype)
    if signed:
        return lax.shift_right_arithmetic(a, s)
    return jnp.where(ok, lax.shift_right_logical(a, s), jnp.zeros_like(a))


_bitwise(
    _lshift,
    aten.bitwise_left_shift.Tensor,
    aten.bitwise_left_shift.Tensor_Scalar,
    aten.bitwise_left_shift.Scalar_Tensor,
    aten.__lshift__.Tensor,
    aten.__lshift__.Scalar,
    prims.shift_left.default,
)
_bitwise(
    _rshift,
    aten.bitwise_right_shift.Tensor,
    aten.bitwise_right_shift.Tensor_Scalar,
    aten.bitwise_right_shift.Scalar_Tensor,
    aten.__rshift__.Tensor,
    aten.__rshift__.Scalar,
    prims.shift_right_arithmetic.default,
)


# ----------------------------------------------------------------------------- ternary


@lower(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar, prims.where.default)
def where(condition, self, other):
    (a, b), dt = promote(self, other, opmath=False)
    return jnp.where(cast(condition, torch.bool), a, b)


def _clamp(x, lo, hi):
    if x.dtype == jnp.bool_:
        if lo is not None:
            x = x | lo
        if hi is not None:
            x = x & hi
        return x
    if lo is not None:
        x = jnp.maximum(x, lo)
    if hi is not None:
        x = jnp.minimum(x, hi)
    return x


@lower(aten.clamp.default, aten.clamp.Tensor, aten.clip.default, aten.clip.Tensor)
def clamp(self, min=None, max=None):
    if min is None and max is None:
        raise ValueError("torch.clamp: At least one of 'min' or 'max' must not be None")
    (x, lo, hi), dt = promote(self, min, max, opmath=False)
    return _clamp(x, lo, hi)


@lower(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(self, min):
    return clamp(self, min, None)


@lower(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(self, max):
    return clamp(self, None, max)


@lower(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp(self, end, weight):
    (a, b, w), dt = promote(self, end, weight)
    diff = b - a
    return jnp.where(jnp.abs(w) < 0.5, a + w * diff, b - diff * (1 - w))


@lower(aten.addcmul.default)
def addcmul(self, tensor1, tensor2, value=1):
    (a, t1, t2), dt = promote(self, tensor1, tensor2)
    if dt == torch.bool:
        return a | (t1 & t2)
    return a + cast(value, _opmath(dt)) * t1 * t2


@lower(aten.addcdiv.default)
def addcdiv(self, tensor1, tensor2, value=1):
    (a, t1, t2), dt = promote(self, tensor1, tensor2)
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        raise TypeError("Integer division with addcdiv is no longer supported; use addcdiv on float tensors")
    return a + cast(value, _opmath(dt)) * (t1 / t2)


@lower(aten.isclose.default, static=("equal_nan",))
def isclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    (a, b), dt = promote(self, other, opmath=False)
    if a.dtype == jnp.bool_ or not jnp.issubdtype(a.dtype, jnp.inexact):
        close = a == b
        if jnp.issubdtype(a.dtype, jnp.integer):
            af, bf = a.astype(jnp.float64), b.astype(jnp.float64)
            close = close | (jnp.abs(af - bf) <= atol + rtol * jnp.abs(bf))
        return close
    close = a == b
    if equal_nan:
        close = close | (jnp.isnan(a) & jnp.isnan(b))
    diff = jnp.abs(a - b)
    tol = atol + rtol * jnp.abs(b)
    close = close | (jnp.isfinite(diff) & (diff <= tol))
    return close


# ----------------------------------------------------------------------------- prims plumbing


@lower(prims.convert_element_type.default)
def convert_element_type(a, dtype):
    return cast(a, dtype)


@lower(prims.conj.default)
def prims_conj(a):
    return jnp.conj(a) if jnp.iscomplexobj(a) else a


# ----------------------------------------------------------------------------- fill / zero


@lower(aten.fill.Scalar, aten.fill.Tensor)
def fill(self, value):
    return jnp.full(self.shape, cast(value, _tdtype(self)) if not _is_number(value) else value, self.dtype)


@lower(aten.zero.default)
def zero(self):
    return jnp.zeros_like(self)


@lower(prims.fill.default)
def prims_fill(self, value):
    return fill(self, value)


# ----------------------------------------------------------------------------- _foreach


def _foreach(fn, *ops):
    """Register `fn(*elementwise args)` as the functional foreach op over lists."""

    def low(self, *rest, **kw):
        rest = list(rest)
        outs = []
        for i in range(len(self)):
            args = [self[i]]
            for r in rest:
                if isinstance(r, (list, tuple)):
                    args.append(r[i])
                else:
                    args.append(r)
            outs.append(fn(*args, **kw))
        return outs

    lower(*[op for op in ops if op is not None])(low)


def _fe(name, *overloads):
    pk = getattr(aten, name, None)
    if pk is None:
        return []
    return [getattr(pk, o) for o in overloads if o in pk.overloads()]


_foreach(add, *_fe("_foreach_add", "Scalar", "List", "ScalarList", "Tensor"))
_foreach(sub, *_fe("_foreach_sub", "Scalar", "List", "ScalarList"))
_foreach(mul, *_fe("_foreach_mul", "Scalar", "List", "ScalarList", "Tensor"))
_foreach(div, *_fe("_foreach_div", "Scalar", "List", "ScalarList", "Tensor"))
_foreach(lambda s, o: _binary_max(s, o), *_fe("_foreach_maximum", "Scalar", "List", "ScalarList"))
_foreach(lambda s, o: _binary_min(s, o), *_fe("_foreach_minimum", "Scalar", "List", "ScalarList"))
_foreach(lambda s, o: clamp(s, o, None), *_fe("_foreach_clamp_min", "Scalar", "List", "ScalarList"))
_foreach(lambda s, o: clamp(s, None, o), *_fe("_foreach_clamp_max", "Scalar", "List", "ScalarList"))
_foreach(pow_, *_fe("_foreach_pow", "List", "Scalar", "ScalarList"))
_foreach(lerp, *_fe("_foreach_lerp", "List", "Scalar", "ScalarList"))
_foreach(lambda s, a, b, value=1: addcmul(s, a, b, value), *_fe("_foreach_addcmul", "Scalar", "ScalarList", "Tensor"))
_foreach(lambda s, a, b, value=1: addcdiv(s, a, b, value), *_fe("_foreach_addcdiv", "Scalar", "ScalarList", "Tensor"))
_foreach(lambda x: jnp.zeros_like(x), *_fe("_foreach_zero", "default"))


def _binary_max(s, o):
    (a, b), _ = promote(s, o)
    return _max_nan(a, b)


def _binary_min(s, o):
    (a, b), _ = promote(s, o)
    return _min_nan(a, b)


def _foreach_scalar_list_fix():
    # addcmul/addcdiv .ScalarList/.Tensor take `scalars`, not `value`.
    def mk(fn):
        def low(self, tensor1, tensor2, scalars):
            if not isinstance(scalars, (list, tuple)):
                # a 1-d tensor of scalars
                scalars = [scalars[i] for i in range(len(self))]
            return [fn(s, a, b, v) for s, a, b, v in zip(self, tensor1, tensor2, scalars)]

        return low

    for name, fn in (("_foreach_addcmul", addcmul), ("_foreach_addcdiv", addcdiv)):
        ops = _fe(name, "ScalarList", "Tensor")
        if ops:
            lower(*ops)(mk(fn))


_foreach_scalar_list_fix()


def _foreach_pow_scalar_base():
    ops = _fe("_foreach_pow", "ScalarAndTensor")
    if ops:
        lower(*ops)(lambda self, exponent: [pow_(self, e) for e in exponent])


_foreach_pow_scalar_base()

_UNARY_FOREACH = {
    "sqrt": "sqrt",
    "neg": "neg",
    "sign": "sign",
    "abs": "abs",
    "exp": "exp",
    "log": "log",
    "reciprocal": "reciprocal",
    "sigmoid": "sigmoid",
    "tanh": "tanh",
    "expm1": "expm1",
    "log1p": "log1p",
    "rsqrt": "rsqrt",
    "sin": "sin",
    "cos": "cos",
    "floor": "floor",
    "ceil": "ceil",
    "round": "round",
    "trunc": "trunc",
    "frac": "frac",
    "erf": "erf",
    "log2": "log2",
    "log10": "log10",
    "exp2": "exp2",
    "lgamma": "lgamma",
    "tan": "tan",
    "sinh": "sinh",
    "cosh": "cosh",
    "asin": "asin",
    "acos": "acos",
    "atan": "atan",
    "erfc": "erfc",
}


def _register_unary_foreach():
    from ..registry import LOWERINGS

    for fe_name, op_name in _UNARY_FOREACH.items():
        ops = _fe(f"_foreach_{fe_name}", "default")
        entry = LOWERINGS.get(getattr(aten, op_name).default)
        if not ops or entry is None:
            continue
        fn = entry.fn
        lower(*ops)(lambda self, _fn=fn: [_fn(x) for x in self])


_register_unary_foreach()


@lower(*_fe("_foreach_norm", "Scalar"), static=("ord",))
def _foreach_norm(self, ord=2, dtype=None):
    out = []
    for x in self:
        x = x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x
        a = jnp.abs(x)
        if ord == math.inf:
            out.append(jnp.max(a))
        elif ord == 0:
            out.append(jnp.sum(a != 0).astype(a.dtype))
        elif ord == 1:
            out.append(jnp.sum(a))
        elif ord == 2:
            out.append(jnp.sqrt(jnp.sum(a * a)))
        else:
            out.append(jnp.sum(a**ord) ** (1.0 / ord))
    return out


# ----------------------------------------------------------------------------- Bessel functions


def _bessel_j(x, order):
    """J0 / J1: power series for |x| <= 8, Hankel's asymptotic expansion beyond (float64)."""
    dt = x.dtype
    x = x.astype(jnp.float64)
    ax = jnp.abs(x)
    small = ax <= 8.0
    xs = jnp.where(small, ax, 0.0)
    q = -(xs * xs) / 4
    term = jnp.ones_like(xs) if order == 0 else xs / 2
    total = term
    for k in range(1, 48):
        term = term * q / (k * (k + order))
        total = total + term
    xl = jnp.where(small, 8.0, ax)
    mu = 4.0 * order * order
    z = 8.0 * xl
    p = jnp.ones_like(xl)
    qq = (mu - 1) / z
    # P = sum (-1)^k a_{2k} / z^{2k}, Q = sum (-1)^k a_{2k+1} / z^{2k+1}; a_m = prod_{j<=m}(mu-(2j-1)^2)/m!
    a = [1.0]
    for m in range(1, 24):
        a.append(a[-1] * (mu - (2 * m - 1) ** 2) / m)
    p = sum(((-1) ** k) * a[2 * k] / z ** (2 * k) for k in range(0, 12))
    qq = sum(((-1) ** k) * a[2 * k + 1] / z ** (2 * k + 1) for k in range(0, 11))
    chi = xl - (order / 2 + 0.25) * math.pi
    large = jnp.sqrt(2 / (math.pi * xl)) * (p * jnp.cos(chi) - qq * jnp.sin(chi))
    out = jnp.where(small, total, large)
    if order == 1:
        out = jnp.where(x < 0, -out, out)
    out = jnp.where(jnp.isinf(x), 0.0, out)
    return out.astype(dt)


_float_unary(lambda x: _bessel_j(x, 0), "special_bessel_j0", prim_names=["bessel_j0"])
_float_unary(lambda x: _bessel_j(x, 1), "special_bessel_j1", prim_names=["bessel_j1"])


# ----------------------------------------------------------------------------- orthogonal polynomials


def _recurrence(x, n, p0, p1, step):
    """p_n(x) by the three-term recurrence p_{k+1} = step(k, x, p_k, p_{k-1}), n < 0 -> 0."""
    ni = jnp.where(jnp.isnan(n), -1, n).astype(jnp.int64)
    x, ni = jnp.broadcast_arrays(x, ni)
    p0 = jnp.broadcast_to(p0, x.shape).astype(x.dtype)
    p1 = jnp.broadcast_to(p1, x.shape).astype(x.dtype)
    out = jnp.where(ni == 0, p0, jnp.where(ni == 1, p1, jnp.zeros_like(x)))
    top = jnp.max(ni, initial=0)

    def cond(c):
        return c[0] < top

    def body(c):
        k, prev, cur, out = c
        nxt = step(k.astype(x.dtype), x, cur, prev)
        out = jnp.where(ni == k + 1, nxt, out)
        return k + 1, cur, nxt, out

    _, _, _, out = lax.while_loop(cond, body, (jnp.asarray(1, jnp.int64), p0, p1, out))
    return out


def _poly(kind):
    def low(x, n):
        (xa, na), dt = promote(x, n, float_=True)
        xa = xa.astype(jnp.float64)
        if kind.startswith("shifted_"):
            xa = xa + xa - 1
        k = kind.replace("shifted_", "")
        cheb = lambda k_, x_, c, p: 2 * x_ * c - p  # noqa: E731
        if k == "chebyshev_t":
            out = _recurrence(xa, na, 1.0, xa, cheb)
        elif k == "chebyshev_u":
            out = _recurrence(xa, na, 1.0, 2 * xa, cheb)
        elif k == "chebyshev_v":
            out = _recurrence(xa, na, 1.0, 2 * xa - 1, cheb)
        elif k == "chebyshev_w":
            out = _recurrence(xa, na, 1.0, 2 * xa + 1, cheb)
        elif k == "hermite_h":
            out = _recurrence(xa, na, 1.0, 2 * xa, lambda k_, x_, c, p: 2 * x_ * c - 2 * k_ * p)
        elif k == "hermite_he":
            out = _recurrence(xa, na, 1.0, xa, lambda k_, x_, c, p: x_ * c - k_ * p)
        elif k == "laguerre_l":
            out = _recurrence(xa, na, 1.0, 1 - xa, lambda k_, x_, c, p: ((2 * k_ + 1 - x_) * c - k_ * p) / (k_ + 1))
        elif k == "legendre_p":
            out = _recurrence(xa, na, 1.0, xa, lambda k_, x_, c, p: ((2 * k_ + 1) * x_ * c - k_ * p) / (k_ + 1))
        else:
            raise NotImplementedError(kind)
        return out

    return low


for _kind, _name in [
    ("chebyshev_t", "special_chebyshev_polynomial_t"),
    ("chebyshev_u", "special_chebyshev_polynomial_u"),
    ("chebyshev_v", "special_chebyshev_polynomial_v"),
    ("chebyshev_w", "special_chebyshev_polynomial_w"),
    ("shifted_chebyshev_t", "special_shifted_chebyshev_polynomial_t"),
    ("shifted_chebyshev_u", "special_shifted_chebyshev_polynomial_u"),
    ("shifted_chebyshev_v", "special_shifted_chebyshev_polynomial_v"),
    ("shifted_chebyshev_w", "special_shifted_chebyshev_polynomial_w"),
    ("hermite_h", "special_hermite_polynomial_h"),
    ("hermite_he", "special_hermite_polynomial_he"),
    ("laguerre_l", "special_laguerre_polynomial_l"),
    ("legendre_p", "special_legendre_polynomial_p"),
]:
    _pk = getattr(aten, _name, None)
    if _pk is not None:
        lower(*[getattr(_pk, o) for o in ("default", "x_scalar", "n_scalar") if o in _pk.overloads()])(_poly(_kind))


_EULER = 0.57721566490153286060651209


def _hankel_pq(xl, order, terms=12):
    mu = 4.0 * order * order
    z = 8.0 * xl
    a = [1.0]
    for m in range(1, 2 * terms + 1):
        a.append(a[-1] * (mu - (2 * m - 1) ** 2) / m)
    p = sum(((-1) ** k) * a[2 * k] / z ** (2 * k) for k in range(terms))
    q = sum(((-1) ** k) * a[2 * k + 1] / z ** (2 * k + 1) for k in range(terms))
    return p, q


def _bessel_y(x, order):
    """Y0 / Y1: log-series for 0 < x <= 8, Hankel's expansion beyond; NaN below 0, -inf at 0."""
    dt = x.dtype
    x = x.astype(jnp.float64)
    small = x <= 8.0
    xs = jnp.where(small & (x > 0), x, 1.0)
    h = xs / 2
    q = -(h * h)
    lg = jnp.log(h) + _EULER
    if order == 0:
        term = jnp.ones_like(xs)
        j = term
        s = jnp.zeros_like(xs)
        harmonic = 0.0
        for k in range(1, 48):
            term = term * q / (k * k)
            harmonic += 1.0 / k
            j = j + term
            s = s - term * harmonic
        ys = (2 / math.pi) * (lg * j + s)
    else:
        # Y1 = (2/pi) ln(x/2) J1 - 2/(pi x) - (1/pi) sum (-1)^k (psi(k+1)+psi(k+2)) h^{2k+1} / (k!(k+1)!)
        term = h  # (-1)^k h^{2k+1} / (k! (k+1)!)
        j = term
        hk = 0.0
        s = term * (2 * -_EULER + 1.0)
        for k in range(1, 48):
            term = term * q / (k * (k + 1))
            hk += 1.0 / k
            j = j + term
            s = s + term * (-2 * _EULER + 2 * hk + 1.0 / (k + 1))
        ys = (2 / math.pi) * (jnp.log(h) * j) - 2 / (math.pi * xs) - s / math.pi
    xl = jnp.where(small, 8.0, x)
    p, qq = _hankel_pq(xl, order)
    chi = xl - (order / 2 + 0.25) * math.pi
    yl = jnp.sqrt(2 / (math.pi * xl)) * (p * jnp.sin(chi) + qq * jnp.cos(chi))
    out = jnp.where(small, ys, yl)
    out = jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, out))
    out = jnp.where(jnp.isposinf(x), 0.0, out)
    return out.astype(dt)


_float_unary(lambda x: _bessel_y(x, 0), "special_bessel_y0")
_float_unary(lambda x: _bessel_y(x, 1), "special_bessel_y1")


def _bessel_k(x, order, scaled):
    """K0 / K1 (optionally times e^x) by the trapezoidal rule on K_v(x) = int_0^inf e^{-x cosh t} cosh(v t) dt."""
    dt = x.dtype
    x = x.astype(jnp.float64)
    pos = x > 0
    xs = jnp.where(pos, x, 1.0)
    step = 0.02
    shift = 1.0 if scaled else 0.0

    def body(i, acc):
        t = i * step
        v = jnp.exp(-xs * (jnp.cosh(t) - shift))
        if order:
            v = v * jnp.cosh(order * t)
        return acc + jnp.where(i == 0, 0.5, 1.0) * v

    # up to t = 30: e^{-x cosh t} is negligible there for any x above 1e-11
    out = lax.fori_loop(0, 1500, body, jnp.zeros_like(xs)) * step
    out = jnp.where(x == 0, jnp.inf, jnp.where(x < 0, jnp.nan, out))
    out = jnp.where(jnp.isposinf(x), 0.0, out)
    return out.astype(dt)


_float_unary(lambda x: _bessel_k(x, 0, False), "special_modified_bessel_k0")
_float_unary(lambda x: _bessel_k(x, 1, False), "special_modified_bessel_k1")
_float_unary(lambda x: _bessel_k(x, 0, True), "special_scaled_modified_bessel_k0")
_float_unary(lambda x: _bessel_k(x, 1, True), "special_scaled_modified_bessel_k1")


def _airy_ai(x):
    """Ai: Maclaurin series for |x| <= 5, the asymptotic expansions beyond (float64)."""
    dt = x.dtype
    x = x.astype(jnp.float64)
    mid = jnp.abs(x) <= 5.0
    xm = jnp.where(mid, x, 0.0)
    x3 = xm * xm * xm
    t = jnp.ones_like(xm)
    s = xm
    f, g = t, s
    for k in range(1, 80):
        t = t * x3 / ((3 * k - 1) * (3 * k))
        s = s * x3 / ((3 * k) * (3 * k + 1))
        f = f + t
        g = g + s
    series = 0.355028053887817239 * f - 0.258819403792806798 * g
    u = [1.0]
    for k in range(1, 12):
        u.append(u[-1] * (6 * k - 5) * (6 * k - 3) * (6 * k - 1) / ((2 * k - 1) * 216 * k))
    z = jnp.where(mid, 6.0, jnp.abs(x))
    zeta = 2.0 / 3.0 * z * jnp.sqrt(z)
    pos = sum(((-1) ** k) * u[k] / zeta**k for k in range(12))
    ai_pos = jnp.exp(-zeta) / (2 * math.sqrt(math.pi) * z**0.25) * pos
    even = sum(((-1) ** k) * u[2 * k] / zeta ** (2 * k) for k in range(6))
    odd = sum(((-1) ** k) * u[2 * k + 1] / zeta ** (2 * k + 1) for k in range(5))
    phase = zeta - math.pi / 4
    ai_neg = (jnp.cos(phase) * even + jnp.sin(phase) * odd) / (math.sqrt(math.pi) * z**0.25)
    out = jnp.where(mid, series, jnp.where(x > 0, ai_pos, ai_neg))
    out = jnp.where(jnp.isposinf(x), 0.0, out)
    out = jnp.where(jnp.isneginf(x), 0.0, out)
    return out.astype(dt)


_float_unary(_airy_ai, "special_airy_ai")
