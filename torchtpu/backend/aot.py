"""An XLA program's inputs laid out over devices, and compiling programs ahead of time.

torchtpu.compile runs a step's program over the devices its state lives on: a device mesh
when any input is laid out over one (`program_mesh`), with arrays committed to it. Compiling
ahead of time (`CompiledFunction.compile_for`, the trainer's dry run) needs no arrays at all:
`abstract_storage` describes a storage by shape, dtype and sharding, and `aot_compile`
compiles for any devices, including a TPU topology's on a machine without TPUs.
"""

from __future__ import annotations

import contextlib

import jax

from . import dtypes

_DUMP_DIR: list = [None]
_OPTIONS: list = [{}]


@contextlib.contextmanager
def dump_compiles_to(folder: str):
    """While active, `aot_compile` writes XLA's dump (optimized HLO, buffer assignment, memory
    report) of every program it compiles into `folder`; `largest_temporaries` reads it."""
    before = _DUMP_DIR[0]
    _DUMP_DIR[0] = folder
    try:
        yield folder
    finally:
        _DUMP_DIR[0] = before


@contextlib.contextmanager
def compiler_options(options: dict):
    """While active, `aot_compile` passes these XLA compiler options (on top of its caller's) to
    every program it compiles, and `torchtpu.compile` to the steps it compiles to run;
    `topology.costing_compiles` uses it."""
    before = _OPTIONS[0]
    _OPTIONS[0] = {**before, **options}
    try:
        yield
    finally:
        _OPTIONS[0] = before


def current_compiler_options() -> dict:
    """The XLA compiler options `aot_compile` adds now (`compiler_options` contexts in effect)."""
    return dict(_OPTIONS[0])


def aot_compile(lowered, compiler_options: dict | None = None):
    """`lowered.compile()` for topology devices, bypassing JAX's persistent compilation cache.

    torchtpu turns the persistent cache on; JAX would write the compile-only TPU executable
    into it and on the next run fail to load it ("PjRtCompiler must be constructed with a
    Client"), warn and compile again. The cache is switched off for this one compilation and
    then restored for the process's ordinary compilations.
    """
    from jax.experimental.compilation_cache import compilation_cache as cc

    if _OPTIONS[0]:
        compiler_options = {**_OPTIONS[0], **(compiler_options or {})}
    if _DUMP_DIR[0] is not None:
        # the compiler's own record of the program: optimized HLO and its buffer assignment
        compiler_options = {**(compiler_options or {}), "xla_dump_to": _DUMP_DIR[0]}
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()
    try:
        return lowered.compile(compiler_options) if compiler_options else lowered.compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        cc.reset_cache()


def storage_sharding_hint(st):
    if st.array is not None and not isinstance(st.array, jax.core.Tracer):
        return st.array
    if st.dist is not None:
        return jax.ShapeDtypeStruct(st.shape, jax.numpy.float32, sharding=st.dist.sharding)
    return None


def replicated(mesh):
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def abstract_storage(st, mesh):
    if st.array is not None and not isinstance(st.array, jax.core.Tracer):
        sharding = st.array.sharding
        if mesh is not None and not isinstance(sharding, jax.sharding.NamedSharding):
            sharding = replicated(mesh)
        return jax.ShapeDtypeStruct(st.array.shape, st.array.dtype, sharding=sharding)
    if st.dist is not None:
        sharding = st.dist.sharding
    elif mesh is not None:
        sharding = replicated(mesh)
    else:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[st.device_index])
    return jax.ShapeDtypeStruct(tuple(st.shape), dtypes.to_jax_dtype(st.dtype), sharding=sharding)


def program_mesh(arrays):
    """The device mesh of a program whose inputs include arrays laid out over one (else None)."""
    for a in arrays:
        s = getattr(a, "sharding", None)
        if isinstance(s, jax.sharding.NamedSharding) and s.mesh.size > 1:
            return s.mesh
    return None


def committed(a, device_index, mesh=None):
    if getattr(a, "committed", True):
        return a
    if mesh is not None:
        return jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return jax.device_put(a, jax.devices()[device_index])


def keep_sharding(a, sharding):
    if a is None or not isinstance(sharding, jax.sharding.NamedSharding) or sharding.mesh.size == 1:
        return a
    return jax.lax.with_sharding_constraint(a, sharding)


def unique_arrays(arrays):
    # The same buffer passed twice cannot be donated twice: copy duplicates.
    seen = set()
    out = []
    for a in arrays:
        if id(a) in seen:
            a = jax.numpy.copy(a)
        seen.add(id(a))
        out.append(a)
    return out
