"""The strict eager hot paths: TpuTensor's Python operators (`+ - * /`) calling the dispatcher's
handler directly, and the dispatcher's path for functional ops with a cached executable. They
must mean what PyTorch's own route means, and step aside whenever a layer above the backend
(autograd, modes, transforms, autocast, the profiler, the compiler) has something to do.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchtpu
from torchtpu.backend import handlers
from torchtpu.backend.tensor import TpuTensor


def radd(a, b):
    return b + a  # a number or CPU tensor b: a's __radd__


def rmul(a, b):
    return b * a


OPS = [operator.add, operator.sub, operator.mul, operator.truediv, radd, rmul]
OTHERS = [1, -2.5, 0, "tensor", "int tensor", True, 3 + 1j, "cpu scalar"]


def _other(kind, device):
    if kind == "tensor":
        return torch.linspace(-2, 2, 6).reshape(2, 3).to(device)
    if kind == "int tensor":
        return torch.arange(1, 7).reshape(2, 3).to(device)
    if kind == "cpu scalar":
        return torch.tensor(2.0)
    return kind


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("other", OTHERS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
def test_operators_match_cpu(op, other, dtype):
    a = (torch.arange(6).reshape(2, 3) * 3 - 4).to(dtype)
    try:
        want = op(a, _other(other, "cpu"))
    except Exception as e:  # the same error on tpu
        with pytest.raises(type(e)):
            op(a.to("tpu"), _other(other, "tpu"))
        return
    for _ in range(2):  # the second call runs the executable the first one cached (the hot path)
        got = op(a.to("tpu"), _other(other, "tpu"))
        assert got.device.type == "tpu"
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.cpu(), want, equal_nan=True)


def test_operators_overflow_as_pytorch():
    with pytest.raises(OverflowError, match="int too big to convert"):
        torch.ones(3).to("tpu") + 2**70


def test_operators_record_gradients():
    w = torch.randn(3, requires_grad=True)
    wt = w.detach().to("tpu").requires_grad_()
    ((w * 2 - 1) / 3 + w).sum().backward()
    out = (wt * 2 - 1) / 3 + wt
    assert out.requires_grad and out.grad_fn is not None
    out.sum().backward()
    torch.testing.assert_close(wt.grad.cpu(), w.grad)
    with torch.no_grad():
        assert not (wt + 1).requires_grad


def test_operators_under_inference_mode():
    t = torch.ones(3).to("tpu")
    with torch.inference_mode():
        out = t + 1
    assert out.is_inference()
    assert not (t + 1).is_inference()


def test_operators_seen_by_dispatch_modes():
    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    t = torch.ones(3).to("tpu")
    with Log():
        t * 2
    assert torch.ops.aten.mul.Tensor in seen


def test_operators_seen_by_the_profiler():
    t = torch.ones(3).to("tpu")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t + 1
    assert any(e.name == "aten::add" for e in prof.events())


def test_operators_under_forward_ad():
    import torch.autograd.forward_ad as fwAD

    x = torch.randn(3)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x.to("tpu"), torch.ones(3).to("tpu"))
        out = dual * 3
        assert fwAD.unpack_dual(out).tangent is not None
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent.cpu(), torch.full((3,), 3.0))


def test_operators_recorded_by_the_jit_tracer():
    traced = torch.jit.trace(lambda x: x * 2 + 1, torch.ones(3).to("tpu"))
    assert "aten::mul" in str(traced.graph) and "aten::add" in str(traced.graph)


def test_operators_under_vmap():
    xs = torch.randn(4, 3)
    got = torch.func.vmap(lambda x: x * 2 + 1)(xs.to("tpu"))
    torch.testing.assert_close(got.cpu(), xs * 2 + 1)


def test_the_direct_route_is_taken_only_when_nothing_watches(monkeypatch):
    routed = []
    real = handlers._torch_dispatch

    def via_pytorch(cls, func, types, args=(), kwargs=None):
        routed.append(func)
        return real(cls, func, types, args, kwargs)

    monkeypatch.setattr(TpuTensor, "__torch_dispatch__", classmethod(via_pytorch))
    t = torch.ones(3).to("tpu")
    routed.clear()
    t + 1
    1 + t
    2.5 * t
    assert routed == []  # straight from the operator to the handler
    t.requires_grad_()
    t + 1
    assert routed == [torch.ops.aten.add.Tensor]  # autograd's route, through __torch_dispatch__


@pytest.mark.parametrize("mode", ["debug", "fused"])
def test_operators_in_the_other_eager_modes(mode):
    a = torch.randn(4)
    with torchtpu.eager_mode(mode):
        got = (a.to("tpu") + 1) * 2
        torch.testing.assert_close(got.cpu(), (a + 1) * 2)
    if mode == "debug":
        with torchtpu.eager_mode("debug"), pytest.raises(FloatingPointError, match="aten.div.Tensor produced Inf"):
            torch.ones(2).to("tpu") / 0


def test_the_pair_fast_path_flattens_as_flatten_does_and_matches_cpu():
    """`flatten_pair` is `flatten` for the dispatcher's commonest calls (a tpu base tensor with a
    tpu base tensor or a traced Python number), and steps aside (None) for every other call."""
    from torchtpu.backend.execute import flatten, flatten_pair

    a, b = torch.randn(2, 3), torch.randn(2, 3)
    ta, tb = a.to("tpu"), b.to("tpu")
    view = tb.t().t()  # a view: flatten reads it through its view steps
    for op, name in ((operator.add, "add"), (operator.sub, "sub"), (operator.mul, "mul"), (operator.truediv, "div")):
        func = getattr(torch.ops.aten, name).Tensor
        for other, cpu_other in ((tb, b), (2, 2), (-0.5, -0.5), (view, b)):
            for _ in range(2):  # the second call finds the executable the first one cached
                torch.testing.assert_close(op(ta, other).cpu(), op(a, cpu_other))
            plan = func._tpu_plan
            found = flatten_pair(plan, (ta, other))
            if other is view:
                assert found is None
                continue
            spec, kwspec, leaves = flatten(plan, (ta, other), {})
            assert found[0] == (spec, kwspec) and plan.executables.get(found[0]) is not None
            assert all(x is y for x, y in zip(found[1], leaves)) and len(found[1]) == len(leaves)
    add = torch.ops.aten.add.Tensor._tpu_plan
    assert flatten_pair(add, (view, tb)) is None
    assert flatten_pair(add, (ta, tb, 2)) is None  # the alpha argument: flatten's
    assert flatten_pair(add, (torch.tensor(2.0), tb)) is None  # a CPU tensor first


def test_signed_zero_and_nan_operands_are_not_confused():
    """Python numbers become cached device scalars; 0.0 and -0.0 are one dict key but not one
    operand (1 / -0.0 is -inf), so each must get its own, through the operators and through
    flatten alike."""
    a = torch.tensor([1.0, -2.0, 0.0])
    ta = a.to("tpu")
    for _ in range(2):
        for z in (0.0, -0.0):
            torch.testing.assert_close((ta / z).cpu(), a / z, equal_nan=True)
            torch.testing.assert_close((ta * z).cpu(), a * z, equal_nan=True)
            torch.testing.assert_close(torch.div(ta, z).cpu(), torch.div(a, z), equal_nan=True)
            torch.testing.assert_close(torch.copysign(ta, z).cpu(), torch.copysign(a, z))
    for c in (complex(1.0, 0.0), complex(1.0, -0.0)):
        torch.testing.assert_close(
            torch.sqrt(ta.to(torch.complex64) * 0 - c).cpu(), torch.sqrt(a.to(torch.complex64) * 0 - c)
        )
    nan = float("nan")
    assert torch.isnan((ta + nan).cpu()).all() and torch.isnan((ta * float("nan")).cpu()).all()
