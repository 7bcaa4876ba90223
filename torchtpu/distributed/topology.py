"""Compile for real TPU topologies on a machine without TPUs.

libtpu can describe any TPU slice ("v5p:4x4x8", "v6e:16x16", ...) as compile-only devices.
`jax.jit(f).lower(<ShapeDtypeStructs with NamedShardings over those devices>).compile()` then
runs the real TPU compiler, and the executable reports its per-chip HBM use, its flops and
XLA's estimated step time, and its HLO shows the collectives the sharding produced. This works
in the same process as the CPU devices the tests use (JAX_PLATFORMS=cpu): the TPU plugin is
loaded for topology descriptions only and never becomes a JAX backend.

    devices = topology_devices("v5p:2x2x1")
    mesh = topology_mesh("v5p:2x2x1", (4,), ("fsdp",))
    compiled = aot_compile(jax.jit(step).lower(*abstract_args))   # or .compile()
    print(format_report(compile_report(compiled, mesh)))
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
from collections.abc import Sequence

import jax
import numpy as np

from ..backend.aot import aot_compile, compiler_options, dump_compiles_to  # re-exported: compiling is a backend job
from ..costing import count_collectives, roofline_seconds, while_loops, wide_types
from ..hardware import GiB, TopologyNameError, chip_spec, parse_topology

__all__ = [
    "TopologyError",
    "topology_devices",
    "topology_mesh",
    "aot_compile",
    "compile_report",
    "format_report",
    "dump_compiles_to",
    "COSTING_COMPILER_OPTIONS",
    "PAST_OOM_COMPILER_OPTIONS",
    "NO_MEMORY_SPACE_ASSIGNMENT",
    "costing_compiles",
]

EXAMPLES = ("v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v5p:4x4x8", "v6e:2x2", "v6e:16x16")


class TopologyError(RuntimeError):
    """A TPU topology cannot be described (libtpu missing, or an invalid topology name)."""


@contextlib.contextmanager
def _quiet_libtpu_env(name: str):
    """Give libtpu the host facts it would otherwise look up (and warn about) on a non-TPU host.

    Only on hosts without TPU chips: on a TPU VM libtpu must discover the real slice itself.
    libtpu reads these when it initialises (once per process), so they are set around that
    call only and then removed again, keeping them out of subprocesses; existing values win.
    """
    from torchtpu._platform import has_tpu_chips

    values = (
        {}
        if has_tpu_chips()
        else {
            "TPU_SKIP_MDS_QUERY": "1",
            "TPU_WORKER_HOSTNAMES": "localhost",
            "TPU_WORKER_ID": "0",
            # libtpu takes /tmp/libtpu_lockfile so that one process owns the chips; a second
            # process (pytest-xdist workers, a user's second shell) would fail with "ABORTED ...
            # lockfile". Compile-only devices own no chips, so several processes may load libtpu.
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        }
    )
    if values:
        try:  # the slice's TPU type name; a name that does not parse is libtpu's to refuse
            values["TPU_ACCELERATOR_TYPE"] = parse_topology(name).accelerator_type
        except TopologyNameError:
            pass
    added = [k for k in values if k not in os.environ]
    for k in added:
        os.environ[k] = values[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def libtpu_available() -> bool:
    return importlib.util.find_spec("libtpu") is not None


@functools.cache
def _devices(name: str) -> tuple:
    if not libtpu_available():
        raise TopologyError(
            f"compiling for TPU topology {name!r} needs libtpu, which is not installed: pip install torchtpu[tpu]"
        )
    from jax.experimental import topologies

    try:
        with _quiet_libtpu_env(name):
            desc = topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as e:  # noqa: BLE001  (libtpu reports bad names as JaxRuntimeError)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "not installed" in msg:
            raise TopologyError(
                f"compiling for TPU topology {name!r} needs libtpu, which JAX cannot load ({msg}): "
                "pip install torchtpu[tpu]"
            ) from e
        if "INVALID_ARGUMENT" in msg:
            raise TopologyError(
                f"invalid TPU topology {name!r}: {msg}; use <generation>:<chips per axis>, e.g. {', '.join(EXAMPLES)}"
            ) from e
        raise TopologyError(f"libtpu could not describe TPU topology {name!r}: {msg}") from e
    return tuple(desc.devices)


def topology_devices(name: str) -> list:
    """The compile-only TPU devices of topology `name` (e.g. "v5p:2x2x1", "v6e:2x2", "v5p:4x4x4").

    One device per chip on v5e/v5p/v6e; libtpu describes v4 with one device per TensorCore
    (two per chip). Repeated calls return the same device objects.
    """
    if not isinstance(name, str) or ":" not in name:
        raise TopologyError(
            f"invalid TPU topology {name!r}: expected <generation>:<chips per axis>, e.g. {', '.join(EXAMPLES)}"
        )
    return list(_devices(name.strip()))


def topology_mesh(name: str, mesh_shape: Sequence[int], axis_names: Sequence[str]) -> jax.sharding.Mesh:
    """A `Mesh` over topology `name`, with devices ordered by the physical interconnect."""
    from jax.experimental import mesh_utils

    devices = topology_devices(name)
    mesh_shape = tuple(int(n) for n in mesh_shape)
    axis_names = tuple(axis_names)
    if len(mesh_shape) != len(axis_names):
        raise ValueError(f"mesh_shape {mesh_shape} and axis_names {axis_names} differ in length")
    if math.prod(mesh_shape) != len(devices):
        raise ValueError(
            f"mesh_shape {mesh_shape} has {math.prod(mesh_shape)} devices but topology {name!r} has {len(devices)}"
        )
    if len({tuple(d.coords) for d in devices}) < len(devices):
        # v4 topologies come with one device per TensorCore, which mesh_utils rejects (it wants
        # one per chip, "megacore"). libtpu numbers them x-fastest with a chip's two cores
        # adjacent, so the id order keeps each chip's cores together on the last mesh axis.
        arr = np.array(sorted(devices, key=lambda d: d.id), dtype=object).reshape(mesh_shape)
        return jax.sharding.Mesh(arr, axis_names)
    try:
        arr = mesh_utils.create_device_mesh(mesh_shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        # Shapes that do not tile the physical torus: let mesh_utils split physical axes.
        arr = mesh_utils.create_device_mesh(mesh_shape, devices, allow_split_physical_axes=True)
    return jax.sharding.Mesh(arr, axis_names)


# ----------------------------------------------------------------------------- compile report


def _devices_of(compiled, mesh_or_devices) -> list:
    if isinstance(mesh_or_devices, jax.sharding.Mesh):
        return list(mesh_or_devices.devices.flat)
    if mesh_or_devices is not None:
        return list(mesh_or_devices)
    for s in jax.tree.leaves(compiled.input_shardings) + jax.tree.leaves(compiled.output_shardings):
        if isinstance(s, jax.sharding.Sharding):
            return sorted(s.device_set, key=lambda d: d.id)
    raise ValueError("cannot tell which devices the executable runs on; pass the mesh or the device list")


def compile_report(compiled, mesh_or_devices=None) -> dict:
    """What the TPU compiler says about one compiled step (a `jax.stages.Compiled`).

    Memory, flops and bytes are per device: the executable is the SPMD-partitioned program one
    device runs (a matmul sharded 4 ways reports a quarter of the total flops).
    """
    devices = _devices_of(compiled, mesh_or_devices)
    kind = devices[0].device_kind
    spec = chip_spec(kind) if getattr(devices[0], "platform", "tpu") == "tpu" else None
    coords = [tuple(getattr(d, "coords", (d.id,))) for d in devices]
    per_chip = max(1, len(coords) // max(1, len(set(coords))))  # v4 topologies: 2 devices per chip

    ma = compiled.memory_analysis()
    mem = {
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
        "temp_bytes": int(ma.temp_size_in_bytes),
        "generated_code_bytes": int(ma.generated_code_size_in_bytes),
        "peak_bytes": int(getattr(ma, "peak_memory_in_bytes", 0) or 0),
    }
    # HBM one device needs: its arguments, plus outputs that do not reuse a donated argument
    # (alias bytes are counted in both argument and output), plus XLA's scratch (temp), plus
    # the program itself. peak_memory_in_bytes is the buffer assigner's simulated peak of live
    # buffers; it is sometimes above that sum (e.g. layout copies of parameters) and sometimes
    # below (buffers that are never live together), so the larger of the two is used.
    live = mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"]
    needed = max(live, mem["peak_bytes"]) + mem["generated_code_bytes"]

    text = compiled.as_text()
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):  # older jax: one dict per executable
        ca = ca[0] if ca else {}
    ca = ca or {}
    flops = float(ca.get("flops", 0.0))
    available = spec["hbm_bytes"] // per_chip if spec else None
    peak_flops = spec["peak_bf16_flops"] / per_chip if spec else None

    return {
        "device_kind": kind,
        "chip": spec["name"] if spec else kind,
        "num_devices": len(devices),
        "devices_per_chip": per_chip,
        "hbm_bytes_needed": needed,
        "hbm_bytes_available": available,
        "fits": (needed <= available) if available is not None else None,
        "memory": mem,
        "flops_per_device": flops,
        "flops_total": flops * len(devices),
        "bytes_accessed_per_device": float(ca.get("bytes accessed", 0.0)),
        # XLA reports a negative optimal_seconds when its cost model cannot time the program
        "estimated_step_seconds": (
            float(ca["optimal_seconds"]) if float(ca.get("optimal_seconds", -1.0)) > 0 else None
        ),
        "peak_bf16_flops_per_device": peak_flops,
        "compute_bound_seconds": flops / peak_flops if peak_flops else None,
        # a roofline bound from XLA's own flop and byte counts (not a simulation: no overlap of
        # collectives, no precision passes); it is what remains when XLA gives no estimate
        "roofline_seconds": (
            roofline_seconds(flops, float(ca.get("bytes accessed", 0.0)), peak_flops, spec["hbm_bandwidth"] / per_chip)
            if spec
            else None
        ),
        "collectives": count_collectives(text),
        "wide_types": wide_types(text),
        "while_loops": while_loops(text),
    }


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _secs(s) -> str:
    if s is None:
        return "n/a (XLA's cost model gave no estimate)"
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def format_report(report: dict, costed_below: bool = False) -> str:
    """A two-column table of a `compile_report` for people. `costed_below`: leave out the program's
    own FLOPs and time rows (a program with while loops: XLA costs each loop body once) and say where
    the estimate is."""
    mem = report["memory"]
    fits = report["fits"]
    rows = [
        (
            "device",
            f"{report['device_kind']} ({report['chip']}) x {report['num_devices']}"
            + (f", {report['devices_per_chip']} per chip" if report["devices_per_chip"] > 1 else ""),
        ),
        ("HBM needed / device", _bytes(report["hbm_bytes_needed"])),
        ("HBM available / device", _bytes(report["hbm_bytes_available"])),
        ("fits", "-" if fits is None else ("yes" if fits else "NO")),
        ("  arguments", _bytes(mem["argument_bytes"])),
        ("  outputs (not aliased)", _bytes(mem["output_bytes"] - mem["alias_bytes"])),
        ("  temporaries", _bytes(mem["temp_bytes"])),
        ("  program", _bytes(mem["generated_code_bytes"])),
        ("  simulated peak", _bytes(mem["peak_bytes"])),
    ]
    if costed_below:
        rows.append(("flops, step time", "below, from the costing programs (this program loops over layers)"))
    else:
        rows += [
            ("flops / device", f"{report['flops_per_device']:.4g}"),
            ("flops total", f"{report['flops_total']:.4g}"),
            ("XLA estimated step", _secs(report["estimated_step_seconds"])),
            ("compute-bound step", _secs(report["compute_bound_seconds"])),
            ("roofline step", _secs(report.get("roofline_seconds"))),
        ]
    rows += [(f"{name}", str(n)) for name, n in report["collectives"].items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


# XLA's TPU compiler may split a matmul whose operand is sharded along a dimension it must gather
# (or whose result it must scatter) into a loop over the shards that overlaps each collective step
# with a slice of the matmul ("windowed einsum", collective matmul). Its cost analysis costs the
# body of that loop once, not once per trip, so such a program reports too few FLOPs and too short
# a step. Measured: the pure-JAX Llama 3 70B step on v5p:4x4x4 (bench/tpu_step.py), 2 layers
# unrolled, holds 6 such loops of 4 trips and reports 4.01e13 FLOPs per chip; compiled without
# them, 4.23e13 (its matmuls' full count). Programs compiled for costing turn it off; the programs
# that run (and the dry run's memory figures) keep the compiler's defaults.
COSTING_COMPILER_OPTIONS = {
    "xla_tpu_enable_windowed_einsum_for_all_gather": False,
    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
}


# A costing copy is unrolled, so it holds every layer's activations and gathered weights at once
# where the scanned program holds one layer's: it may need more HBM than the chip has although the
# program that runs fits (DeepSeek-V3 671B, TP 8 x FSDP 64 on v5p:8x8x8: its 5-layer copy needs
# 102 GiB per chip), and XLA then refuses to compile it ("Ran out of memory on HBM"). libtpu's
# `xla_tpu_no_crash_on_oom` suppresses that error and compiles the program anyway, with the same
# figures as without it for a program that fits (tests/train/test_dry_run.py); `compile_report`'s
# "fits" says whether it would run. It also lets through a kernel that needs more VMEM than the
# chip has (the same test: a Pallas kernel with 128M of blocks against 64M of VMEM compiles with it),
# so only the dry run uses it (`costing_compiles(..., past_oom=True)`), for the costing copies of a
# step whose full program has compiled with XLA's checks, kernels included; the method line names a
# copy that does not fit in HBM (`estimate.with_fit_note`). bench.step_estimate, which compiles no
# full program, keeps the checks.
PAST_OOM_COMPILER_OPTIONS = {"xla_tpu_no_crash_on_oom": True}


# Memory-space assignment (MSA) prefetches weights from HBM into on-chip memory ahead of the
# ops that read them, and XLA's cost analysis counts each such copy, and the op's read of the
# copy, as HBM traffic. A program bound by HBM bandwidth, such as a decode step, is then costed
# several times too slow. Measured on v5e:2x2, 64 tokens through three 4096 x 16384 bf16 matmuls
# split 4 ways: 688 us with MSA, 142 us without, against 123 us for reading the weights once at
# the chip's bandwidth. When MSA splits a prefetch into asynchronous slices (slice-start /
# slice-done), XLA gives no time at all (a negative optimal_seconds): a vLLM Llama 3 8B MLP of 64
# tokens, TP 4 on v5e:2x2. The serving dry run costs its programs with MSA off
# (`costing_compiles(mesh, memory_space_assignment=False)`); a TPU runs them with it on.
NO_MEMORY_SPACE_ASSIGNMENT = {"xla_msa_enable": False}


def costing_compiles(mesh, *, memory_space_assignment: bool = True, past_oom: bool = False):
    """Context in which `aot_compile` compiles programs whose cost XLA counts fully: for a mesh of
    TPU devices, with COSTING_COMPILER_OPTIONS (no collective-matmul loops), without memory-space
    assignment when `memory_space_assignment` is False (NO_MEMORY_SPACE_ASSIGNMENT), and past XLA's
    out-of-memory errors when `past_oom` is True (PAST_OOM_COMPILER_OPTIONS: for programs whose
    kernels a checked compile has vetted); other platforms have no such loops and compile as usual."""
    devices = np.asarray(getattr(mesh, "devices", mesh)).flat
    platform = getattr(next(iter(devices), None), "platform", None)
    if platform != "tpu":
        return compiler_options({})
    extra = {} if memory_space_assignment else NO_MEMORY_SPACE_ASSIGNMENT
    return compiler_options({**COSTING_COMPILER_OPTIONS, **extra, **(PAST_OOM_COMPILER_OPTIONS if past_oom else {})})
