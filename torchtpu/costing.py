"""Costing XLA programs: what the dry runs (training's and serving's) and the benchmarks read from a
compiled program's figures and HLO text, and the arithmetic they share.

    est = depth_extrapolated_cost(report_2, report_4, 2, 4, 32)      # XLA's figures at full depth
    mfu = mfu_percent(model_flops, est["estimated_step_seconds"], chips, chip.peak_bf16_flops)
    count_collectives(hlo_text), while_loops(hlo_text), largest_temporaries(dump_folder)

XLA's cost analysis counts a while loop's body once, so a scanned model would look n_layers times
cheaper: the dry runs compile the same job at COSTING_DEPTHS layers as programs without loops over
layers and extrapolate linearly (`at_depth`). The compile report itself (memory, FLOPs and XLA's
estimated seconds of a `jax.stages.Compiled`) is `torchtpu.distributed.topology.compile_report`,
which reads the HLO text with the parsers here. Standard library only (an import-linter contract
keeps it so), at the bottom of the layers with torchtpu.hardware.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "COLLECTIVES",
    "COSTING_DEPTHS",
    "WIDE_TYPES",
    "at_depth",
    "computation",
    "count_collectives",
    "depth_extrapolated_cost",
    "largest_temporaries",
    "mfu_percent",
    "parse_size",
    "roofline_seconds",
    "temporaries_lines",
    "while_loops",
    "wide_types",
]

# The depths of the dry runs' two costing copies: XLA's time for a layer falls as neighbours appear
# to overlap its collectives with, and has settled by 2 -> 4 layers (`depth_extrapolated_cost`).
COSTING_DEPTHS = (2, 4)


# ----------------------------------------------------------------------------- arithmetic


def at_depth(a, b, depth_a: int, depth_b: int, depth: int):
    """A figure that grows linearly with depth, at `depth`, from its values `a` at `depth_a` and `b`
    at `depth_b`: a + (depth - depth_a) * (b - a) / (depth_b - depth_a). Whole numbers (bytes,
    parameter counts) stay whole: floor division, exact for layers that are all alike."""
    if isinstance(a, int) and isinstance(b, int):
        return a + (depth - depth_a) * (b - a) // (depth_b - depth_a)
    return a + (depth - depth_a) * (b - a) / (depth_b - depth_a)


def depth_extrapolated_cost(report_a: dict, report_b: dict, depth_a: int, depth_b: int, depth: int) -> dict:
    """Cost of a `depth`-layer program from `compile_report`s of the same program, unrolled, at
    `depth_a` < `depth_b` layers: cost(depth) = cost(a) + (depth - a) * (cost(b) - cost(a)) / (b - a).

    Why: XLA costs a while-loop body once (a scanned model looks `depth` times cheaper) and a
    kernel by what it declares. Shallow unrolled copies have no loop over layers to miscount.
    Why not 0 and 1 layers: XLA's time for a layer falls as neighbours appear to overlap its
    collectives with (measured on v5p: 20, 18, then 15.5 us per layer of a test block at 1, 2,
    4+ layers), so the slope is taken between 2 and 4 layers, where it has settled. Returns
    flops, bytes accessed and XLA's estimated seconds per device (None where XLA gave none).
    """
    if not 0 <= depth_a < depth_b:
        raise ValueError(f"depths must satisfy 0 <= depth_a < depth_b, got {depth_a} and {depth_b}")
    out = {
        "method": f"XLA cost model on unrolled {depth_a}- and {depth_b}-layer programs, extrapolated to {depth} layers"
    }
    for key in ("flops_per_device", "bytes_accessed_per_device", "estimated_step_seconds", "roofline_seconds"):
        a, b = report_a.get(key), report_b.get(key)
        out[key] = None if a is None or b is None else at_depth(a, b, depth_a, depth_b, depth)
    out["per_layer"] = {
        k: (
            None
            if report_a.get(k) is None or report_b.get(k) is None
            else (report_b[k] - report_a[k]) / (depth_b - depth_a)
        )
        for k in ("flops_per_device", "estimated_step_seconds")
    }
    return out


def mfu_percent(model_flops: float, seconds: float, chips: int, peak_flops: float) -> float:
    """Model FLOPs utilization in percent: `model_flops` (the model's own count, torchtitan's 6N +
    attention per token times the tokens, never XLA's) done in `seconds` by `chips` chips, over what
    their bf16 peak (`peak_flops` per chip) would do in that time."""
    return 100 * model_flops / (seconds * chips * peak_flops)


def roofline_seconds(flops: float, nbytes: float, peak_flops: float, bytes_per_s: float) -> float:
    """The time a program or an op needs at least: its FLOPs at the chip's peak, or its bytes at the
    chip's HBM bandwidth, whichever is longer (no overlap modelled, no collectives)."""
    return max(flops / peak_flops, nbytes / bytes_per_s)


# ----------------------------------------------------------------------------- HLO text

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_OP = re.compile(r"\s(" + "|".join(map(re.escape, COLLECTIVES)) + r")(-start)?\(")
_COMP_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def count_collectives(hlo_text: str) -> dict:
    """Counts of each collective in optimized HLO text.

    Async pairs count once (the `-start`). The TPU compiler lowers a reduce-scatter to a custom
    fusion whose computation is named `all-reduce-scatter*` (an all-reduce feeding a
    dynamic-slice); each call of such a fusion counts as one reduce-scatter and the all-reduce
    inside it is not counted again.
    """
    counts = dict.fromkeys(COLLECTIVES, 0)
    comp = None
    for line in hlo_text.splitlines():
        header = _COMP_HEADER.match(line)
        if header:
            comp = header.group(1)
            continue
        if comp is not None and comp.startswith("all-reduce-scatter"):
            continue
        if "fusion(" in line:
            m = _CALLS.search(line)
            if m and m.group(1).startswith("all-reduce-scatter"):
                counts["reduce-scatter"] += 1
                continue
        for m in _OP.finditer(line):
            counts[m.group(1)] += 1
    return counts


# A shape in HLO text: element type, then dimensions.
_SHAPE = re.compile(
    r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64|c64|c128)\[([\d,]*)\]"
)
WIDE_TYPES = ("s64", "u64", "f64", "c64", "c128")


def wide_types(hlo_text: str) -> dict:
    """How often 64-bit and complex element types (and the TPU compiler's 64-bit emulation calls)
    occur in HLO text: {"s64": n, "u64": n, "f64": n, "c64": n, "c128": n, "x64_emulation_calls": n}.

    On TPU, 64-bit integers and complex numbers have no hardware type: the compiler emulates
    them with 32-bit pairs and splits/combines program inputs with X64Split*/X64Combine custom
    calls, after which its cost model gives no step-time estimate.
    """
    counts = dict.fromkeys(WIDE_TYPES, 0)
    for m in _SHAPE.finditer(hlo_text):
        if m.group(1) in counts:
            counts[m.group(1)] += 1
    counts["x64_emulation_calls"] = len(re.findall(r'custom_call_target="X64(?:Split\w*|Combine)"', hlo_text))
    return counts


_WHILE = re.compile(r"%([\w.\-]+) = .* while\(.*condition=%([\w.\-]+), body=%([\w.\-]+)")


def computation(hlo_text: str, name: str) -> str:
    m = re.search(r"^(?:ENTRY )?%" + re.escape(name) + r" \(.*?^\}", hlo_text, re.M | re.S)
    return m.group(0) if m else ""


def while_loops(hlo_text: str) -> list[dict]:
    """The while loops of optimized HLO text: [{"name", "body", "trip_count"}] (trip_count from the
    loop condition's `counter < constant` compare, None when the condition has another form).

    XLA's cost analysis costs a loop body once, whatever its trip count, so a program with loops
    (a scan over layers) reports a fraction of the work it does."""
    loops = []
    for m in _WHILE.finditer(hlo_text):
        cond = computation(hlo_text, m.group(2))
        consts = dict(re.findall(r"%([\w.\-]+) = [su]32\[\]\S* constant\((\d+)\)", cond))
        trips = [
            int(consts[c]) for c in re.findall(r"compare\(%[\w.\-]+, %([\w.\-]+)\), direction=LT", cond) if c in consts
        ]
        loops.append({"name": m.group(1), "body": m.group(3), "trip_count": max(trips) if trips else None})
    return loops


def largest_temporaries(dump_folder: str, count: int = 8) -> list[dict]:
    """The largest slices of device memory in a compiled program, from XLA's memory-usage report
    in a `dump_compiles_to` folder (the newest module there), largest first.

    Returns [{"bytes", "shapes", "values"}]: one slice of memory each, with the shapes of the
    buffers that reuse it over the program (`values` of them). Arguments are included: a
    full-size shape where the layout says sharded is what to look for.
    """
    import glob

    reports = sorted(
        glob.glob(os.path.join(dump_folder, "*after_optimizations-memory-usage-report.txt")), key=os.path.getmtime
    )
    if not reports:
        return []
    rows = []
    with open(reports[-1], encoding="utf-8", errors="replace") as f:
        f.readline()  # Memory Space: default
        for line in f:
            parts = [p.strip() for p in line.split(";")]
            if len(parts) < 5 or not parts[2].isdigit():
                if rows and not line.strip():
                    break
                continue
            size = parse_size(parts[1])
            rows.append({"bytes": size, "shapes": parts[4], "values": int(parts[3])})
    return sorted(rows, key=lambda r: -r["bytes"])[:count]


def temporaries_lines(groups: list[dict]) -> list[str]:
    """`largest_temporaries`' slices as report lines: size, then the shapes that reuse the slice."""
    return [f"  {g['bytes'] / 1024**2:9.1f} MiB  {g['shapes'][:110]}" for g in groups]


def parse_size(text: str) -> int:
    m = re.match(r"([\d.]+)\s*(B|KiB|MiB|GiB)", text)
    if not m:
        return 0
    return int(float(m.group(1)) * {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}[m.group(2)])
