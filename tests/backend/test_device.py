"""The tpu device itself: registration, torch.tpu, transfers, dtypes, interop, caching, debug."""

import io
import os
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
import torch

import torchtpu

ALL_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def test_device_strings():
    assert torch.device("tpu").type == "tpu"
    assert torch.device("tpu:3").index == 3
    x = torch.ones(2).to("tpu")
    assert x.device == torch.device("tpu:0")
    assert x.is_cpu is False


def test_torch_tpu_module():
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() == 8
    torch.tpu.set_device(2)
    try:
        assert torch.tpu.current_device() == 2
    finally:
        torch.tpu.set_device(0)
    torch.tpu.synchronize()
    assert torch.bfloat16 in torch.tpu.get_amp_supported_dtype()
    assert isinstance(torch.tpu.memory_allocated(), int)
    with pytest.raises(RuntimeError, match="tpu:99 does not exist"):
        torch.tpu.set_device(99)


def test_what_device_agnostic_pytorch_reads_from_torch_tpu():
    """torch.utils.checkpoint, torch.random.fork_rng, DataLoader pinning and FSDP-style stream
    code read these from the device module, as they read them from torch.cuda."""
    assert torch.tpu._initialized and torch.tpu.is_initialized() and torch.tpu.is_bf16_supported()
    with torch.random.fork_rng(devices=[0], device_type="tpu"):
        forked = torch.rand(5, device="tpu").cpu()
    assert torch.equal(torch.rand(5, device="tpu").cpu(), forked)
    # a state set inside a compiled step cannot come from outside one (another key stream)
    state = torch.tpu.get_rng_state()
    step = torchtpu.compile(lambda x: (torch.tpu.set_rng_state(state), x + 1)[1])
    with pytest.raises(RuntimeError, match="taken outside a compiled step"):
        for _ in range(2):  # the first call runs eagerly
            step(torch.ones(2, device="tpu"))
    loader = torch.utils.data.DataLoader(torch.arange(6.0).reshape(3, 2), batch_size=2, pin_memory=True)
    batches = list(loader)
    assert all(b.is_pinned() for b in batches) and not torch.ones(2).is_pinned()
    torch.testing.assert_close(torch.cat(batches), torch.arange(6.0).reshape(3, 2))
    s = torch.tpu.current_stream()
    assert s.device == torch.device("tpu", 0) and s == torch.tpu.default_stream()
    with torch.tpu.stream(torch.tpu.Stream()):
        e = torch.tpu.Event()
        e.record()
    assert e.query()


def test_to_other_device_index():
    x = torch.arange(6.0).to("tpu:3")
    assert x.device == torch.device("tpu:3")
    assert list(torchtpu.to_jax(x).devices())[0] == jax.devices()[3]
    y = x * 2
    assert y.device == torch.device("tpu:3")
    torch.testing.assert_close(y.cpu(), torch.arange(6.0) * 2)


def test_factories_and_writes_on_another_device_live_there():
    """What an op makes for tpu:3 without reading an array of tpu:3 (a factory, `zeros_like`,
    an in-place fill) lives on that device's chip, as a tensor moved there does."""
    made = {
        "zeros": torch.zeros(4, device="tpu:3"),
        "full": torch.full((4,), 2.0, device="tpu:3"),
        "randn": torch.randn(4, device="tpu:3"),
        "zeros_like": torch.zeros_like(torch.arange(4.0).to("tpu:3")),
        "fill_": torch.empty(4, device="tpu:3").fill_(5.0),
        "empty": torch.empty(4, device="tpu:3"),  # read as the zeros it holds
    }
    for name, t in made.items():
        a = torchtpu.to_jax(t)
        assert t.device == torch.device("tpu:3") and a.devices() == {jax.devices()[3]} and a.committed, name
    torch.testing.assert_close(made["fill_"].cpu(), torch.full((4,), 5.0))
    with pytest.raises(RuntimeError, match="tpu:3 and tpu:2"):
        made["zeros"] + torch.zeros(4, device="tpu:2")


def test_an_op_on_two_devices_raises_pytorchs_error():
    """As on CUDA, an op whose tensors lie on two devices raises PyTorch's RuntimeError naming
    both, on every route an op takes (the `+` operator's own path, the dispatcher, a list
    argument, autograd)."""
    a, b = torch.arange(4.0).to("tpu:1"), torch.ones(4).to("tpu:2")
    want = r"Expected all tensors to be on the same device, but found at least two devices, tpu:1 and tpu:2"
    for op in (lambda: a + b, lambda: a @ b, lambda: torch.cat([a, b]), lambda: torch.add(a, b, alpha=2)):
        with pytest.raises(RuntimeError, match=want):
            op()
    w = a.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=want):
        w * b
    torch.testing.assert_close((a + b.to("tpu:1")).cpu(), torch.arange(4.0) + 1)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_round_trip_every_dtype(dtype):
    if dtype.is_floating_point or dtype.is_complex:
        src = torch.randn(3, 5).to(dtype)
    elif dtype == torch.bool:
        src = torch.rand(3, 5) > 0.5
    else:
        info = torch.iinfo(dtype)
        src = torch.randint(info.min, info.max, (3, 5), dtype=dtype)
    t = src.to("tpu")
    assert t.dtype == dtype and t.shape == src.shape
    back = t.cpu()
    assert back.device.type == "cpu" and back.dtype == dtype
    assert torch.equal(back, src)


def test_host_arrays_are_placed_as_jax_device_put_places_them():
    """place() puts NumPy arrays through XLA's transfer call: the array is jax.device_put's (dtype,
    uncommitted device, values), 64-bit types included and converted where they are turned off,
    and a later write to the CPU tensor it came from does not show."""
    from torchtpu.backend.tensor import place

    for a in (np.arange(12, dtype=np.int64).reshape(3, 4), np.linspace(0, 1, 7), np.ones((2, 0), np.float32)):
        for x64 in (True, False):
            with jax.enable_x64(x64):
                got, want = place(a, 0), jax.device_put(a)
                assert (got.dtype, got.shape, got.committed, got.sharding) == (
                    want.dtype,
                    want.shape,
                    want.committed,
                    want.sharding,
                )
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    src = torch.arange(4096.0)
    t = src.to("tpu")
    src.fill_(-1)
    assert t.sum().item() == sum(range(4096))


def test_integer_overflow_wraps_like_cpu():
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        info = torch.iinfo(dtype)
        src = torch.tensor([info.max, info.min], dtype=dtype)
        assert torch.equal((src.to("tpu") + 1).cpu(), src + 1), dtype


def test_bfloat16_and_half_rounding_match_cpu():
    src = torch.randn(1000)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(src.to("tpu").to(dtype).cpu(), src.to(dtype))
    big = torch.tensor([70000.0])
    assert torch.equal(big.to("tpu").half().cpu(), big.half())  # inf, as on CPU


def test_item_tolist_numpy_repr():
    t = torch.tensor([[1.5, 2.0], [3.0, -4.25]]).to("tpu")
    assert t[1, 1].item() == -4.25
    assert t.tolist() == [[1.5, 2.0], [3.0, -4.25]]
    np.testing.assert_array_equal(t.cpu().numpy(), np.array([[1.5, 2.0], [3.0, -4.25]], np.float32))
    with pytest.raises(TypeError, match=r"can't convert tpu:0 device type tensor to numpy. Use Tensor.cpu\(\)"):
        t.numpy()
    np.testing.assert_array_equal(t.numpy(force=True), t.cpu().numpy())
    r = repr(t)
    assert "device='tpu:0'" in r and "-4.2500" in r
    g = t.clone().requires_grad_()
    assert "requires_grad=True" in repr(g)
    assert "grad_fn=<MulBackward0>" in repr(g * 2)
    assert torch.tensor(True).to("tpu").item() is True
    assert torch.tensor(7).to("tpu").item() == 7


def test_model_to_tpu():
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    m.to("tpu")
    assert all(p.device.type == "tpu" for p in m.parameters())
    assert m[0].weight.requires_grad and m[0].weight.is_leaf


def test_save_load_with_map_location(tmp_path):
    t = torch.randn(4, 3).to("tpu")
    b = torch.randn(2).to(torch.bfloat16).to("tpu")
    path = tmp_path / "x.pt"
    torch.save({"t": t, "b": b}, path)
    on_cpu = torch.load(path, map_location="cpu")
    assert on_cpu["t"].device.type == "cpu"
    assert torch.equal(on_cpu["t"], t.cpu())
    assert on_cpu["b"].dtype == torch.bfloat16 and torch.equal(on_cpu["b"], b.cpu())
    on_tpu = torch.load(path)
    assert on_tpu["t"].device.type == "tpu"
    assert torch.equal(on_tpu["t"].cpu(), t.cpu())
    # a model state_dict round trip
    m = torch.nn.Linear(3, 2).to("tpu")
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, map_location="cpu")
    assert torch.equal(sd["weight"], m.weight.detach().cpu())


def test_jax_interop_zero_copy():
    a = jax.numpy.arange(6.0, dtype=jax.numpy.float32).reshape(2, 3)
    t = torchtpu.from_jax(a)
    assert t.device.type == "tpu" and t.shape == (2, 3) and t.dtype == torch.float32
    assert torchtpu.to_jax(t) is a
    u = t + 1
    np.testing.assert_array_equal(np.asarray(torchtpu.to_jax(u)), np.arange(6.0).reshape(2, 3) + 1)
    with pytest.raises(TypeError, match="tpu device"):
        torchtpu.to_jax(torch.ones(2))


def test_steady_state_loop_never_recompiles():
    x = torch.randn(8, 8).to("tpu")
    w = torch.randn(8, 8).to("tpu")

    def step(x, lr):
        y = torch.relu(x @ w) * lr
        return y.sum()

    step(x, 0.1)
    torchtpu.reset_cache_stats()
    for i in range(5):
        step(x, 0.1 * (i + 1))  # a changing Python scalar must not recompile
    stats = torchtpu.cache_stats()
    assert stats["misses"] == 0, stats
    assert stats["hits"] >= 10
    torchtpu.reset_cache_stats()
    step(torch.randn(4, 8).to("tpu"), 0.1)  # a new shape is a visible miss
    assert torchtpu.cache_stats()["misses"] >= 1


def test_dispatch_is_asynchronous(monkeypatch):
    # Eager ops wait once any device mesh exists on XLA's CPU devices (a process-wide switch that
    # an earlier sharded test in the same worker turns on); this test's arrays use one device.
    from torchtpu.backend.state import CONFIG

    monkeypatch.setattr(CONFIG, "sync_dispatch", False)
    x = torch.randn(1024, 1024).to("tpu") / 32
    (x @ x).cpu()  # compile first
    y = x
    for _ in range(30):  # ~64 GFLOP: seconds of work on this CPU
        y = y @ x
    result = torchtpu.to_jax(y)
    assert not result.is_ready(), "the op loop waited for the device"
    result.block_until_ready()
    assert result.is_ready()


def test_debug_mode_names_op_and_line():
    torchtpu.set_debug(True)
    try:
        x = torch.tensor([1.0, 0.0]).to("tpu")
        with pytest.raises(FloatingPointError) as e:
            x / 0.0 * 0.0  # 0/0 -> NaN
        msg = str(e.value)
        assert "aten." in msg and "test_device.py" in msg and "NaN" in msg
    finally:
        torchtpu.set_debug(False)


def test_unsupported_op_error_names_overload_and_fallback_works():
    from torchtpu.backend import fallback

    lib = torch.library.Library("torchtpu_test", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CPU")
    x = torch.arange(3.0).to("tpu")
    with pytest.raises(NotImplementedError, match="torchtpu_test.twice.default"):
        torch.ops.torchtpu_test.twice(x)
    torchtpu.set_cpu_fallback(True)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            y = torch.ops.torchtpu_test.twice(x)
            torch.ops.torchtpu_test.twice(x)
        assert y.device.type == "tpu"
        torch.testing.assert_close(y.cpu(), torch.arange(3.0) * 2)
        assert sum("CPU" in str(m.message) for m in w) == 1  # once per op
    finally:
        torchtpu.set_cpu_fallback(False)
        fallback.WARNED.clear()


def test_cpu_fallback_writes_back_mutated_tensor_lists():
    """An op that mutates a Tensor[] (a fused optimizer's parameters and moments) and a Tensor
    through the CPU fallback: every element and the tensor get the CPU kernel's values."""
    from torchtpu.backend import fallback

    def scale_all(xs, total, s):
        for x in xs:
            x.mul_(s)
        total.add_(sum(x.sum() for x in xs))

    lib = torch.library.Library("torchtpu_test_lists", "DEF")
    lib.define("scale_all_(Tensor(a!)[] xs, Tensor(b!) total, float s) -> ()")
    lib.impl("scale_all_", scale_all, "CPU")
    xs = [torch.arange(3.0), torch.ones(2, 2)]
    total = torch.zeros(())
    txs, ttotal = [x.to("tpu") for x in xs], total.to("tpu")
    torchtpu.set_cpu_fallback(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.ops.torchtpu_test_lists.scale_all_(txs, ttotal, 3.0)
    finally:
        torchtpu.set_cpu_fallback(False)
        fallback.WARNED.clear()
    torch.ops.torchtpu_test_lists.scale_all_(xs, total, 3.0)
    for got, want in zip(txs, xs, strict=True):
        assert torch.equal(got.cpu(), want)
    assert torch.equal(ttotal.cpu(), total)


def test_library_op_with_a_privateuse1_kernel_runs_it_and_foreach_copy():
    # FSDP2's copy-in/copy-out ops are such ops: their PrivateUse1 kernel is made of torch ops
    lib = torch.library.Library("torchtpu_test_pu1", "DEF")
    lib.define("scaled_copy(Tensor src, Tensor(a!) out) -> ()")

    def scaled_copy(src, out):
        out.copy_(src * 3)

    lib.impl("scaled_copy", scaled_copy, "PrivateUse1")
    out = torch.zeros(4, device="tpu")
    torch.ops.torchtpu_test_pu1.scaled_copy(torch.arange(4.0).to("tpu"), out)
    torch.testing.assert_close(out.cpu(), torch.arange(4.0) * 3)
    # _foreach_copy_ into views of one buffer (FSDP2's all-gather input), against CPU
    srcs = [torch.arange(3.0), torch.arange(5.0, dtype=torch.bfloat16)]
    for device in ("tpu", "cpu"):
        buf = torch.zeros(10, device=device)
        torch._foreach_copy_(list(torch.split(buf[1:9], [3, 5])), [t.to(device) for t in srcs])
        if device == "tpu":
            got = buf.cpu()
        else:
            torch.testing.assert_close(got, buf, rtol=0, atol=0)


def test_platform_and_no_libtpu_noise_on_cpu_host():
    assert torchtpu.platform() == "cpu"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TORCHTPU_PLATFORM")}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import gc, torch, torchtpu; print(torchtpu.platform()); print((torch.ones(2).to('tpu') + 1).cpu())\n"
            # the device loads with the collector paused, then freezes what the imports made, and turns
            # the collector back on; the program below ends with its objects collected at exit as usual
            "print('gc', gc.isenabled(), gc.get_freeze_count() > 100_000)\n"
            "step = torchtpu.compile(lambda x: (x * 2).sum())\n"
            "print(step(torch.ones(3, device='tpu')).item())",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["cpu", "tensor([2., 2.])", "gc True True", "6.0"], out.stdout
    assert "TPU_WORKER_HOSTNAMES" not in out.stderr and "libtpu" not in out.stderr.lower(), out.stderr
    assert "leaked" not in out.stderr, out.stderr  # nanobind's report of objects left alive at exit


def test_torchtpu_platform_env_is_validated():
    env = dict(os.environ, TORCHTPU_PLATFORM="quantum")
    env.pop("JAX_PLATFORMS", None)
    out = subprocess.run(
        [sys.executable, "-c", "import torchtpu"], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode != 0 and "TORCHTPU_PLATFORM='quantum'" in out.stderr


def test_manual_seed_reproducible():
    torch.manual_seed(123)
    a = torch.randn(5, device="tpu").cpu()
    torch.manual_seed(123)
    b = torch.randn(5, device="tpu").cpu()
    c = torch.randn(5, device="tpu").cpu()
    assert torch.equal(a, b) and not torch.equal(b, c)
    state = torch.tpu.get_rng_state()
    d = torch.rand(4, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    assert torch.equal(torch.rand(4, device="tpu").cpu(), d)


def test_index_bounds_checked_in_debug_mode():
    x = torch.arange(5.0).to("tpu")
    idx = torch.tensor([1, 7]).to("tpu")
    torchtpu.set_debug(True)
    try:
        with pytest.raises(IndexError, match="index 7 is out of bounds for dimension 0 with size 5"):
            x[idx]
    finally:
        torchtpu.set_debug(False)
    x[torch.tensor([1, 3]).to("tpu")]  # in range: fine in both modes


def test_programs_are_lowered_into_a_shared_mlir_context_renewed_after_a_bound(monkeypatch):
    """JAX would make (and load every dialect into) an MLIR context per program; torchtpu lowers
    programs into one context, renewed every MLIR_CONTEXT_PROGRAMS programs (torchtpu._platform),
    and the programs lowered so compute what they did: eager ops of new shapes, against CPU."""
    import jax
    import jax.numpy as jnp

    from torchtpu import _platform

    x = jnp.ones(3)
    contexts = [jax.jit(lambda a, i=i: a * i).lower(x).compiler_ir().context for i in range(3)]
    assert contexts[0] is contexts[1] is contexts[2]
    monkeypatch.setattr(_platform, "MLIR_CONTEXT_PROGRAMS", 0)  # the next program starts a new one
    assert jax.jit(lambda a: a + 5).lower(x).compiler_ir().context is not contexts[0]
    monkeypatch.undo()
    for n in (2, 5, 7):
        c = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
        torch.testing.assert_close((c.to("tpu").sin() * n).sum(0).cpu(), (c.sin() * n).sum(0))


# An evaluation loop's pattern: large batches moved to the device, a small result of each kept there.
_EVAL_LOOP = """
import torch, torchtpu
from torchtpu.backend.heap import rss_bytes
preds, rss = [], []
for i in range(120):
    preds.append(torch.randn(64, 3, 128, 128).to("tpu").amax((1, 2, 3)))  # 12.6 MB batches
    if i in (29, 119):
        rss.append(rss_bytes())
print(len(torch.cat(preds).cpu()), (rss[1] - rss[0]) // 2**20)
"""


def test_a_loop_keeping_results_on_the_device_gives_the_heap_back():
    """On the CPU platform device arrays live in glibc's heap, which keeps the memory freed between
    the small results such a loop holds: the process grows by megabytes a batch, for good, where
    PyTorch's own CPU loop stays flat. torchtpu trims the heap as the host moves data
    (backend.heap), so 90 more batches leave the process's size where it was."""
    out = subprocess.run([sys.executable, "-c", _EVAL_LOOP], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    count, grown_mb = map(int, out.stdout.split())
    assert count == 120 * 64
    # between trims the heap grows by up to 128 MiB and a check's worth of batches; measured: -133
    # and 156 (with TORCHTPU_MALLOC_TRIM=0: 864)
    assert grown_mb < 400, grown_mb
