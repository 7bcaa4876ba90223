"""Where Pallas kernels run, shared by the project's kernels (backend/ops/*_tpu.py) and jax_op.py.

A Mosaic kernel compiles only for TPU; on every other platform (XLA:CPU in the tests) a kernel runs
in Pallas's interpret mode, as plain JAX. And a Mosaic custom call is one XLA cannot partition:
over a device mesh a kernel runs per shard (`jax.shard_map`), over the mesh `mesh_of` finds.
"""

from __future__ import annotations

import contextlib

import jax


@contextlib.contextmanager
def interpret_kernels():
    """Within this block, Pallas TPU kernels run in interpret mode on any platform (numerics
    tests on CPU). The setting is part of JAX's jit cache key, so cached per-op executables are
    not reused across it."""
    from jax._src import config as jax_config

    state = jax_config.pallas_tpu_interpret_mode_context_manager
    prev = state.swap_local(True)
    try:
        yield
    finally:
        state.set_local(prev)


def interpreting() -> bool:
    from jax._src import config as jax_config

    return bool(jax_config.pallas_tpu_interpret_mode_context_manager.value)


def mesh_of(*arrays):
    """The mesh a program lays these arrays out on: inside a jit over mesh-sharded inputs JAX
    records it (abstract) in the types of the inputs and of everything computed from them."""
    for a in arrays:
        mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and mesh.size > 1:
            return mesh
    return None
