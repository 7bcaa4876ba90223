"""PyTorch's device autoload (torchtpu_autoload) and the `torch.cuda`-shaped contract of `torch.tpu`
that PyTorch's ecosystem reads (torchtitan's metrics, Hugging Face, torchrun scripts).

The autoload checks run fresh interpreters: `import torch` alone, as a user's script starts."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest
import torch

from ..processes import cpu_flags


def _python(code: str, **env) -> str:
    full = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags(1), **env)
    p = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def test_import_torch_finds_tpu_and_loads_torchtpu_at_first_use():
    out = _python(
        "import sys, torch\n"
        "loaded = lambda: ('torchtpu' in sys.modules, 'jax' in sys.modules)\n"
        "print('after import', loaded())\n"
        # what torchtitan, transformers and torchrun scripts ask first; none of it starts the device
        "print('found', torch._utils._get_available_device_type(), torch.accelerator.current_accelerator(),"
        " torch.tpu.is_available(), torch.device('tpu:0'))\n"
        # what vLLM's CPU platform and PyTorch's own code call of the accelerator: nothing is on tpu yet
        "torch.accelerator.synchronize(); torch.accelerator.empty_cache(); torch.accelerator.empty_host_cache()\n"
        "print('memory', torch.accelerator.memory_allocated(), torch.accelerator.current_device_index())\n"
        "print('after queries', loaded())\n"
        "x = torch.arange(4.0, device='tpu') * 2\n"
        "print('tensor', x.device, x.cpu().tolist(), loaded())\n"
        "print('cpu pinned', torch.ones(2).is_pinned())\n"
    )
    assert "after import (False, False)" in out
    assert "found tpu tpu True tpu:0" in out
    assert "memory 0 0" in out
    assert "after queries (False, False)" in out
    assert "tensor tpu:0 [0.0, 2.0, 4.0, 6.0] (True, True)" in out
    assert "cpu pinned False" in out


def test_compile_backend_and_device_module_load_torchtpu_themselves():
    out = _python(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Linear(4, 3)\n"
        "x = torch.randn(2, 4)\n"
        "want = m(x)\n"
        # the first use is torch.compile's backend lookup, then the device module's set_device
        "f = torch.compile(m.to('tpu'), backend='tpu')\n"
        "torch.tpu.set_device(0)\n"
        "print('close', torch.allclose(f(x.to('tpu')).cpu(), want, atol=1e-6))\n"
    )
    assert "close True" in out


def test_autoload_off_leaves_torch_without_tpu():
    out = _python(
        "import torch\nprint('has tpu', hasattr(torch, 'tpu'), torch._C._get_privateuse1_backend_name())\n"
        "import torchtpu\nprint('after import', torch.ones(1, device='tpu').device)\n",
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
    )
    assert "has tpu False privateuseone" in out
    assert "after import tpu:0" in out


def test_device_properties_name_and_memory_are_xla_s():
    dev = jax.local_devices()[0]
    props = torch.tpu.get_device_properties(0)
    assert props.name == dev.device_kind == torch.tpu.get_device_name() == torch.tpu.get_device_name("tpu:0")
    # XLA's CPU devices report no memory limit: the host's physical memory, which they share
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert props.total_memory == host
    free, total = torch.tpu.mem_get_info()
    assert total == host and 0 < free <= total
    assert torch.tpu.is_bf16_supported()
    assert torch.tpu.get_device_capability() == (0, 0)


def test_memory_stats_keep_cuda_s_keys_and_peaks_reset():
    torch.tpu.reset_peak_memory_stats()
    base = torch.tpu.memory_allocated()
    x = torch.ones(1024, 1024, device="tpu")  # 4 MiB
    x.add_(1)
    stats = torch.tpu.memory_stats()
    for key in ("allocated_bytes.all.current", "active_bytes.all.peak", "reserved_bytes.all.peak"):
        assert key in stats
    assert stats["allocated_bytes.all.current"] >= base + 4 * 2**20
    # XLA counts neither allocation retries nor out-of-memory errors: absent, not invented
    assert "num_ooms" not in stats and "num_alloc_retries" not in stats
    peak = torch.tpu.max_memory_allocated()
    assert peak >= base + 4 * 2**20
    del x, stats
    after = torch.tpu.memory_allocated()
    assert after < peak
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == torch.tpu.memory_allocated() == after
    # torch.accelerator answers the same
    assert torch.accelerator.max_memory_allocated() == after


def test_events_time_the_work_between_them():
    a = torch.randn(256, 256, device="tpu")
    (a @ a).sum().item()  # compiled once
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a = a @ a / 256
    end.record()
    end.synchronize()
    assert end.query()
    ms = start.elapsed_time(end)
    assert 0 < ms < 60_000
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch.tpu.Event().elapsed_time(end)


def test_current_device_is_one_place():
    torch.tpu.set_device(1)
    try:
        assert torch.accelerator.current_device_index() == torch.tpu.current_device() == 1
        assert torch.ones(1, device="tpu").device == torch.device("tpu:1")
    finally:
        torch.accelerator.set_device_index(0)
    assert torch.tpu.current_device() == 0


def test_torch_load_onto_tpu_keeps_ties_and_parameters():
    """torch.load(map_location="tpu") as the device's first use: PyTorch alone would allocate each
    storage with a C++ allocator the device does not have (the process died)."""
    out = _python(
        "import io, torch\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Linear(4, 3)\n"
        "buf = io.BytesIO()\n"
        "torch.save({'w': m.weight, 'tied': m.weight, 'b': m.bias.detach(), 'step': 3}, buf)\n"
        "for loc in ('tpu', torch.device('tpu:0'), {'cpu': 'tpu'}):\n"
        "    buf.seek(0)\n"
        "    sd = torch.load(buf, map_location=loc)\n"
        "    print('loaded', sd['w'].device, isinstance(sd['w'], torch.nn.Parameter), sd['w'] is sd['tied'],"
        " torch.equal(sd['w'].cpu(), m.weight.detach()), torch.equal(sd['b'].cpu(), m.bias.detach()), sd['step'])\n"
        "buf.seek(0)\n"
        "print('plain', torch.load(buf)['w'].device)\n"
    )
    assert out.count("loaded tpu:0 True True True True 3") == 3, out
    assert "plain cpu" in out
