"""Ahead-of-time compilation for real TPU topologies through libtpu, on a host without TPUs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torchtpu.distributed import topology
from torchtpu.distributed.topology import (
    TopologyError,
    aot_compile,
    compile_report,
    format_report,
    topology_devices,
    topology_mesh,
)
from torchtpu.hardware import chip_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (pip install torchtpu[tpu])"
)


def test_missing_libtpu_message(monkeypatch):
    monkeypatch.setattr(topology, "libtpu_available", lambda: False)
    with pytest.raises(TopologyError, match=r"needs libtpu.*pip install torchtpu\[tpu\]"):
        topology_devices("v5p:2x2x2")


@needs_libtpu
def test_devices_kinds_and_mesh():
    cpu_before = jax.devices()
    devs = topology_devices("v5p:2x2x1")
    assert len(devs) == 4 and {d.platform for d in devs} == {"tpu"}
    assert {d.device_kind for d in devs} == {"TPU v5"}
    assert topology_devices("v5p:2x2x1") == devs  # cached: the same device objects
    assert {d.device_kind for d in topology_devices("v6e:2x2")} == {"TPU v6 lite"}
    assert {d.device_kind for d in topology_devices("v5e:2x2")} == {"TPU v5 lite"}
    assert len(topology_devices("v5p:4x4x4")) == 64
    mesh = topology_mesh("v5p:4x4x4", (4, 16), ("dp", "fsdp"))
    assert dict(mesh.shape) == {"dp": 4, "fsdp": 16}
    assert len(set(mesh.devices.flat)) == 64
    v4 = topology_mesh("v4:2x2x1", (2, 4), ("dp", "fsdp"))  # libtpu gives v4 one device per core
    assert v4.devices.size == 8 and {d.device_kind for d in v4.devices.flat} == {"TPU v4"}
    with pytest.raises(ValueError, match="has 8 devices but topology 'v5p:2x2x1' has 4"):
        topology_mesh("v5p:2x2x1", (8,), ("x",))
    # the CPU devices the rest of the suite uses are untouched, and the tpu device still works
    assert jax.devices() == cpu_before and jax.default_backend() == "cpu"
    assert (torch_ones() + 1).sum().item() == 16.0


def torch_ones():
    import torch

    return torch.ones(4, 2, device="tpu")


@needs_libtpu
@pytest.mark.parametrize("name", ["v5p:3x3", "x5:2x2", "v5p", "v6e:2x2x2x2"])
def test_invalid_topology_names(name):
    with pytest.raises(TopologyError, match=r"invalid TPU topology .*e\.g\. v4:2x2x1, v5e:2x2, v5p:2x2x1"):
        topology_devices(name)


D, H, B = 256, 1024, 32


def _mlp_step(params, x, y):
    def loss(p):
        h = jax.nn.gelu(x @ p["w1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads), value


def _compile_mlp(name, fsdp: bool):
    mesh = topology_mesh(name, (4,), ("fsdp",))
    spec = P("fsdp", None) if fsdp else P()
    params = {
        "w1": jax.ShapeDtypeStruct((D, H), jnp.bfloat16, sharding=NamedSharding(mesh, spec)),
        "w2": jax.ShapeDtypeStruct((H, D), jnp.bfloat16, sharding=NamedSharding(mesh, spec)),
    }
    batch = jax.ShapeDtypeStruct((B, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    out_shardings = ({k: v.sharding for k, v in params.items()}, NamedSharding(mesh, P()))
    step = jax.jit(_mlp_step, out_shardings=out_shardings, donate_argnums=0)
    return aot_compile(step.lower(params, batch, batch)), mesh


@needs_libtpu
@pytest.mark.parametrize("name", ["v5p:2x2x1", "v6e:2x2"])
def test_fsdp_mlp_step_report(name):
    compiled, mesh = _compile_mlp(name, fsdp=True)
    report = compile_report(compiled, mesh)
    c = report["collectives"]
    assert c["all-gather"] >= 1 and c["reduce-scatter"] >= 1, c
    assert report["fits"] is True and 0 < report["hbm_bytes_needed"] < report["hbm_bytes_available"]
    assert report["hbm_bytes_available"] == chip_spec(mesh.devices.flat[0].device_kind)["hbm_bytes"]
    # donated parameters: the updated parameters reuse their buffers
    assert report["memory"]["alias_bytes"] == 2 * D * H * 2 // 4
    assert report["flops_per_device"] > 0 and report["flops_total"] == 4 * report["flops_per_device"]
    assert report["estimated_step_seconds"] > 0
    table = format_report(report)
    assert "HBM needed / device" in table and "reduce-scatter" in table and "fits" in table


@needs_libtpu
def test_replicated_dp_step_all_reduces_and_flops_are_per_chip():
    compiled, mesh = _compile_mlp("v5p:2x2x1", fsdp=False)
    report = compile_report(compiled)  # devices found from the executable's shardings
    assert report["num_devices"] == 4 and report["chip"] == "v5p"
    c = report["collectives"]
    assert c["all-reduce"] >= 1 and c["all-gather"] == 0 and c["reduce-scatter"] == 0, c

    # cost_analysis() flops are per chip: a matmul sharded 4 ways reports a quarter of 2*M*N*K.
    n = 1024
    a = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    b = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    mm = compile_report(aot_compile(jax.jit(jnp.matmul).lower(a, b)), mesh)
    assert mm["flops_per_device"] == pytest.approx(2 * n**3 / 4, rel=0.01)
    assert sum(mm["collectives"].values()) == 0


@needs_libtpu
def test_no_libtpu_warnings_reach_the_user():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    env.update(JAX_PLATFORMS="cpu", TORCHTPU_CACHE_DIR="off")
    code = "from torchtpu.distributed.topology import topology_devices\nprint(len(topology_devices('v6e:2x2')))\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "4"
    assert out.stderr.strip() == "", out.stderr
