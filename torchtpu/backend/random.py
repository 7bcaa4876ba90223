"""The tpu device generator: a seed and an offset, like CUDA's Philox state.

Each random op draws `fold_in(PRNGKey(seed), offset)` and advances the offset, so the key
is a traced input of the op's executable (no recompiles) and the stream is reproducible
under torch.manual_seed.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import torch

_DEFAULT_SEED = 67280421310721
# marks a state taken inside a compiled step (its offset is the step's key counter)
_TRACED_FLAG = 1 << 63


class Generator:
    def __init__(self, seed: int = _DEFAULT_SEED):
        self.seed = seed
        self.offset = 0
        self.lock = threading.Lock()

    def manual_seed(self, seed: int):
        self.seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
        self.offset = 0

    def next_offset(self) -> int:
        with self.lock:
            o = self.offset
            self.offset += 1
            return o

    def get_state(self) -> torch.Tensor:
        # Inside a compiled step the position in the stream is the step's key counter: the state
        # saved there (by torch.utils.checkpoint, fork_rng) replays the same masks when set again.
        offset = self.offset if TRACED is None else TRACED.count | _TRACED_FLAG
        return torch.tensor(np.array([self.seed, offset], dtype=np.uint64).view(np.uint8))

    def set_state(self, state: torch.Tensor):
        raw = state.detach().cpu().to(torch.uint8).numpy().view(np.uint64)
        if raw.shape != (2,):
            raise ValueError("invalid tpu RNG state: expected a 16-byte uint8 tensor from torch.tpu.get_rng_state()")
        seed, offset = int(raw[0]), int(raw[1])
        taken_traced = bool(offset & _TRACED_FLAG)
        if taken_traced != (TRACED is not None):
            taken, setting = ("inside", "outside") if taken_traced else ("outside", "inside")
            raise RuntimeError(
                f"torch.tpu.set_rng_state: this state was taken {taken} a compiled step and is set {setting} "
                "one, where random ops draw from another stream. Take and set the state on the same side, "
                "or reseed with torch.manual_seed."
            )
        if TRACED is not None:
            TRACED.count = offset & ~_TRACED_FLAG
        else:
            self.seed, self.offset = seed, offset


_GENERATORS: dict[int, Generator] = {}


def generator(device_index: int = 0) -> Generator:
    g = _GENERATORS.get(device_index)
    if g is None:
        g = _GENERATORS[device_index] = Generator()
    return g


class TracedKeys:
    """Keys for random ops inside a compiled step: derived from the step's traced base key."""

    def __init__(self, base_key_data):
        self.base = base_key_data
        self.count = 0

    def next(self):
        k = jax.random.fold_in(jax.random.wrap_key_data(self.base), self.count)
        self.count += 1
        return jax.random.key_data(k)


TRACED: TracedKeys | None = None


def key_data_for_step(g: Generator):
    return _key_data(g.seed, g.offset)


def next_key_data(device_index: int = 0):
    """Raw uint32 key data for the next random op (a traced input of its executable)."""
    if TRACED is not None:
        return TRACED.next()
    g = generator(device_index)
    offset = g.next_offset()
    seed = g.seed
    return _key_data(seed, offset)


def _key_data(seed: int, offset: int):
    # Host-side derivation: a tiny numpy array, so no device round trip per op.
    mixed = (seed * 0x9E3779B97F4A7C15 + offset * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    mixed ^= mixed >> 31
    return np.array([mixed >> 32, mixed & 0xFFFF_FFFF], dtype=np.uint32)
