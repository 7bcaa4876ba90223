"""Facts about TPU hardware: the chips, the topology names of their slices and the mesh-axis names.

    chip = chip_of("TPU v5")                  # the table's v5p record (None for a kind it lacks)
    chip.peak_bf16_flops, chip.hbm_bytes      # 459e12, 95 GiB
    topo = parse_topology("v5p:4x4x4")        # Topology("v5p", (4, 4, 4)); TopologyNameError if malformed
    topo.chips, topo.accelerator_type         # 64, "v5p-128"

Every other module reads these facts from here: the kernels choose tiles with a chip's peak, the
configuration counts a topology's chips, the launcher names a slice's TPU type, the dry runs and the
benchmarks cost programs against a chip's peak and bandwidth. Standard library only (an import-linter
contract keeps it so), at the bottom of the layers: anything may import it, reading a configuration
included.
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = [
    "CHIPS",
    "TP_AXIS",
    "ChipSpec",
    "Topology",
    "TopologyNameError",
    "chip_of",
    "chip_spec",
    "parse_topology",
]

GiB = 1024**3
GB = 10**9


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One TPU chip, from Google's published figures."""

    name: str  # generation: "v4", "v5e", "v5p", "v6e"
    peak_bf16_flops: float  # dense bf16 FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    # TensorCores per chip: what a TPU type name counts for v4 and v5p ("v5p-8" is 4 chips); v5e
    # and v6e type names count chips
    cores_per_chip: int
    type_prefix: str  # the TPU type name's prefix (gcloud, xpk): "v5litepod-16" is 16 v5e chips


# The one table of chips (metrics' MFU, the compile reports, the kernels' tile choice and the
# launcher read it). device_kind strings as libtpu reports them (checked with libtpu 0.0.42.1):
# v4 -> "TPU v4", v5e -> "TPU v5 lite", v5p -> "TPU v5", v6e -> "TPU v6 lite".
CHIPS = {
    c.name: c
    for c in (
        ChipSpec("v4", 275e12, hbm_bytes=32 * GiB, hbm_bandwidth=1.2e12, cores_per_chip=2, type_prefix="v4"),
        ChipSpec("v5e", 197e12, hbm_bytes=16 * GB, hbm_bandwidth=8.19e11, cores_per_chip=1, type_prefix="v5litepod"),
        ChipSpec("v5p", 459e12, hbm_bytes=95 * GiB, hbm_bandwidth=2.765e12, cores_per_chip=2, type_prefix="v5p"),
        ChipSpec("v6e", 918e12, hbm_bytes=32 * GB, hbm_bandwidth=1.64e12, cores_per_chip=1, type_prefix="v6e"),
    )
}
_KIND_ALIASES = {
    "v4": "v4",
    "v5lite": "v5e",
    "v5e": "v5e",
    "v5litepod": "v5e",
    "v5": "v5p",
    "v5p": "v5p",
    "v6lite": "v6e",
    "v6e": "v6e",
    "v6": "v6e",
    "trillium": "v6e",
}

# The tensor-parallel mesh axis: attention heads, a linear's output or input features and the
# vocabulary split over it (training's job mesh, serving's one-axis mesh, the kernels' layouts);
# every other axis of a mesh splits the batch.
TP_AXIS = "tp"


def chip_of(device_kind: str) -> ChipSpec | None:
    """The table's record for a device's `device_kind` ("TPU v5 lite", "TPU v5", "TPU v6 lite",
    "TPU v4", spacing and case free) or a generation name ("v5e", "v5p", "v6e", "v4"); None for
    anything else."""
    key = re.sub(r"[\s_-]+", "", str(device_kind).lower()).removeprefix("tpu")
    gen = _KIND_ALIASES.get(key)
    return CHIPS[gen] if gen else None


def chip_spec(device_kind: str) -> dict:
    """`chip_of(device_kind)` as a dict of its fields; an unknown kind is an error."""
    chip = chip_of(device_kind)
    if chip is None:
        raise ValueError(
            f"unknown TPU device kind {device_kind!r}; known: 'TPU v4', 'TPU v5 lite' (v5e), 'TPU v5' (v5p), "
            "'TPU v6 lite' (v6e)"
        )
    return dataclasses.asdict(chip)


class TopologyNameError(ValueError):
    """A TPU topology name that is not GENERATION:AxB or GENERATION:AxBxC."""


_TOPOLOGY = re.compile(r"(v\d+[a-z]*):(\d+)x(\d+)(?:x(\d+))?")
TOPOLOGY_FORM = 'GENERATION:AxB[xC], e.g. "v5p:4x4x4", "v5e:2x4", "v6e:16x16"'


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice by its topology name: "v5p:4x4x4" is generation "v5p", chips per axis (4, 4, 4)."""

    generation: str
    dims: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.dims)

    @property
    def shape(self) -> str:
        """The chips per axis as the name writes them: "4x4x4"."""
        return "x".join(map(str, self.dims))

    @property
    def accelerator_type(self) -> str:
        """The slice's TPU type name (gcloud, xpk, TPU_ACCELERATOR_TYPE): v5p:2x2x1 -> "v5p-8" (v4
        and v5p count TensorCores, two per chip), v5e:2x2 -> "v5litepod-4", v6e:2x2 -> "v6e-4"; a
        generation outside the chip table counts chips."""
        chip = chip_of(self.generation)
        if chip is None:
            return f"{self.generation}-{self.chips}"
        return f"{chip.type_prefix}-{self.chips * chip.cores_per_chip}"


def parse_topology(name: str) -> Topology:
    """The one reading of a TPU topology name: "v5p:4x4x4" -> Topology("v5p", (4, 4, 4)).

    GENERATION is "v" and a number with an optional suffix (v4, v5e, v5p, v6e, ...), then two or
    three chip counts; anything else raises TopologyNameError. The generation is not checked
    against the chip table: libtpu and the launcher each say which generations they know."""
    m = _TOPOLOGY.fullmatch(name) if isinstance(name, str) else None
    if not m:
        raise TopologyNameError(f"invalid TPU topology {name!r}: expected {TOPOLOGY_FORM}")
    return Topology(m.group(1), tuple(int(d) for d in m.groups()[1:] if d is not None))
