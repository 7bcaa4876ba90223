"""Where a compiled TPU step's time goes, by kind of op, from XLA's optimized HLO text.

    python -m bench.step_estimate --config train_configs/qwen3_30b_a3b.toml --topology v5p:2x2x4 --dump /tmp/d
    python -m bench.hlo_breakdown /tmp/d/<2-layer>.after_optimizations.txt [/tmp/d/<4-layer>...txt 2 4]

XLA's cost model gives one time per program, not per op. This reads the program XLA compiled (its
entry computation, and the computations it calls) and gives each top-level op a roofline time on a
v5p chip: for a collective, its result's bytes over ICI_BYTES_PER_S; for anything else, the larger
of its FLOPs (dots and convolutions inside it; a Pallas kernel's declared cost) over the chip's
bf16 peak and the bytes of its operands and result over HBM bandwidth. The ops are grouped
(matmul fusions, Pallas kernels by name, collectives by kind, gathers and scatters, sorts,
copies, other fusions). The sum is serial, with no overlap: a bound to compare the kinds, next to
XLA's own estimate, not a second estimate. With two programs of the same job unrolled at two
depths, it prints the per-layer difference, the part the dry run's extrapolation multiplies.
Where the dump's `*after_codegen.txt` sits beside the program, a last column sums libtpu's own
per-op estimates (`estimated_cycles`) per kind: where its code generator expects the time to go, a
guide only (XLA's step figure is not their sum; kernels, collectives and scatters carry none).

A program with loops (a scanned step as it runs: `bench.step_estimate --loop --dump <folder>` keeps
it) is split in two: the ops outside the loops, and the loop bodies, each counted once (one layer
of a layer scan's forward and backward loops). Set beside the unrolled copies' per-layer figures
and intercept, they show whether a loop's extra cost is in its body or outside it.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re

from torchtpu import costing
from torchtpu.hardware import CHIPS

CHIP = CHIPS["v5p"]
# what XLA's cost model charges a v5p collective per result byte on the meshes measured here (a
# 403 MB all-gather over 16 chips: 0.895 ms); a fit, not a datasheet figure
ICI_BYTES_PER_S = 4.5e11

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}
_BYTES.update({"s64": 8, "u64": 8, "f64": 8})
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_INST = re.compile(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
COLLECTIVES = (*costing.COLLECTIVES, "ragged-all-to-all")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id"}


def _dims(text: str) -> list[int]:
    m = _SHAPE.search(text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _nbytes(text: str) -> int:
    return sum(_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in _SHAPE.findall(text))


class Program:
    """The computations of one HLO module's text, and each instruction's result type."""

    def __init__(self, text: str):
        self.comps: dict[str, list[tuple]] = {}
        self.types: dict[tuple[str, str], str] = {}
        self.entry = None
        current = None
        for line in text.splitlines():
            if not line.startswith(" "):
                m = _HEAD.match(line)
                if m:
                    current = m.group(2)
                    self.comps[current] = []
                    if m.group(1):
                        self.entry = current
                continue
            m = _INST.match(line.strip()) if current else None
            if m:
                name, typ, op, rest = m.groups()
                self.comps[current].append((name, typ, op, rest, line))
                self.types[(current, name)] = typ

    def flops(self, comp: str) -> tuple[float, set]:
        """FLOPs of the dots and convolutions in `comp` and the computations it calls, and the
        kinds of op found (dot, sort, gather, scatter)."""
        total, kinds = 0.0, set()
        for _, typ, op, rest, line in self.comps.get(comp, []):
            if op in ("dot", "convolution"):
                operands = re.findall(r"%([\w.\-]+)", rest)
                lhs = _dims(self.types.get((comp, operands[0]), "")) if operands else []
                k = 1
                m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
                if m and lhs:
                    k = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i)
                m = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->", line)
                if op == "convolution" and m and lhs:
                    rhs = _dims(self.types.get((comp, operands[1]), "")) if len(operands) > 1 else []
                    k = math.prod(s for lab, s in zip(m.group(1), lhs) if lab == "f")
                    k *= math.prod(s for lab, s in zip(m.group(2), rhs) if lab.isdigit())
                total += 2 * math.prod(_dims(typ)) * k
                kinds.add("dot")
            elif op in ("sort", "gather", "scatter"):
                kinds.add(op)
            if op not in ("reduce", "scatter", "sort", "map", "reduce-window", "select-and-scatter", "all-reduce"):
                for callee in re.findall(r"calls=%?([\w.\-]+)", line):
                    f, k2 = self.flops(callee)
                    total += f
                    kinds |= k2
        return total, kinds

    def loop_bodies(self, comp: str | None = None) -> list[str]:
        """The bodies of the while loops among `comp`'s top-level ops (default: the entry's)."""
        found = []
        for _, _, op, _, line in self.comps[comp or self.entry]:
            m = re.search(r"body=%?([\w.\-]+)", line) if op == "while" else None
            if m:
                found.append(m.group(1))
        return found

    def ops(self, comp: str | None = None):
        """(kind, name, seconds, bytes, flops) for each top-level op, entering calls and async
        wrappers; a while loop is left out (its body: `loop_bodies`)."""
        comp = comp or self.entry
        for name, typ, op, rest, line in self.comps[comp]:
            if op in _FREE or op.endswith("-done") or op == "while":
                continue
            base = op.removesuffix("-start")
            callee = re.search(r"calls=%?([\w.\-]+)", line)
            if op in ("call", "async-start") and callee and base not in COLLECTIVES and callee.group(1) in self.comps:
                yield from self.ops(callee.group(1))
                continue
            out = _nbytes(typ)
            if base in COLLECTIVES:
                yield base, name, out / ICI_BYTES_PER_S, out, 0.0
                continue
            head = rest.split("),")[0]
            inputs = sum(_nbytes(self.types.get((comp, o), "")) for o in re.findall(r"%([\w.\-]+)", head))
            flops, kinds = self.flops(callee.group(1)) if op == "fusion" and callee else (0.0, set())
            if op == "custom-call":
                m = re.search(r'"flops":\s*"?(\d+)', line)
                flops = float(m.group(1)) if m else 0.0
                kernel = re.search(r'custom_call_target="([^"]+)"', line)
                kind = (
                    f"kernel {re.sub(r'_block.*|[._][0-9]+$', '', name)}"
                    if kernel and "tpu_custom_call" in kernel.group(1)
                    else op
                )
            elif "dot" in kinds:
                kind = "matmul fusion"
            elif op == "sort" or "sort" in kinds:
                kind = "sort"
            elif op in ("gather", "scatter") or kinds & {"gather", "scatter"}:
                kind = "gather/scatter"
            elif op in ("copy", "copy-start", "transpose"):
                kind = "copy/transpose"
            elif op == "fusion":
                kind = "other fusion"
            else:
                kind = "other"
            seconds = costing.roofline_seconds(flops, inputs + out, CHIP.peak_bf16_flops, CHIP.hbm_bandwidth)
            yield kind, name, seconds, inputs + out, flops


_CYCLES = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+) = .*?"estimated_cycles":"(\d+)"', re.M)


def codegen_cycles(path: str) -> dict[str, int]:
    """libtpu's own estimate per op (`estimated_cycles` in the backend config) from the dump's
    `*after_codegen.txt` next to the `*after_optimizations.txt` at `path`; empty when there is none.
    A guide only: XLA's step figure is not their sum (a float32 reduce of 1 GiB of bfloat16 rows,
    alone in a program on v5p: 4.6M cycles, against a 0.529 ms step figure)."""
    sibling = path.replace("after_optimizations.txt", "after_codegen.txt")
    if sibling == path or not os.path.exists(sibling):
        return {}
    with open(sibling) as f:
        return {name: int(n) for name, n in _CYCLES.findall(f.read())}


def _tally(ops, cycles: dict[str, int]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0, 0])
    for kind, name, seconds, nbytes, flops in ops:
        row = out[kind]
        row[0] += seconds
        row[1] += nbytes
        row[2] += flops
        row[3] += 1
        row[4] += cycles.get(name, 0)
    return dict(out)


def breakdown(path: str) -> tuple[dict[str, list[float]], dict[str, list[float]] | None]:
    """kind -> [seconds, bytes, flops, count, libtpu's estimated cycles] over the program in
    `path`, its loops left out, and the same over the bodies of its loops, each once (None for a
    program without loops)."""
    with open(path) as f:
        program = Program(f.read())
    cycles = codegen_cycles(path)
    bodies = program.loop_bodies()
    loops = _tally((op for body in bodies for op in program.ops(body)), cycles) if bodies else None
    return _tally(program.ops(), cycles), loops


def _print(rows: dict[str, list[float]], title: str) -> None:
    total = sum(r[0] for r in rows.values())
    cycles = any(r[4] for r in rows.values())
    print(f"{title}: serial roofline sum {total * 1e3:.2f} ms, {sum(r[2] for r in rows.values()):.4g} FLOPs")
    head = f"  {'kind':40s} {'ms':>9s} {'share':>6s} {'GB':>8s} {'TFLOP':>8s}"
    print(head + (f" {'Mcycles':>8s} (libtpu's, a guide)" if cycles else ""))
    for kind, (s, b, f, _, c) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        if abs(s) >= 5e-6:
            line = f"  {kind:40s} {s * 1e3:9.3f} {100 * s / total:5.1f}% {b / 1e9:8.2f} {f / 1e12:8.3f}"
            print(line + (f" {c / 1e6:8.2f}" if cycles else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("program", help="XLA's *after_optimizations.txt of the shallower program")
    ap.add_argument("deeper", nargs="?", help="the same job's program at a greater depth")
    ap.add_argument("depths", nargs="*", type=int, help="the two programs' depths (default 2 4)")
    args = ap.parse_args()
    small, loops = breakdown(args.program)
    where = " (outside its loops)" if loops else ""
    _print(small, args.program.rsplit("/", 1)[-1] + where)
    if loops:
        _print(loops, "its loop bodies, each counted once")
    if args.deeper:
        a, b = args.depths or (2, 4)
        big, _ = breakdown(args.deeper)
        per_layer = {
            k: [(big.get(k, [0] * 5)[i] - small.get(k, [0] * 5)[i]) / (b - a) for i in range(5)]
            for k in set(small) | set(big)
        }
        _print(per_layer, f"per layer ({a} -> {b} layers)")
        rest = {k: [small.get(k, [0] * 5)[i] - a * per_layer[k][i] for i in range(5)] for k in per_layer}
        _print(rest, "the rest (the intercept: what does not grow with the layers)")


if __name__ == "__main__":
    main()
