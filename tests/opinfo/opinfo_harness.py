"""Run PyTorch's OpInfo samples on tpu and compare with CPU.

Used by tests/opinfo/test_opinfo.py and by `python -m tests.opinfo.opinfo_harness [--backward] [names...]`,
which prints one line per OpInfo and the totals (the figures recorded in the README).
"""

from __future__ import annotations

import contextlib
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import torch  # noqa: E402
from torch.testing._internal import common_utils as _common_utils  # noqa: E402
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.testing._internal.opinfo import core as _opinfo_core  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_map  # noqa: E402

import torchtpu  # noqa: E402,F401

# PyTorch's sample iterators (TrackedInputIter, OpInfo's sample callback) look for the running
# unittest.TestCase by walking inspect.stack(), which reads the source line of every frame: about
# 40 ms a call under pytest's deep stacks, several calls per OpInfo. No TestCase runs the samples
# here, so the walk always returns None: return it without the walk.
for _module in (_opinfo_core, _common_utils):
    setattr(_module, "extract_test_fn", lambda: None)  # noqa: B010  (vulture reads an assignment as unused)

MAX_SAMPLES = int(os.environ.get("TORCHTPU_OPINFO_MAX_SAMPLES", "10"))
ATOL = 1e-4
RTOL = 1e-4

# Ops whose tensor arguments other than the input must stay on the CPU, as PyTorch requires
# of any device (tensor_split's indices_or_sections).
CPU_ARGUMENTS = {"tensor_split"}

# Ops whose output values are uninitialized memory ("Expected: empty is not comparable" in
# PyTorch's own suite): only shapes and dtypes are compared.
# Ops whose vectors are defined up to sign: compared after _sign_normalised.
SIGN_FREE_VECTORS = {"linalg.eigh"}

UNINITIALIZED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}


def float32_opinfos():
    return [o for o in op_db if o.supports_dtype(torch.float32, "cpu")]


def opinfo_id(o) -> str:
    return f"{o.name}.{o.variant_test_name}" if o.variant_test_name else o.name


def _to_tpu(x):
    if isinstance(x, torch.Tensor):
        t = x.detach().to("tpu")
        if x.requires_grad:
            t.requires_grad_()
        return t
    return x


def _to_cpu(x):
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _seed(seed: int) -> None:
    """`torch.manual_seed` on the two generators a sample reads, CPU's and tpu's. torch.manual_seed
    itself also seeds CUDA, XPU and MTIA, and on a build without them each of those queues a formatted
    copy of the caller's stack for an initialization that never comes: about 1.1 ms a call 70 frames
    deep (0.003 ms for these two), about 5% of the OpInfo tests' time at 7 seeds a sample."""
    torch.default_generator.manual_seed(seed)
    torch.tpu.manual_seed_all(seed)


def _samples(op, requires_grad):
    _seed(0)
    out = []
    for i, s in enumerate(op.sample_inputs("cpu", torch.float32, requires_grad=requires_grad)):
        if i >= MAX_SAMPLES:
            break
        out.append(s)
    return out


def _call(op, sample, convert):
    inp = tree_map(convert, sample.input)
    if convert is _to_tpu and op.name in CPU_ARGUMENTS:
        convert = _fresh_cpu
    args = tree_map(convert, sample.args)
    kwargs = tree_map(convert, sample.kwargs)
    out = op(inp, *args, **kwargs)
    if op.name in SIGN_FREE_VECTORS:
        out = _sign_normalised(out)
    return out, (inp, args, kwargs)


def _sign_normalised(out):
    """(values, vectors) with each vector's largest entry made positive: an eigenvector is
    defined up to its sign, and LAPACK and XLA pick differently. The sign is a constant for
    autograd, so gradients compare the same canonical function on both devices."""
    values, vectors = out
    largest = vectors.abs().argmax(dim=-2, keepdim=True)
    sign = vectors.gather(-2, largest).sign().detach()
    return values, vectors * sign


def _fresh_cpu(x):
    """A private copy of a CPU sample tensor, so ops that mutate their inputs (and the
    repeated calls below) always start from the sample's original values."""
    if isinstance(x, torch.Tensor):
        t = x.detach().clone()
        if x.requires_grad:
            t.requires_grad_()
        return t
    return x


class _IsolatedState:
    """Restores the global torch state a sample may change, whatever happens inside."""

    def __enter__(self):
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        return self

    def __exit__(self, *exc):
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        try:
            from torchtpu.backend import state

            state.STATE.trace_depth = 0
        except Exception:
            pass
        return False


@contextlib.contextmanager
def _seeded(op, seed):
    """Seed the global generator; for OpInfos that pin their own seed with PyTorch's
    `wrapper_set_seed` (dropout, cauchy_, ...), pin `seed` instead, so that two seeds tell
    random ops from deterministic ones."""
    _seed(seed)
    fn = op.op
    code = getattr(fn, "__code__", None)
    scope = getattr(fn, "__globals__", None)
    if code is None or scope is None or "wrapper_set_seed" not in code.co_names:
        yield
        return
    original = scope["wrapper_set_seed"]

    def with_seed(f, *args, **kwargs):
        state = torch.get_rng_state()
        try:
            _seed(seed)
            return f(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    scope["wrapper_set_seed"] = with_seed
    try:
        yield
    finally:
        scope["wrapper_set_seed"] = original


def _is_random(op, sample) -> bool:
    with _seeded(op, 1):
        a, _ = _call(op, sample, _fresh_cpu)
    with _seeded(op, 2):
        b, _ = _call(op, sample, _fresh_cpu)
    fa, _ = tree_flatten(a)
    fb, _ = tree_flatten(b)
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not torch.equal(x, y) and not (x.isnan().any()):
            return True
        if isinstance(x, torch.Tensor) and x.dtype in (torch.int64, torch.bool) and not torch.equal(x, y):
            return True
    return False


def _names_cpu(sample) -> bool:
    """Whether a sample asks for the CPU explicitly (`.to("cpu")`, `device="cpu"`): then a CPU
    output is what the op owes on any device."""
    flat, _ = tree_flatten((sample.args, sample.kwargs))
    return any(
        (isinstance(x, torch.device) and x.type == "cpu") or (isinstance(x, str) and x.startswith("cpu")) for x in flat
    )


def _output_device(e: torch.Tensor, sample) -> str:
    """The device a tpu call's output must be on, given CPU's output `e`."""
    if sample is not None and _names_cpu(sample):
        return e.device.type
    return "tpu" if e.device.type == "cpu" else e.device.type


def _compare(expected, actual, what, sample=None):
    """Every output: a tensor where CPU gives a tensor, on the device the op owes (tpu unless the
    sample names the CPU), with CPU's values; a Python number where CPU gives one; anything
    else equal."""
    fe, _ = tree_flatten(expected)
    fa, _ = tree_flatten(actual)
    if len(fe) != len(fa):
        raise AssertionError(f"{what}: {len(fa)} outputs, expected {len(fe)}")
    for i, (e, a) in enumerate(zip(fe, fa)):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise AssertionError(f"{what}: output {i} is {type(a).__name__} {a!r}, CPU gives a tensor")
            device = _output_device(e, sample)
            if a.device.type != device:
                raise AssertionError(f"{what}: output {i} is on {a.device}, expected on {device}")
            a = _to_cpu(a)
            torch.testing.assert_close(
                a,
                e,
                atol=ATOL,
                rtol=RTOL,
                equal_nan=True,
                check_device=False,
                check_stride=False,
                msg=lambda m: f"{what}: {m}",
            )
        elif isinstance(e, (int, float, bool, complex)):
            if isinstance(a, torch.Tensor) or not isinstance(a, (int, float, bool, complex)):
                raise AssertionError(f"{what}: output {i} is {type(a).__name__}, CPU gives {type(e).__name__} {e!r}")
            torch.testing.assert_close(a, e, atol=ATOL, rtol=RTOL, equal_nan=True, msg=lambda m: f"{what}: {m}")
        elif isinstance(a, torch.Tensor) or a != e:
            raise AssertionError(f"{what}: output {i} is {a!r}, CPU gives {e!r}")


def check_forward(op) -> None:
    """Raise (AssertionError or the op's own error) unless every sample matches CPU."""
    with _IsolatedState():
        for k, sample in enumerate(_samples(op, False)):
            _check_forward_sample(op, k, sample)


def _check_forward_sample(op, k, sample) -> None:
    _seed(0)
    try:
        expected, _ = _call(op, sample, _fresh_cpu)
    except Exception:
        return  # the sample itself is invalid on CPU
    try:
        actual, _ = _call(op, sample, _to_tpu)
    except Exception as e:
        raise _sample_error(k, e) from e
    _compare_forward(op, k, sample, expected, actual)


def _compare_forward(op, k, sample, expected, actual) -> None:
    """CPU's outputs against tpu's: values, or shapes and devices alone for a random or
    uninitialized output."""
    if op.name in UNINITIALIZED or _is_random(op, sample):
        fe, _ = tree_flatten(expected)
        fa, _ = tree_flatten(actual)
        if len(fe) != len(fa):
            raise AssertionError(f"sample {k}: {len(fa)} outputs, expected {len(fe)}")
        for i, (e, a) in enumerate(zip(fe, fa)):
            if isinstance(e, torch.Tensor):
                assert isinstance(a, torch.Tensor), f"sample {k}: output {i} is {type(a).__name__}, CPU gives a tensor"
                assert tuple(e.shape) == tuple(a.shape) and e.dtype == a.dtype, f"sample {k}: shape/dtype"
                device = _output_device(e, sample)
                assert a.device.type == device, f"sample {k}: output {i} is on {a.device}, expected on {device}"
        return
    _compare(expected, actual, f"sample {k}", sample)


def _sample_error(k, e):
    """The op's own exception, its message prefixed with the failing sample's number."""
    msg = f"sample {k}: {e}"
    try:
        new = type(e)(msg)
    except Exception:
        new = RuntimeError(msg)
    return new


def _grad_inputs(args_tree):
    flat, _ = tree_flatten(args_tree)
    return [x for x in flat if isinstance(x, torch.Tensor) and x.requires_grad]


def check_backward(op) -> None:
    """Raise unless every sample's input gradients match CPU's."""
    with _IsolatedState():
        for k, sample in enumerate(_samples(op, True)):
            _check_backward_sample(op, k, sample)


def _check_backward_sample(op, k, sample) -> None:
    try:
        expected_out, cpu_in = _call(op, sample, _fresh_cpu)
    except Exception:
        return
    outs = [o for o in tree_flatten(expected_out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs or _is_random(op, sample):
        return
    cpu_leaves = _grad_inputs(cpu_in)
    _seed(3)
    cots = [torch.randn_like(o) for o in outs]
    try:
        expected = torch.autograd.grad(outs, cpu_leaves, cots, allow_unused=True)
    except Exception:
        return
    try:
        actual_out, tpu_in = _call(op, sample, _to_tpu)
        touts = [o for o in tree_flatten(actual_out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        tpu_leaves = _grad_inputs(tpu_in)
        actual = torch.autograd.grad(touts, tpu_leaves, [c.to("tpu") for c in cots], allow_unused=True)
    except Exception as e:
        raise _sample_error(k, e) from e
    _compare(
        [e for e in expected if e is not None],
        [a for a, e in zip(actual, expected) if e is not None],
        f"sample {k} gradient",
    )


def check_both(op) -> dict:
    """Forward values and input gradients of an autograd OpInfo from one tpu run per sample:
    {"forward": error or None, "backward": error or None}, the first failing sample's error in each
    direction. The forward check sees the same samples as check_forward (made with requires_grad),
    the backward check the same as check_backward; running both on one tpu forward saves the op's
    forward compilations a second time. A sample CPU cannot run with grad (an in-place op on a leaf)
    is checked forward on detached inputs."""
    errors: dict = {"forward": None, "backward": None}
    with _IsolatedState():
        for k, sample in enumerate(_samples(op, True)):
            forward, backward = _check_both_sample(op, k, sample)
            errors["forward"] = errors["forward"] or forward
            errors["backward"] = errors["backward"] or backward
    return errors


def _check_both_sample(op, k, sample):
    """(forward error, backward error) of one sample; None where that direction passes or skips it."""
    _seed(0)
    try:
        expected_out, cpu_in = _call(op, sample, _fresh_cpu)
    except Exception:
        return _forward_error(op, k, sample.transform(_detached)), None
    try:
        actual_out, tpu_in = _call(op, sample, _to_tpu)
    except Exception as e:
        error = _sample_error(k, e)
        return error, error
    forward = None
    try:
        _compare_forward(op, k, sample, expected_out, actual_out)
    except Exception as e:
        forward = e
    try:
        backward = _gradient_error(op, k, sample, expected_out, cpu_in, actual_out, tpu_in)
    except Exception as e:
        backward = e
    return forward, backward


def _detached(x):
    return x.detach() if isinstance(x, torch.Tensor) else x


def _forward_error(op, k, sample):
    try:
        _check_forward_sample(op, k, sample)
    except Exception as e:
        return e
    return None


def _gradient_error(op, k, sample, expected_out, cpu_in, actual_out, tpu_in):
    outs = [o for o in tree_flatten(expected_out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs or _is_random(op, sample):
        return None
    _seed(3)
    cots = [torch.randn_like(o) for o in outs]
    try:
        expected = torch.autograd.grad(outs, _grad_inputs(cpu_in), cots, allow_unused=True)
    except Exception:
        return None
    try:
        touts = [o for o in tree_flatten(actual_out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        actual = torch.autograd.grad(touts, _grad_inputs(tpu_in), [c.to("tpu") for c in cots], allow_unused=True)
        _compare(
            [e for e in expected if e is not None],
            [a for a, e in zip(actual, expected) if e is not None],
            f"sample {k} gradient",
        )
    except AssertionError as e:
        return e
    except Exception as e:
        return _sample_error(k, e)
    return None


def main(argv):
    backward = "--backward" in argv
    names = [a for a in argv if not a.startswith("--")]
    ops = [o for o in float32_opinfos() if (not backward or o.supports_autograd)]
    if names:
        ops = [o for o in ops if opinfo_id(o) in names or o.name in names]
    passed, failed = 0, []
    for o in ops:
        try:
            (check_backward if backward else check_forward)(o)
            passed += 1
            print(f"PASS {opinfo_id(o)}", flush=True)
        except Exception as e:
            msg = str(e).strip().splitlines()
            failed.append(opinfo_id(o))
            print(f"FAIL {opinfo_id(o)}: {type(e).__name__}: {msg[0][:300] if msg else ''}", flush=True)
    total = passed + len(failed)
    print(
        f"{'backward' if backward else 'forward'}: {passed}/{total} OpInfos pass every sample "
        f"({100.0 * passed / max(total, 1):.1f}%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
