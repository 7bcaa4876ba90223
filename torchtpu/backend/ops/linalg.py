"""Linear algebra: matrix products and factorizations.

Matmul precision: on TPU, XLA runs float32 dots as bfloat16 passes by default. PyTorch's
CPU kernels (our oracle) compute float32 products in float32, so every float32/complex64
product here asks for `Precision.HIGHEST`. bfloat16/float16 products accumulate in float32
and round once, like PyTorch's CPU kernels. Integer products accumulate in the integer type,
so they are exact (modulo wrap-around, as in PyTorch).

LAPACK-style outputs follow PyTorch: pivots are 1-based int32, `info` is int32 (0 = success,
i > 0 = the i-th leading minor/diagonal is singular), and `_linalg_check_errors` raises the
same errors PyTorch does in eager mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jax import lax

from ..registry import aten, lower

HIGHEST = lax.Precision.HIGHEST


def _is_int(dt) -> bool:
    return jnp.issubdtype(dt, jnp.integer) or dt == jnp.bool_


def _low_float(dt) -> bool:
    return dt in (jnp.bfloat16, jnp.float16)


def _matmul(a, b):
    """a @ b with numpy broadcasting semantics, computed as PyTorch's CPU kernels would."""
    dt = jnp.result_type(a, b)
    if dt == jnp.bool_:
        return jnp.matmul(a.astype(jnp.int32), b.astype(jnp.int32)) != 0
    if _is_int(dt):
        return jnp.matmul(a.astype(dt), b.astype(dt), preferred_element_type=dt)
    if _low_float(dt):
        out = jnp.matmul(a.astype(dt), b.astype(dt), precision=HIGHEST, preferred_element_type=jnp.float32)
        return out.astype(dt)
    return jnp.matmul(a.astype(dt), b.astype(dt), precision=HIGHEST)


def _scaled_add(self, prod, beta, alpha):
    """beta * self + alpha * prod; beta == 0 ignores self (NaN/Inf included), as in PyTorch."""
    dt = prod.dtype
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        prod = prod * alpha
    if isinstance(beta, (int, float)) and beta == 1:
        term = self
    elif isinstance(beta, (int, float)) and beta == 0:
        return jnp.broadcast_to(prod, jnp.broadcast_shapes(self.shape, prod.shape)).astype(dt)
    else:
        term = jnp.where(beta == 0, jnp.zeros_like(self), self * beta)
    return (term + prod).astype(dt)


def _acc(x):
    """Upcast low-precision floats so that the additions also happen in float32."""
    return x.astype(jnp.float32) if _low_float(x.dtype) else x


@lower(aten.mm.default, aten.bmm.default, aten.matmul.default)
def mm(self, mat2):
    return _matmul(self, mat2)


@lower(aten.mm.dtype, aten.bmm.dtype)
def mm_dtype(self, mat2, out_dtype):
    from .. import dtypes

    jdt = dtypes.to_jax_dtype(out_dtype)
    return jnp.matmul(self, mat2, precision=HIGHEST, preferred_element_type=jdt)


def _group_sizes(offs, n):
    """torch._grouped_mm's `offs` (each group's exclusive end along the ragged dimension) -> the
    group sizes; rows past the last end belong to no group."""
    ends = jnp.minimum(offs.astype(jnp.int32), n)
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


@lower(aten._grouped_mm.default)
def grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    """torch._grouped_mm: one matmul per group of rows. The forms a Mixture-of-Experts layer and
    its gradients use, with `offs` the groups' cumulative ends:

    - (M, K) x (G, K, N) -> (M, N): rows offs[g-1]:offs[g] times the g-th matrix (the experts);
    - (K, M) x (M, N) -> (G, K, N): the g-th product over columns/rows offs[g-1]:offs[g] only (the
      experts' weight gradients);
    - (G, M, K) x (K, N) -> (M, N): columns offs[g-1]:offs[g] of the product with the g-th matrix;
    - without offs, (G, M, K) x (G, K, N) -> (G, M, N), a batched matmul.

    On TPU the first two run as megablox's grouped-matmul kernels (grouped_mm_tpu.py) where they
    apply, and what the kernels do not take as `jax.lax.ragged_dot`. A program compiled for any
    other platform runs all three as loops over row tiles (grouped_mm_blocked.py): XLA's CPU
    backend computes a `ragged_dot` densely, every row against every group. `lax.platform_dependent`
    picks the path when the program is lowered, for the platform it is compiled for. Rows (or
    columns) past the last group are zero, and accumulation is in float32 for bfloat16 inputs,
    rounded once, as in the other matmuls here."""
    if bias is not None:
        raise NotImplementedError("torchtpu _grouped_mm: bias is not supported (as in PyTorch's CUDA kernel)")
    from .. import dtypes

    dt = dtypes.to_jax_dtype(out_dtype) if out_dtype is not None else jnp.result_type(self, mat2)
    if offs is None:
        if self.ndim != 3 or mat2.ndim != 3:
            raise ValueError(f"_grouped_mm without offs needs two 3-D operands, got {self.ndim}-D and {mat2.ndim}-D")
        return jnp.matmul(self, mat2, **_grouped_kw(self, mat2, dt)).astype(dt)
    if (self.ndim, mat2.ndim) not in ((2, 3), (2, 2), (3, 2)):
        raise ValueError(f"_grouped_mm with offs takes 2-D/3-D operands, got {self.ndim}-D and {mat2.ndim}-D")
    if (self.ndim, mat2.ndim) == (3, 2):
        return _off_tpu_blocked(self, mat2, offs, dt, _ragged_grouped_mm)
    from . import grouped_mm_tpu

    form = "(M, K) x (G, K, N)" if mat2.ndim == 3 else "(K, M) x (M, N)"
    reason = grouped_mm_tpu.unsupported_reason(
        self.shape, mat2.shape, self.dtype, mat2.dtype, grouped_mm_tpu.shards_of(self, mat2)
    )
    if reason is None:
        kernel = grouped_mm_tpu.forward_gmm if mat2.ndim == 3 else grouped_mm_tpu.weight_grad_tgmm

        def tpu(a, b, o):
            return kernel(a, b, jnp.minimum(o.astype(jnp.int32), a.shape[0] if b.ndim == 3 else a.shape[1]), dt)

    else:

        def tpu(a, b, o):
            grouped_mm_tpu.note_fallback(form, reason)
            return _ragged_grouped_mm(a, b, o, dt)

    if reason is None and grouped_mm_tpu.interpreting():
        return tpu(self, mat2, offs)
    return lax.platform_dependent(self, mat2, offs, tpu=tpu, default=lambda a, b, o: _blocked_grouped_mm(a, b, o, dt))


def grouped_mm_stored(x, w, offs, out_dtype):
    """`grouped_mm`'s (M, K) x (G, K, N) form with `w` read as laid out (megablox's gmm without
    transposing the weights, on TPU, or `jax.lax.ragged_dot` where the kernel does not apply; the
    loop over row tiles of grouped_mm_blocked.py elsewhere), in `out_dtype` (a JAX dtype): the
    product a backward rule takes with weights the forward read transposed. Not differentiable on
    TPU."""
    from . import grouped_mm_tpu

    ends = jnp.minimum(offs.astype(jnp.int32), x.shape[0])
    reason = grouped_mm_tpu.unsupported_reason(x.shape, w.shape, x.dtype, w.dtype, grouped_mm_tpu.shards_of(x, w))

    def default(a, b, o):
        return _blocked_grouped_mm(a, b, o, out_dtype)

    if reason is not None:
        return _off_tpu_blocked(x, w, ends, out_dtype, _ragged_grouped_mm)

    def tpu(a, b, o):
        return grouped_mm_tpu.stored_gmm(a, b, o, out_dtype)

    if grouped_mm_tpu.interpreting():
        return tpu(x, w, ends)
    return lax.platform_dependent(x, w, ends, tpu=tpu, default=default)


def _grouped_kw(a, b, dt):
    """dot keywords of a grouped matmul: float32 accumulation for 16-bit floats. Products of
    bfloat16 operands are exact in float32, so those ask for no extra precision (TPU's ragged dot
    refuses a float32 contract precision on bfloat16 operands); other floats for HIGHEST."""
    acc = jnp.float32 if _low_float(dt) or _low_float(a.dtype) else dt
    precision = None if _low_float(a.dtype) and _low_float(b.dtype) else HIGHEST
    return {"precision": precision, "preferred_element_type": acc}


def _off_tpu_blocked(self, mat2, offs, dt, on_tpu):
    """`on_tpu(self, mat2, offs, dt)` in a program compiled for TPU, `_blocked_grouped_mm` in one
    compiled for any other platform."""
    return lax.platform_dependent(
        self,
        mat2,
        offs,
        tpu=lambda a, b, o: on_tpu(a, b, o, dt),
        default=lambda a, b, o: _blocked_grouped_mm(a, b, o, dt),
    )


def _blocked_grouped_mm(self, mat2, offs, dt):
    """_grouped_mm with offs as grouped_mm_blocked's loops over row tiles (programs for platforms
    other than TPU; any shape)."""
    from . import grouped_mm_blocked as blocked

    kw = _grouped_kw(self, mat2, dt)
    precision, acc = kw["precision"], kw["preferred_element_type"]
    if self.ndim == 2 and mat2.ndim == 3:
        # the weights read as (G, N, K): torchtitan stores them so and passes them transposed, and
        # XLA cancels the two transposes
        return blocked.gmm(self, jnp.swapaxes(mat2, 1, 2), offs, True, precision, acc, dt)
    if self.ndim == 2 and mat2.ndim == 2:
        return blocked.tgmm(self, mat2, offs, precision, acc, dt)
    # (M, N)^T = (N, K) x (G, M, K)^T, the groups ragged over N
    return blocked.gmm(mat2.T, self, offs, True, precision, acc, dt).T


def _ragged_grouped_mm(self, mat2, offs, dt):
    """_grouped_mm with offs as `jax.lax.ragged_dot` (any platform, any shape; programs for TPU
    take it where megablox's kernels do not apply)."""
    kw = _grouped_kw(self, mat2, dt)
    if self.ndim == 2 and mat2.ndim == 3:
        out = lax.ragged_dot(self, mat2, _group_sizes(offs, self.shape[0]), **kw)
    elif self.ndim == 2 and mat2.ndim == 2:
        dims = lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [0]), ([], [])), lhs_ragged_dimensions=[1], rhs_group_dimensions=[]
        )
        out = lax.ragged_dot_general(self, mat2, _group_sizes(offs, self.shape[1]), dims, **kw)
    else:
        # (M, N)^T = (N, K) x (G, K, M), the groups ragged over N
        gs = _group_sizes(offs, mat2.shape[1])
        out = lax.ragged_dot(mat2.T, jnp.swapaxes(self, 1, 2), gs, **kw).T
    return out.astype(dt)


@lower(aten.mv.default)
def mv(self, vec):
    return _matmul(self, vec)


@lower(aten.dot.default, aten.inner.default)
def dot(self, tensor):
    if self.ndim <= 1 and tensor.ndim <= 1:
        if self.ndim == 0 or tensor.ndim == 0:
            return self * tensor
        return _matmul(self, tensor)
    return jnp.tensordot(self, tensor, axes=([-1], [-1]), precision=HIGHEST)


@lower(aten.vdot.default)
def vdot(self, other):
    return _matmul(jnp.conj(self), other)


@lower(aten.outer.default, aten.ger.default)
def outer(self, vec2):
    return jnp.multiply(self[:, None], vec2[None, :])


@lower(aten.addmm.default, aten.addmv.default, aten.baddbmm.default)
def addmm(self, mat1, mat2, beta=1, alpha=1):
    dt = jnp.result_type(self, mat1, mat2)
    prod = _matmul(_acc(mat1), _acc(mat2))
    return _scaled_add(_acc(self), prod, beta, alpha).astype(dt)


@lower(aten.addbmm.default)
def addbmm(self, batch1, batch2, beta=1, alpha=1):
    dt = jnp.result_type(self, batch1, batch2)
    prod = jnp.sum(_matmul(_acc(batch1), _acc(batch2)), axis=0)
    return _scaled_add(_acc(self), prod, beta, alpha).astype(dt)


@lower(aten.addr.default)
def addr(self, vec1, vec2, beta=1, alpha=1):
    dt = jnp.result_type(self, vec1, vec2)
    prod = jnp.multiply(vec1[:, None], vec2[None, :])
    if dt == jnp.bool_:
        b = jnp.logical_and(self, beta != 0) if not isinstance(beta, bool) else (self if beta else jnp.zeros_like(self))
        return jnp.logical_or(b, jnp.logical_and(prod, alpha != 0))
    return _scaled_add(self, prod, beta, alpha).astype(dt)


@lower(aten.linalg_vecdot.default)
def vecdot(x, y, dim=-1):
    return jnp.sum(jnp.conj(x) * y, axis=dim)


@lower(aten.linalg_cross.default)
def linalg_cross(self, other, dim=-1):
    shape = jnp.broadcast_shapes(self.shape, other.shape)
    a = jnp.broadcast_to(self, shape)
    b = jnp.broadcast_to(other, shape)
    return jnp.cross(a, b, axis=dim)


# ----------------------------------------------------------------------------- distances


def _use_mm(p, compute_mode, r1, r2):
    if p != 2:
        return False
    if compute_mode is None or compute_mode == 0:
        return r1 > 25 or r2 > 25
    return compute_mode == 1


def _euclid_mm(x1, x2):
    n1 = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    n2 = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    g = jnp.matmul(x1, jnp.swapaxes(x2, -1, -2), precision=HIGHEST)
    d2 = n1 - 2 * g + jnp.swapaxes(n2, -1, -2)
    return jnp.sqrt(jnp.clip(d2, 0, None))


@lower(aten._euclidean_dist.default)
def euclidean_dist(x1, x2):
    return _euclid_mm(x1, x2)


@lower(aten._cdist_forward.default, static=("p",))
def cdist_forward(x1, x2, p, compute_mode):
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    if x1.shape[-1] == 0:
        return jnp.zeros(batch + (x1.shape[-2], x2.shape[-2]), x1.dtype)
    if _use_mm(p, compute_mode, x1.shape[-2], x2.shape[-2]):
        return _euclid_mm(x1, x2)
    d = jnp.abs(x1[..., :, None, :] - x2[..., None, :, :])
    if p == 0:
        return jnp.sum(d != 0, axis=-1).astype(x1.dtype)
    if p == float("inf"):
        return jnp.max(d, axis=-1)
    if p == 1:
        return jnp.sum(d, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(d * d, axis=-1))
    return jnp.sum(d**p, axis=-1) ** (1.0 / p)


@lower(aten._cdist_backward.default, static=("p",))
def cdist_backward(grad, x1, x2, p, cdist):
    batch = cdist.shape[:-2]
    x1b = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2b = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    diff = x1b[..., :, None, :] - x2b[..., None, :, :]
    dist = cdist[..., None]
    g = grad[..., None]
    if p == 0:
        out = jnp.zeros_like(diff)
    elif p == 1:
        out = jnp.sign(diff)
    elif p == float("inf"):
        out = jnp.sign(diff) * (jnp.abs(diff) == dist)
    elif p == 2:
        out = jnp.where(dist == 0, 0, diff / jnp.where(dist == 0, 1, dist))
    elif p < 2:
        ad = jnp.abs(diff)
        out = jnp.where(
            (dist == 0) | (ad == 0), 0, jnp.sign(diff) * ad ** (p - 1) / jnp.where(dist == 0, 1, dist) ** (p - 1)
        )
    else:
        out = jnp.where(dist == 0, 0, diff * jnp.abs(diff) ** (p - 2) / jnp.where(dist == 0, 1, dist) ** (p - 1))
    res = jnp.sum(out * g, axis=-2)
    if res.shape != x1.shape:  # x1 was broadcast over the batch: reduce back
        lead = res.ndim - x1.ndim
        res = jnp.sum(res, axis=tuple(range(lead))) if lead else res
        axes = tuple(i for i, (a, b) in enumerate(zip(res.shape, x1.shape)) if a != b)
        res = jnp.sum(res, axis=axes, keepdims=True) if axes else res
    return res


@lower(aten.dist.default, static=("p",))
def dist(self, other, p=2):
    # the p-norm of the broadcast difference; p is static (its value picks the formula)
    diff = jnp.abs(self - other).astype(jnp.result_type(self, other))
    p = float(p)
    if p == 0:
        return jnp.sum(diff != 0).astype(diff.dtype)
    if p == float("inf"):
        return jnp.max(diff, initial=0).astype(diff.dtype)
    if p == float("-inf"):
        return jnp.min(diff, initial=float("inf")).astype(diff.dtype)
    return jnp.sum(diff**p) ** (1.0 / p)


@lower(aten._pdist_forward.default, static=("p",))
def pdist_forward(self, p=2.0):
    # the upper triangle of cdist(x, x), computed from differences as CPU does (never the matmul form)
    n = self.shape[0]
    rows, cols = np.triu_indices(n, 1)
    return cdist_forward(self, self, p, 2)[rows, cols]


@lower(aten._pdist_backward.default, static=("p",))
def pdist_backward(grad, self, p, pdist):
    # a pair's gradient reaches both rows with opposite signs: the gradient of cdist(x, x) with
    # the pair's gradient and distance on both sides of the diagonal
    n = self.shape[0]
    rows, cols = np.triu_indices(n, 1)
    g = jnp.zeros((n, n), grad.dtype).at[rows, cols].set(grad).at[cols, rows].set(grad)
    d = jnp.zeros((n, n), pdist.dtype).at[rows, cols].set(pdist).at[cols, rows].set(pdist)
    return cdist_backward(g, self, self, p, d)


@lower(aten._trilinear.default)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    # bilinear's contraction: each input gets size-1 dims at its expand positions, the three
    # broadcast products are summed over sumdim (which leaves the result)
    def expanded(x, dims):
        for d in sorted(dims):
            x = jnp.expand_dims(x, d)
        return x

    prod = expanded(i1, expand1) * expanded(i2, expand2) * expanded(i3, expand3)
    return jnp.sum(prod, axis=tuple(sumdim)) if sumdim else prod


# ----------------------------------------------------------------------------- LU family


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x))


def _lu(A):
    """(LU, 1-based int32 pivots, permutation) with A[perm] = L @ U."""
    lu, piv, perm = lax.linalg.lu(A)
    return lu, (piv + 1).astype(jnp.int32), perm


def _diag(x):
    return jnp.diagonal(x, axis1=-2, axis2=-1)


def _singular_info(lu):
    """LAPACK's info for getrf: 1 + the first zero diagonal entry of U, else 0."""
    d = _diag(lu)
    zero = d == 0
    first = jnp.argmax(zero, axis=-1) + 1
    return jnp.where(jnp.any(zero, axis=-1), first, 0).astype(jnp.int32)


def _perm_parity_sign(piv, dtype):
    k = piv.shape[-1]
    swaps = jnp.sum(piv != jnp.arange(1, k + 1, dtype=piv.dtype), axis=-1)
    return jnp.where(swaps % 2 == 0, 1, -1).astype(dtype)


def _permute_rows(b, perm):
    return jnp.take_along_axis(b, jnp.broadcast_to(perm[..., :, None], perm.shape + (b.shape[-1],)), axis=-2)


def _lu_solve_perm(lu, perm, B, adjoint=False):
    """Solve A X = B (or A^H X = B) from A[perm] = L U."""
    batch = jnp.broadcast_shapes(lu.shape[:-2], B.shape[:-2])
    lu = jnp.broadcast_to(lu, batch + lu.shape[-2:])
    B = jnp.broadcast_to(B, batch + B.shape[-2:])
    perm = jnp.broadcast_to(perm, batch + perm.shape[-1:])
    if not adjoint:
        y = _permute_rows(B, perm)
        y = lax.linalg.triangular_solve(lu, y, left_side=True, lower=True, unit_diagonal=True)
        return lax.linalg.triangular_solve(lu, y, left_side=True, lower=False)
    # A^H = U^H L^H P^T  ->  X = P L^-H U^-H B
    y = lax.linalg.triangular_solve(lu, B, left_side=True, lower=False, transpose_a=True, conjugate_a=True)
    y = lax.linalg.triangular_solve(
        lu, y, left_side=True, lower=True, unit_diagonal=True, transpose_a=True, conjugate_a=True
    )
    inv = jnp.argsort(perm, axis=-1)
    return _permute_rows(y, inv)


def _pivots_to_perm(pivots, m):
    return lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)


@lower(aten.linalg_lu_factor_ex.default)
def lu_factor_ex(A, pivot=True, check_errors=False):
    if not pivot:
        raise RuntimeError(
            "linalg.lu_factor: LU without pivoting is not implemented on the tpu device; call it with pivot=True"
        )
    lu, piv, _ = _lu(A)
    return lu, piv, _singular_info(lu) * (A.shape[-1] == A.shape[-2])


@lower(aten.linalg_lu.default)
def linalg_lu(A, pivot=True):
    if not pivot:
        raise RuntimeError(
            "linalg.lu: LU without pivoting is not implemented on the tpu device; call it with pivot=True"
        )
    lu, piv, perm = _lu(A)
    m, n = A.shape[-2:]
    k = min(m, n)
    L = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=A.dtype)
    U = jnp.triu(lu[..., :k, :])
    P = _mT(jax.nn.one_hot(perm, m, dtype=A.dtype))
    return P, L, U


@lower(aten.lu_unpack.default)
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    m, n = LU_data.shape[-2:]
    k = min(m, n)
    dt = LU_data.dtype
    if unpack_data:
        L = jnp.tril(LU_data[..., :, :k], -1) + jnp.eye(m, k, dtype=dt)
        U = jnp.triu(LU_data[..., :k, :])
    else:
        L = U = jnp.zeros((0,), dt)
    if unpack_pivots:
        perm = _pivots_to_perm(LU_pivots, m)
        P = _mT(jax.nn.one_hot(perm, m, dtype=dt))
    else:
        P = jnp.zeros((0,), dt)
    return P, L, U


@lower(aten.linalg_lu_solve.default)
def linalg_lu_solve(LU, pivots, B, left=True, adjoint=False):
    perm = _pivots_to_perm(pivots, LU.shape[-1])
    if left:
        return _lu_solve_perm(LU, perm, B, adjoint)
    # X A = B  <=>  A^H X^H = B^H ;  X A^H = B  <=>  A X^H = B^H
    return _mH(_lu_solve_perm(LU, perm, _mH(B), not adjoint))


def _det_operand(A):
    # PyTorch factors A^T for real inputs (a row-major buffer read column-major), A itself for
    # complex ones; the backward formulas consume that LU, so return the same one.
    return A if jnp.iscomplexobj(A) else _mT(A)


@lower(aten._linalg_det.default)
def linalg_det(A):
    if A.shape[-1] == 0:
        b = A.shape[:-2]
        return jnp.ones(b, A.dtype), A, jnp.zeros(b + (0,), jnp.int32)
    lu, piv, _ = _lu(_det_operand(A))
    det = jnp.prod(_diag(lu), axis=-1) * _perm_parity_sign(piv, A.dtype)
    return det, lu, piv


@lower(aten._linalg_slogdet.default)
def linalg_slogdet(A):
    b = A.shape[:-2]
    if A.shape[-1] == 0:
        return jnp.ones(b, A.dtype), jnp.zeros(b, jnp.real(A).dtype), A, jnp.zeros(b + (0,), jnp.int32)
    lu, piv, _ = _lu(_det_operand(A))
    d = _diag(lu)
    ad = jnp.abs(d)
    logabs = jnp.sum(jnp.log(ad), axis=-1)
    parity = _perm_parity_sign(piv, A.dtype)
    if jnp.iscomplexobj(A):
        sign = jnp.prod(d / jnp.where(ad == 0, 1, ad), axis=-1) * parity
        sign = jnp.where(jnp.any(ad == 0, axis=-1), 0, sign)
    else:
        sign = jnp.prod(jnp.sign(d), axis=-1) * parity
    return sign, logabs, lu, piv


@lower(aten.linalg_inv_ex.default)
def linalg_inv_ex(A, check_errors=False):
    n = A.shape[-1]
    if n == 0:
        return A, jnp.zeros(A.shape[:-2], jnp.int32)
    lu, _, perm = _lu(A)
    eye = jnp.broadcast_to(jnp.eye(n, dtype=A.dtype), A.shape)
    return _lu_solve_perm(lu, perm, eye), _singular_info(lu)


def _vector_case(A, B):
    return B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])


@lower(aten._linalg_solve_ex.default)
def linalg_solve_ex(A, B, left=True, check_errors=False):
    vec = _vector_case(A, B)
    Bm = B[..., None] if vec else B
    lu, piv, perm = _lu(A)
    info = _singular_info(lu)
    if left:
        X = _lu_solve_perm(lu, perm, Bm)
    else:
        X = _mH(_lu_solve_perm(lu, perm, _mH(Bm), adjoint=True))
    if vec:
        X = X[..., 0]
    return X, lu, piv, info


@lower(aten.linalg_solve.default)
def linalg_solve(A, B, left=True):
    return linalg_solve_ex(A, B, left)[0]


@lower(aten._linalg_check_errors.default, jit=False)
def linalg_check_errors(info, api_name, is_matrix):
    if isinstance(info, jax.core.Tracer):
        return None  # inside a compiled program: errors cannot be raised, like CUDA's async checks
    info = np.asarray(info)
    if info.size == 0 or not np.any(info != 0):
        return None
    flat = info.reshape(-1)
    idx = int(np.nonzero(flat)[0][0])
    code = int(flat[idx])
    where = f"(Batch element {idx}): " if info.ndim > 0 and info.size > 0 and not (is_matrix and info.ndim == 0) else ""
    if info.ndim == 0:
        where = ""
    if code < 0:
        raise RuntimeError(
            f"{api_name}: {where}Argument {-code} has illegal value. Most certainly there is a bug "
            "in the implementation calling the backend library."
        )
    if "cholesky" in api_name:
        raise torch_linalg_error(
            f"{api_name}: {where}The factorization could not be completed because the input "
            f"is not positive-definite (the leading minor of order {code} is not positive-definite)."
        )
    if "solve" in api_name:
        raise torch_linalg_error(f"{api_name}: {where}The solver failed because the input matrix is singular.")
    if "inv" in api_name or "lu" in api_name:
        raise torch_linalg_error(
            f"{api_name}: {where}The diagonal element {code} is zero, the "
            f"{'inversion' if 'inv' in api_name else 'solve'} could not be completed because "
            "the input matrix is singular."
        )
    raise torch_linalg_error(f"{api_name}: {where}The algorithm failed to converge (error code {code}).")


def torch_linalg_error(msg):
    import torch

    return torch._C._LinAlgError(msg)


# ----------------------------------------------------------------------------- Cholesky


def _cholesky_lower(A, upper):
    # PyTorch reads only the triangle it is told to; lax reads the lower triangle.
    src = _mH(A) if upper else A
    L = lax.linalg.cholesky(src, symmetrize_input=False)
    return jnp.tril(L)


def _chol_info(L):
    d = _diag(L)
    bad = ~jnp.isfinite(d) | (jnp.real(d) <= 0) if d.shape[-1] else jnp.zeros(d.shape, bool)
    first = jnp.argmax(bad, axis=-1) + 1 if d.shape[-1] else jnp.zeros(d.shape[:-1], jnp.int32)
    return jnp.where(jnp.any(bad, axis=-1), first, 0).astype(jnp.int32)


@lower(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(self, upper=False, check_errors=False):
    if self.shape[-1] == 0:
        return self, jnp.zeros(self.shape[:-2], jnp.int32)
    L = _cholesky_lower(self, upper)
    info = _chol_info(L)
    return (_mH(L) if upper else L), info


@lower(aten.cholesky.default)
def cholesky(self, upper=False):
    return linalg_cholesky_ex(self, upper)[0]


def _chol_factor_solve(L, B):
    """Solve (L L^H) X = B for lower-triangular L."""
    batch = jnp.broadcast_shapes(L.shape[:-2], B.shape[:-2])
    L = jnp.broadcast_to(L, batch + L.shape[-2:])
    B = jnp.broadcast_to(B, batch + B.shape[-2:])
    y = lax.linalg.triangular_solve(L, B, left_side=True, lower=True)
    return lax.linalg.triangular_solve(L, y, left_side=True, lower=True, transpose_a=True, conjugate_a=True)


@lower(aten.cholesky_solve.default, aten._cholesky_solve_helper.default)
def cholesky_solve(self, input2, upper=False):
    L = _mH(jnp.triu(input2)) if upper else jnp.tril(input2)
    return _chol_factor_solve(L, self)


@lower(aten.cholesky_inverse.default)
def cholesky_inverse(self, upper=False):
    n = self.shape[-1]
    L = _mH(jnp.triu(self)) if upper else jnp.tril(self)
    eye = jnp.broadcast_to(jnp.eye(n, dtype=self.dtype), self.shape)
    return _chol_factor_solve(L, eye)


# ----------------------------------------------------------------------------- triangular solves


def _tri_solve(A, B, upper, left, unit, transpose=False):
    batch = jnp.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    A = jnp.broadcast_to(A, batch + A.shape[-2:])
    B = jnp.broadcast_to(B, batch + B.shape[-2:])
    dt = jnp.result_type(A, B)
    A = jnp.triu(A) if upper else jnp.tril(A)
    if B.size == 0 or A.size == 0:
        return jnp.zeros(B.shape, dt)
    return lax.linalg.triangular_solve(
        A.astype(dt), B.astype(dt), left_side=left, lower=not upper, transpose_a=transpose, unit_diagonal=unit
    )


@lower(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(self, B, upper, left=True, unitriangular=False):
    return _tri_solve(self, B, upper, left, unitriangular)


@lower(aten.triangular_solve.default)
def triangular_solve(self, A, upper=True, transpose=False, unitriangular=False):
    X = _tri_solve(A, self, upper, True, unitriangular, transpose)
    batch = jnp.broadcast_shapes(A.shape[:-2], self.shape[:-2])
    return X, jnp.broadcast_to(A, batch + A.shape[-2:])


# ----------------------------------------------------------------------------- spectral


@lower(aten._linalg_svd.default)
def linalg_svd(A, full_matrices=False, compute_uv=True, driver=None):
    if not compute_uv:
        S = jnp.linalg.svd(A, compute_uv=False)
        return jnp.zeros((0,), A.dtype), S, jnp.zeros((0,), A.dtype)
    U, S, Vh = jnp.linalg.svd(A, full_matrices=full_matrices)
    return U, S, Vh


@lower(aten.linalg_qr.default)
def linalg_qr(A, mode="reduced"):
    if mode == "r":
        R = jnp.linalg.qr(A, mode="r")
        return jnp.zeros((0,), A.dtype), R
    Q, R = jnp.linalg.qr(A, mode=mode)
    return Q, R


@lower(aten._linalg_eigh.default)
def linalg_eigh(A, UPLO="L", compute_v=True):
    v, w = lax.linalg.eigh(A, lower=(UPLO == "L"), symmetrize_input=False)
    if not compute_v:
        return w, jnp.zeros((0,), A.dtype)
    return w, v


def _host_eig(a):
    w, v = np.linalg.eig(a)
    return w, v


@lower(aten.linalg_eig.default)
def linalg_eig(self):
    cdt = jnp.result_type(self.dtype, jnp.complex64)
    if jax.default_backend() == "cpu":
        w, v = jnp.linalg.eig(self)
        return w.astype(cdt), v.astype(cdt)
    # XLA has no nonsymmetric eigensolver on TPU: compute it on the host.
    shapes = (jax.ShapeDtypeStruct(self.shape[:-1], cdt), jax.ShapeDtypeStruct(self.shape, cdt))
    w, v = jax.pure_callback(lambda a: tuple(x.astype(cdt) for x in _host_eig(np.asarray(a))), shapes, self)
    return w, v


@lower(aten.linalg_eigvals.default)
def linalg_eigvals(self):
    return linalg_eig(self)[0]


def _lapack(routine, dtype):
    import scipy.linalg.lapack

    prefix = {np.float32: "s", np.float64: "d", np.complex64: "c", np.complex128: "z"}[np.dtype(dtype).type]
    return getattr(scipy.linalg.lapack, prefix + routine)


def _host_ldl_factor(a, hermitian):
    # LAPACK's Bunch-Kaufman factorisation, the one PyTorch's CPU and CUDA kernels call (lower
    # triangle; 1-based pivots, negative for 2x2 blocks). XLA has none.
    complex_herm = hermitian and np.iscomplexobj(a)
    factor = _lapack("hetrf" if complex_herm else "sytrf", a.dtype)
    n = a.shape[-1]
    flat = a.reshape(-1, n, n)
    ld, piv, info = np.empty_like(flat), np.empty(flat.shape[:-1], np.int32), np.empty(len(flat), np.int32)
    for i, m in enumerate(flat):
        ldu, ipiv, inf = factor(m, lower=1)
        ld[i], piv[i], info[i] = np.tril(ldu), ipiv, inf
    return ld.reshape(a.shape), piv.reshape(a.shape[:-1]), info.reshape(a.shape[:-2])


@lower(aten.linalg_ldl_factor_ex.default)
def linalg_ldl_factor_ex(self, hermitian=False, check_errors=False):
    if self.shape[-1] == 0:
        return self, jnp.zeros(self.shape[:-1], jnp.int32), jnp.zeros(self.shape[:-2], jnp.int32)
    shapes = (
        jax.ShapeDtypeStruct(self.shape, self.dtype),
        jax.ShapeDtypeStruct(self.shape[:-1], jnp.int32),
        jax.ShapeDtypeStruct(self.shape[:-2], jnp.int32),
    )
    return jax.pure_callback(lambda a: _host_ldl_factor(np.asarray(a), hermitian), shapes, self)


def _host_ldl_solve(ld, pivots, b, hermitian):
    complex_herm = hermitian and np.iscomplexobj(ld)
    solve = _lapack("hetrs" if complex_herm else "sytrs", ld.dtype)
    n = ld.shape[-1]
    batch = np.broadcast_shapes(ld.shape[:-2], pivots.shape[:-1], b.shape[:-2])
    ld = np.broadcast_to(ld, batch + ld.shape[-2:]).reshape(-1, n, n)
    pivots = np.broadcast_to(pivots, batch + pivots.shape[-1:]).reshape(-1, n)
    bb = np.broadcast_to(b, batch + b.shape[-2:]).reshape(-1, *b.shape[-2:])
    out = np.empty_like(bb)
    for i in range(len(ld)):
        out[i] = solve(ld[i], pivots[i], bb[i], lower=1)[0]
    return out.reshape(batch + b.shape[-2:])


@lower(aten.linalg_ldl_solve.default)
def linalg_ldl_solve(LD, pivots, B, hermitian=False):
    batch = jnp.broadcast_shapes(LD.shape[:-2], pivots.shape[:-1], B.shape[:-2])
    shape = jax.ShapeDtypeStruct(batch + B.shape[-2:], jnp.result_type(LD, B))
    if LD.shape[-1] == 0 or B.shape[-1] == 0:
        return jnp.zeros(shape.shape, shape.dtype)
    return jax.pure_callback(
        lambda ld, p, b: _host_ldl_solve(np.asarray(ld), np.asarray(p), np.asarray(b), hermitian).astype(shape.dtype),
        shape,
        LD,
        pivots,
        B,
    )


@lower(aten.linalg_matrix_exp.default)
def matrix_exp(self):
    if self.shape[-1] == 0:
        return self
    return jsl.expm(self)


@lower(aten.linalg_lstsq.default)
def linalg_lstsq(self, b, rcond=None, driver=None):
    A = self
    m, n = A.shape[-2:]
    vec = b.ndim == A.ndim - 1
    B = b[..., None] if vec else b
    dt = jnp.result_type(A, B)
    A = A.astype(dt)
    B = B.astype(dt)
    batch = jnp.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    A = jnp.broadcast_to(A, batch + A.shape[-2:])
    B = jnp.broadcast_to(B, batch + B.shape[-2:])
    rdt = jnp.real(jnp.zeros((), dt)).dtype
    U, S, Vh = jnp.linalg.svd(A, full_matrices=False)
    if rcond is None:
        rcond = float(jnp.finfo(rdt).eps) * max(m, n)
    smax = jnp.max(S, axis=-1, keepdims=True) if S.shape[-1] else jnp.zeros(S.shape[:-1] + (1,), rdt)
    keep = S > rcond * smax
    sinv = jnp.where(keep, 1 / jnp.where(keep, S, 1), 0)
    X = _mH(Vh) @ (sinv[..., :, None] * (_mH(U) @ B))
    rank = jnp.sum(keep, axis=-1).astype(jnp.int64)
    drv = driver or "gelsy"
    if drv in ("gelsd", "gelss", "gels") and m > n:
        R = A @ X - B
        residuals = jnp.sum(jnp.abs(R) ** 2, axis=-2)
    else:
        residuals = jnp.zeros((0,), rdt)
    if vec:
        X = X[..., 0]
        if residuals.ndim:
            residuals = residuals[..., 0] if residuals.shape[-1] and residuals.ndim > 1 else residuals
    if drv == "gels":
        rank = jnp.zeros((0,), jnp.int64)
    sv = S if drv in ("gelsd", "gelss") else jnp.zeros((0,), rdt)
    return X, residuals, rank, sv


@lower(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(self, atol=None, rtol=None, hermitian=False):
    m, n = self.shape[-2:]
    rdt = jnp.real(jnp.zeros((), self.dtype)).dtype
    if self.size == 0:
        return jnp.zeros(self.shape[:-2] + (n, m), self.dtype)
    if hermitian:
        v, w = lax.linalg.eigh(self, lower=True, symmetrize_input=False)
        S = jnp.abs(w)
    else:
        U, S, Vh = jnp.linalg.svd(self, full_matrices=False)
    smax = jnp.max(S, axis=-1, keepdims=True)
    if atol is None and rtol is None:
        thresh = float(jnp.finfo(rdt).eps) * max(m, n) * smax
    else:
        a = jnp.zeros((), rdt) if atol is None else jnp.asarray(atol, rdt)[..., None]
        r = jnp.zeros((), rdt) if rtol is None else jnp.asarray(rtol, rdt)[..., None]
        thresh = jnp.maximum(a, r * smax)
    keep = S > thresh
    if hermitian:
        winv = jnp.where(keep, 1 / jnp.where(keep, w, 1), 0).astype(self.dtype)
        return (v * winv[..., None, :]) @ _mH(v)
    sinv = jnp.where(keep, 1 / jnp.where(keep, S, 1), 0).astype(self.dtype)
    return jnp.matmul(_mH(Vh) * sinv[..., None, :], _mH(U), precision=HIGHEST)


# ----------------------------------------------------------------------------- Householder


@lower(aten.geqrf.default)
def geqrf(self):
    # geqrf is not re-exported by jax.lax.linalg; the primitive wrapper lives in jax._src.
    from jax._src.lax import linalg as _lax_linalg

    a, tau = _lax_linalg.geqrf(self)
    return a, tau


@lower(aten.linalg_householder_product.default)
def householder_product(input, tau):
    if tau.shape[-1] == 0:
        m, n = input.shape[-2:]
        return jnp.broadcast_to(jnp.eye(m, n, dtype=input.dtype), input.shape)
    return lax.linalg.householder_product(input, tau)


@lower(aten.ormqr.default)
def ormqr(self, input2, input3, left=True, transpose=False):
    m = self.shape[-2]
    k = input2.shape[-1]
    a = jnp.pad(self[..., :, :k], [(0, 0)] * (self.ndim - 1) + [(0, m - k)]) if k < m else self[..., :, :m]
    tau = jnp.pad(input2, [(0, 0)] * (input2.ndim - 1) + [(0, m - k)]) if k < m else input2[..., :m]
    Q = lax.linalg.householder_product(a, tau)
    if transpose:
        Q = _mH(Q)
    return jnp.matmul(Q, input3, precision=HIGHEST) if left else jnp.matmul(input3, Q, precision=HIGHEST)
