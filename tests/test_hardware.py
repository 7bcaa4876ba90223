"""torchtpu.hardware: the chip table, the one reading of TPU topology names, and the modules that
read them (the configuration, the launcher). Standard library only: no TPU, no JAX needed."""

from __future__ import annotations

import pytest

from torchtpu.hardware import CHIPS, TP_AXIS, Topology, TopologyNameError, chip_of, chip_spec, parse_topology


def test_chip_spec_by_device_kind_and_generation():
    v5e = dict(
        name="v5e",
        peak_bf16_flops=197e12,
        hbm_bytes=16 * 10**9,
        hbm_bandwidth=8.19e11,
        cores_per_chip=1,
        type_prefix="v5litepod",
    )
    assert chip_spec("TPU v5 lite") == chip_spec("v5e") == chip_spec("tpu_v5_lite") == v5e
    assert chip_spec("TPU v5")["name"] == chip_spec("v5p")["name"] == "v5p"
    assert chip_spec("TPU v5")["hbm_bytes"] == 95 * 2**30 and chip_spec("TPU v5")["peak_bf16_flops"] == 459e12
    assert chip_spec("TPU v6 lite") == dict(
        name="v6e",
        peak_bf16_flops=918e12,
        hbm_bytes=32 * 10**9,
        hbm_bandwidth=1.64e12,
        cores_per_chip=1,
        type_prefix="v6e",
    )
    assert chip_spec("TPU v4") == dict(
        name="v4",
        peak_bf16_flops=275e12,
        hbm_bytes=32 * 2**30,
        hbm_bandwidth=1.2e12,
        cores_per_chip=2,
        type_prefix="v4",
    )
    assert chip_of("TPU v9") is None and chip_of("v5p") is CHIPS["v5p"]
    with pytest.raises(ValueError, match="unknown TPU device kind 'TPU v9'"):
        chip_spec("TPU v9")


@pytest.mark.parametrize(
    "name, generation, dims, chips, accelerator_type",
    [
        ("v5p:2x2x1", "v5p", (2, 2, 1), 4, "v5p-8"),  # v4 and v5p type names count TensorCores, two per chip
        ("v5p:4x4x8", "v5p", (4, 4, 8), 128, "v5p-256"),
        ("v4:2x2x1", "v4", (2, 2, 1), 4, "v4-8"),
        ("v5e:2x4", "v5e", (2, 4), 8, "v5litepod-8"),
        ("v6e:16x16", "v6e", (16, 16), 256, "v6e-256"),
        ("v7x:2x2x1", "v7x", (2, 2, 1), 4, "v7x-4"),  # outside the chip table: chips
    ],
)
def test_parse_topology(name, generation, dims, chips, accelerator_type):
    topo = parse_topology(name)
    assert topo == Topology(generation, dims)
    assert (topo.chips, topo.accelerator_type, f"{topo.generation}:{topo.shape}") == (chips, accelerator_type, name)


@pytest.mark.parametrize("name", ["v5p-128", "v5p:2", "v5p:2x2x2x2", "V5P:2x2x1", "5p:2x2", "v5p:2x2x1\n", "", None])
def test_malformed_topology_names_are_refused(name):
    with pytest.raises(TopologyNameError, match=r"invalid TPU topology .*expected GENERATION:AxB\[xC\]"):
        parse_topology(name)


def test_the_configuration_and_the_launcher_read_topologies_alike():
    from torchtpu.launch.render import RenderError, slice_shape
    from torchtpu.train.config.job_config import ConfigError, topology_num_devices

    assert topology_num_devices("v5p:4x4x4") == slice_shape("v5p:4x4x4")["chips"] == 64
    assert slice_shape("v5e:2x4")["tpu_type"] == "v5litepod-8" and topology_num_devices("v5e:2x4") == 8
    with pytest.raises(ConfigError, match=r'\[tpu\] topology = "v5p:2": allowed: "" \(the attached devices\)'):
        topology_num_devices("v5p:2")
    with pytest.raises(RenderError, match="expected GENERATION:TOPOLOGY"):
        slice_shape("v5p:2")


def test_one_tensor_parallel_axis_name():
    from torchtpu.distributed.mesh import JOB_MESH_DIMS

    assert TP_AXIS == "tp" == JOB_MESH_DIMS[-1]
