"""The dry run's cache of compile reports, keyed by the program.

    key = program_key(lowered, devices)     # None when the cache is off
    record = load(key)                      # {"report", "temporaries", "compile_seconds", "created"} or None
    save(key, record)

A TPU executable compiled for a topology's compile-only devices cannot be loaded again (JAX's
own persistent cache fails on it: "PjRtCompiler must be constructed with a Client"), and the
dry run's programs take minutes to compile on a small VM: the 8B step about 1.5 minutes, its
two costing copies about 4 more. So the dry run keeps what it reads from each compiled program
(`topology.compile_report`'s figures, the largest temporaries, the compile time) under a key
that covers everything that decides them:

- the lowered program's text (every shape, dtype, sharding and op, and the mesh);
- the XLA compiler options in effect (`backend.aot.compiler_options`, e.g. the costing ones);
- the devices: kind, count, ids and coordinates;
- the versions of jax, jaxlib and libtpu, XLA_FLAGS and LIBTPU_INIT_ARGS;
- torchtpu's own source (any edit of the code that computes the reports is another key).

A repeated dry run of the same job (another learning rate, step count or checkpoint folder: not
the program) therefore prints what compiling again would print, in seconds, and says it is
cached. Location: $TORCHTPU_CACHE_DIR/dry_run (~/.cache/torchtpu/dry_run); off with
TORCHTPU_CACHE_DIR=off or TORCHTPU_DRY_RUN_CACHE=off.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os

__all__ = ["load", "program_key", "save"]

_FORMAT = 1  # bump when a record's fields change meaning


def folder() -> str | None:
    """The cache's folder, None when it is off."""
    from torchtpu import cache_root

    if os.environ.get("TORCHTPU_DRY_RUN_CACHE", "").strip().lower() in ("0", "off", "none", "false"):
        return None
    root = cache_root()
    return None if root is None else os.path.join(root, "dry_run")


@functools.cache
def _environment() -> str:
    """Versions and source that decide what a compiled program reports (fixed for a process)."""
    from importlib import metadata

    import torchtpu

    parts = [f"format {_FORMAT}"]
    for dist in ("jax", "jaxlib", "libtpu"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} none")
    src = hashlib.sha256()
    root = os.path.dirname(torchtpu.__file__)
    for here, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(here, name)
                src.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    src.update(f.read())
    parts.append(f"torchtpu source {src.hexdigest()}")
    return "\n".join(parts)


def program_key(lowered, devices) -> str | None:
    """The cache key of `lowered` (a `jax.stages.Lowered`) compiled for `devices` (a mesh or a
    list of devices) with the compiler options now in effect; None when the cache is off."""
    import numpy as np

    from torchtpu.backend.aot import current_compiler_options

    if folder() is None:
        return None
    devs = list(np.asarray(getattr(devices, "devices", devices)).flat)
    h = hashlib.sha256()
    for part in (
        _environment(),
        json.dumps(current_compiler_options(), sort_keys=True, default=str),
        repr([(d.device_kind, d.id, tuple(getattr(d, "coords", ()))) for d in devs]),
        os.environ.get("XLA_FLAGS", ""),
        os.environ.get("LIBTPU_INIT_ARGS", ""),
        lowered.as_text(),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _path(key: str) -> str:
    return os.path.join(folder() or "", f"{key}.json")


def load(key: str | None) -> dict | None:
    """The record saved under `key`, None when there is none (or it cannot be read: a damaged
    record is a miss, and compiling again replaces it)."""
    if key is None or folder() is None:
        return None
    try:
        with open(_path(key)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if (
        not isinstance(record, dict)
        or record.get("key") != key
        or not isinstance(record.get("report"), dict)
        or not isinstance(record.get("temporaries", 0), (list, type(None)))
        or not isinstance(record.get("compile_seconds"), (int, float))
        or not isinstance(record.get("created"), str)
    ):
        return None
    return record


def save(key: str | None, report: dict, temporaries, compile_seconds: float):
    """Keep `report` (and the largest temporaries, and the compile time) under `key`; returns
    (report, temporaries) as the cache holds them (JSON: tuples become lists), so that a run that
    compiled prints what a cached run will. A report that JSON would change in any other way is
    not kept; nor is anything when the cache cannot be written (read-only home, full disk): the
    dry run never fails for its cache."""
    if key is None or folder() is None:
        return report, temporaries
    try:
        text = json.dumps({"report": report, "temporaries": temporaries})
    except (TypeError, ValueError):
        return report, temporaries
    portable = json.loads(text)
    if _plain(portable) != _plain({"report": report, "temporaries": temporaries}):
        return report, temporaries
    record = {
        "key": key,
        **portable,
        "compile_seconds": compile_seconds,
        "created": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    path = _path(key)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)  # whole or not at all: a reader never sees half a record
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
    return portable["report"], portable["temporaries"]


def _plain(x):
    """`x` with tuples as lists: what JSON may change without changing a value."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x
