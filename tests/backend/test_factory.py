"""Factory functions with device="tpu" against CPU: values where deterministic, and always
shape, dtype and device."""

import pytest
import torch

import torchtpu  # noqa: F401

D = "tpu"


def check(t, ref, values=True):
    assert t.device.type == "tpu", t.device
    assert t.shape == ref.shape, (t.shape, ref.shape)
    assert t.dtype == ref.dtype, (t.dtype, ref.dtype)
    if values:
        torch.testing.assert_close(t.cpu(), ref, atol=1e-6, rtol=1e-6, equal_nan=True)


DTYPES = [None, torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_zeros_ones(dtype):
    check(torch.empty(2, 3, device=D, dtype=dtype), torch.empty(2, 3, dtype=dtype), values=False)
    check(torch.empty((0, 4), device=D, dtype=dtype), torch.empty((0, 4), dtype=dtype))
    check(torch.zeros(2, 3, device=D, dtype=dtype), torch.zeros(2, 3, dtype=dtype))
    check(torch.ones(4, device=D, dtype=dtype), torch.ones(4, dtype=dtype))
    check(torch.zeros((), device=D, dtype=dtype), torch.zeros((), dtype=dtype))


@pytest.mark.parametrize("value", [1.5, 3, True, -2])
def test_full(value):
    check(torch.full((2, 2), value, device=D), torch.full((2, 2), value))
    check(torch.full((3,), value, device=D, dtype=torch.float64), torch.full((3,), value, dtype=torch.float64))


@pytest.mark.parametrize(
    "args", [(5,), (2, 9), (-3, 10, 3), (10, -3, -3), (0, 1, 0.1), (1.5, 4), (0, 0), (0.0, 1.0, 0.3), (-1, 1, 0.25)]
)
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float64, torch.int64])
def test_arange(args, dtype):
    try:
        ref = torch.arange(*args, dtype=dtype)
    except (RuntimeError, ValueError):
        with pytest.raises((RuntimeError, ValueError)):
            torch.arange(*args, device=D, dtype=dtype)
        return
    check(torch.arange(*args, device=D, dtype=dtype), ref)


def test_arange_out_and_errors():
    out = torch.empty(0, device=D, dtype=torch.int32)
    torch.arange(4, out=out)
    check(out, torch.arange(4, dtype=torch.int32))
    with pytest.raises(RuntimeError):
        torch.arange(0, 10, -1, device=D)
    with pytest.raises(RuntimeError):
        torch.arange(0, 10, 0, device=D)


@pytest.mark.parametrize("args", [(0, 1, 5), (-2, 7, 1), (3, -3, 7), (0, 10, 0), (0.5, 1.5, 11), (0, 10, 4)])
@pytest.mark.parametrize("dtype", [None, torch.float64, torch.int64])
def test_linspace_logspace(args, dtype):
    check(torch.linspace(*args, device=D, dtype=dtype), torch.linspace(*args, dtype=dtype))
    if dtype is not torch.int64:
        check(torch.logspace(*args, device=D, dtype=dtype), torch.logspace(*args, dtype=dtype))
        check(torch.logspace(*args, base=2.0, device=D, dtype=dtype), torch.logspace(*args, base=2.0, dtype=dtype))


def test_linspace_tensor_bounds():
    s, e = torch.tensor(1.0), torch.tensor(4.0)
    check(torch.linspace(s.to(D), e.to(D), 7, device=D), torch.linspace(s, e, 7))
    check(torch.logspace(s.to(D), 2.0, 3, device=D), torch.logspace(s, 2.0, 3))


@pytest.mark.parametrize("shape", [(3,), (2, 5), (4, 1), (0,)])
@pytest.mark.parametrize("dtype", [None, torch.int64, torch.bool])
def test_eye(shape, dtype):
    check(torch.eye(*shape, device=D, dtype=dtype), torch.eye(*shape, dtype=dtype))


def test_rand_randn_randint():
    check(torch.rand(3, 4, device=D), torch.rand(3, 4), values=False)
    check(torch.rand(3, device=D, dtype=torch.float64), torch.rand(3, dtype=torch.float64), values=False)
    check(torch.randn(2, 2, device=D), torch.randn(2, 2), values=False)
    check(torch.randn(5, device=D, dtype=torch.bfloat16), torch.randn(5, dtype=torch.bfloat16), values=False)
    check(torch.randint(10, (4, 2), device=D), torch.randint(10, (4, 2)), values=False)
    check(
        torch.randint(-5, 5, (7,), device=D, dtype=torch.int32),
        torch.randint(-5, 5, (7,), dtype=torch.int32),
        values=False,
    )
    check(torch.randperm(6, device=D), torch.randperm(6), values=False)


@pytest.mark.parametrize("data", [[1, 2, 3], [[1.5, 2.0], [3.0, -1.0]], 7, [True, False], 2.5, [[]]])
def test_tensor(data):
    check(torch.tensor(data, device=D), torch.tensor(data))
    check(torch.as_tensor(data, device=D), torch.as_tensor(data))


def test_scalar_tensor_and_tri_indices():
    check(torch.scalar_tensor(3.5, device=D), torch.scalar_tensor(3.5))
    for args in [(3, 3), (4, 3, 1), (3, 5, -1), (0, 0)]:
        check(torch.tril_indices(*args, device=D), torch.tril_indices(*args))
        check(torch.triu_indices(*args, device=D), torch.triu_indices(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float16])
def test_like(dtype):
    base_cpu = torch.arange(6, dtype=dtype).reshape(2, 3)
    base = base_cpu.to(D)
    check(torch.zeros_like(base), torch.zeros_like(base_cpu))
    check(torch.ones_like(base), torch.ones_like(base_cpu))
    check(torch.full_like(base, 7), torch.full_like(base_cpu, 7))
    check(torch.empty_like(base), torch.empty_like(base_cpu), values=False)
    check(torch.zeros_like(base, dtype=torch.float64), torch.zeros_like(base_cpu, dtype=torch.float64))
    check(torch.full_like(base, 2.7, dtype=torch.int32), torch.full_like(base_cpu, 2.7, dtype=torch.int32))
    if dtype.is_floating_point:
        check(torch.rand_like(base), torch.rand_like(base_cpu), values=False)
        check(torch.randn_like(base), torch.randn_like(base_cpu), values=False)
    check(torch.randint_like(base, 5), torch.randint_like(base_cpu, 5), values=False)
    check(torch.randint_like(base, 2, 5), torch.randint_like(base_cpu, 2, 5), values=False)


def test_new():
    base_cpu = torch.ones(2, dtype=torch.float64)
    base = base_cpu.to(D)
    check(base.new_zeros((2, 3)), base_cpu.new_zeros((2, 3)))
    check(base.new_ones(4), base_cpu.new_ones(4))
    check(base.new_full((3,), 2.5), base_cpu.new_full((3,), 2.5))
    check(base.new_full((3,), 4, dtype=torch.int64), base_cpu.new_full((3,), 4, dtype=torch.int64))
    check(base.new_empty((5, 1)), base_cpu.new_empty((5, 1)), values=False)
    check(base.new_tensor([1.0, 2.0]), base_cpu.new_tensor([1.0, 2.0]))


def test_complex_polar():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    check(torch.complex(a.to(D), b.to(D)), torch.complex(a, b))
    check(torch.polar(a.to(D), b.to(D)), torch.polar(a, b))


def test_factory_on_second_device():
    if torch.tpu.device_count() < 2:
        pytest.skip("needs two tpu devices")
    t = torch.arange(5, device="tpu:1")
    assert t.device == torch.device("tpu", 1)
    check(t, torch.arange(5))
    e = torch.eye(2, device="tpu:1")
    assert e.device == torch.device("tpu", 1)


@pytest.mark.parametrize(
    "size,stride",
    [
        ((2, 3), (1, 2)),  # column-major
        ((2, 3, 4), (12, 1, 3)),  # a permuted layout
        ((4, 1, 3), (1, 1, 4)),  # a size-1 dim
        ((2, 3), (4, 1)),  # row gaps (padding)
        ((2, 3), (0, 1)),  # broadcast (stride 0)
        ((0, 3), (1, 1)),  # empty
        ((3,), (2,)),
    ],
)
def test_empty_strided_reports_its_strides(size, stride):
    t = torch.empty_strided(size, stride, device=D)
    ref = torch.empty_strided(size, stride)
    assert t.device.type == "tpu"
    assert t.shape == ref.shape and t.stride() == ref.stride() == stride
    assert t.is_contiguous() == ref.is_contiguous()
    assert (
        t.is_contiguous(memory_format=torch.channels_last) == ref.is_contiguous(memory_format=torch.channels_last)
        if t.dim() == 4
        else True
    )


def test_empty_strided_then_written_reads_like_cpu():
    src = torch.arange(24.0).reshape(2, 3, 4)
    for stride in ((12, 1, 3), (1, 2, 6), (12, 4, 1)):
        t = torch.empty_strided((2, 3, 4), stride, device=D).copy_(src)
        ref = torch.empty_strided((2, 3, 4), stride).copy_(src)
        assert t.stride() == ref.stride()
        torch.testing.assert_close(t.cpu(), ref)
        torch.testing.assert_close((t * 2 + 1).cpu(), ref * 2 + 1)
        # as_strided addresses memory: it must read the positions CPU's layout has there
        torch.testing.assert_close(t.as_strided((3, 2), (1, 5), 2).cpu(), ref.as_strided((3, 2), (1, 5), 2))
        t.as_strided((4,), (3,), 1).fill_(-1.0)
        ref.as_strided((4,), (3,), 1).fill_(-1.0)
        torch.testing.assert_close(t.cpu(), ref)


def test_empty_like_and_to_keep_a_dense_layout():
    x = torch.randn(3, 4).t()  # strides (1, 4)
    t = x.to(D)
    assert t.stride() == x.stride() and not t.is_contiguous()
    torch.testing.assert_close(t.cpu(), x)
    assert t.contiguous().is_contiguous() and t.contiguous().stride() == x.contiguous().stride()


def test_to_meta_of_unwritten_memory_allocates_nothing():
    """`t.to("meta")` takes the shape, dtype and strides only: memory made by torch.empty and never
    written stays unallocated (vLLM records every parameter as meta right after building a model,
    before torchtpu lays the parameters out over the tensor-parallel mesh)."""
    from torchtpu.backend.tensor import storage_of

    t = torch.empty(64, 32, device="tpu")
    m = t.to("meta")
    assert m.device.type == "meta" and m.shape == t.shape and m.dtype == t.dtype and m.stride() == t.stride()
    assert storage_of(t).array is None
    h = t.to("meta", dtype=torch.bfloat16)
    assert h.dtype == torch.bfloat16 and storage_of(t).array is None
    # a written tensor keeps its values
    w = torch.arange(6.0, device="tpu").reshape(2, 3)
    assert w.to("meta").shape == (2, 3)
    assert torch.equal(w.cpu(), torch.arange(6.0).reshape(2, 3))
