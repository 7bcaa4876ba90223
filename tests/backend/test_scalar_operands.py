"""A Python number beside a tpu tensor computes as PyTorch's CPU kernels compute it: traced numbers
are weak (they do not promote an integer tensor to float64), and a half-precision tensor multiplied
or divided by a number uses the number's float32 value, not its half-precision rounding."""

import pytest
import torch

import torchtpu

OPS = ("__add__", "__sub__", "__mul__", "__truediv__", "__radd__", "__rsub__", "__rmul__", "__rtruediv__")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("needs_grad", [False, True], ids=["no_grad", "grad"])
def test_half_precision_tensor_and_a_number_equal_cpu_bit_for_bit(dtype, needs_grad):
    base = torch.tensor([0.0, 1.0, -3.5, 1e-3, 100.0, 65000.0], dtype=dtype)
    for number in (2**40, 1e-3, 0.1, 3, -1e9, 1e5):
        for op in OPS:
            want = getattr(base, op)(number)
            t = base.to("tpu").requires_grad_(needs_grad)
            got = getattr(t, op)(number).detach().cpu()
            assert got.dtype == want.dtype, (op, number)
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"{dtype} {op} {number}")


def test_an_integer_tensor_and_a_float_number_compute_in_float32():
    # in float64, 16777217 * 3.0 rounds to 50331652; PyTorch converts 16777217 to float32 (16777216) first
    x = torch.tensor([16777217, 3, -7], dtype=torch.int64)
    for op in ("__mul__", "__add__", "__sub__"):
        want = getattr(x, op)(3.0)
        got = getattr(x.to("tpu"), op)(3.0).cpu()
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=op)


def test_pow_by_a_number_as_pytorch_computes_it():
    """The exponents PyTorch special-cases (2, 3, -1, -2, 0.5, ...) are folded into the program and
    computed as PyTorch computes them (x * x, not exp(2 log x)): integer powers bit for bit. Other exponents stay
    traced: a changing one does not recompile. 2 and 2.0 stay apart (an integer tensor's ** 2 is an
    integer, its ** 2.0 a float), and an integer tensor refuses a negative integer power."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(0)).abs() + 0.1
    xt = x.to("tpu")
    for e in (2, 2.0, 3, -1, -2, 0, 1):
        torch.testing.assert_close((xt**e).cpu(), x**e, rtol=0, atol=0, msg=str(e))
        torch.testing.assert_close(torch.pow(xt, e).cpu(), torch.pow(x, e), rtol=0, atol=0, msg=str(e))
    for e in (0.5, -0.5):  # XLA:CPU's square root is within an ulp of the exact one
        torch.testing.assert_close((xt**e).cpu(), x**e)
    w = x.clone().requires_grad_()
    wt = w.detach().to("tpu").requires_grad_()
    (w**2).sum().backward()
    (wt**2).sum().backward()
    torch.testing.assert_close(wt.grad.cpu(), w.grad, rtol=0, atol=0)
    i = torch.arange(-3, 5)
    for e in (2, 2.0, 3, 0.5, 1.5):
        got, want = (i.to("tpu") ** e).cpu(), i**e
        assert got.dtype == want.dtype, e
        torch.testing.assert_close(got, want, equal_nan=True)
    for e in (-1, -3):
        with pytest.raises(RuntimeError, match="Integers to negative integer powers are not allowed"):
            i.to("tpu") ** e
    xt**1.25
    torchtpu.reset_cache_stats()
    for e in (1.1, 1.7, 2.5, 4.0):
        torch.testing.assert_close((xt**e).cpu(), x**e)
    assert torchtpu.cache_stats()["misses"] == 0  # traced: one executable for every such exponent
