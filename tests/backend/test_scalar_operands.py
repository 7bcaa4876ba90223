"""A Python number beside a tpu tensor computes as PyTorch's CPU kernels compute it: traced numbers
are weak (they do not promote an integer tensor to float64), and a half-precision tensor multiplied
or divided by a number uses the number's float32 value, not its half-precision rounding."""

import pytest
import torch

import torchtpu  # noqa: F401

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
