"""Checkpoint and resume with Orbax.

A training state is a nested structure (dicts, lists, tuples) whose leaves are

* tpu tensors (possibly sharded): saved as their `jax.Array`, so Orbax writes each host's own
  shards and nothing is gathered to one host; restored with the *target's* sharding and written
  back into the target tensor in place (parameters and optimizer moments stay the same objects);
* CPU tensors, NumPy arrays, NumPy scalars and plain `jax.Array`s;
* Python scalars, strings, bytes and None (data loader state, LR scheduler state, step counter).

On disk one step is `<folder>/step_<N>/` with two Orbax items:

* `arrays`: every array leaf, under a readable name derived from its key path;
* `manifest`: JSON describing the structure (container kinds, dict keys of any JSON type), the
  Python values, and for each array its kind, dtype and shape. Shape and dtype mismatches are
  therefore reported by key before Orbax reads any data.

Writing is atomic (Orbax writes into a temporary directory and renames it when complete), so a
crash mid-save leaves the previous checkpoints intact; leftover temporary directories are reported
(`partial_saves`) and cleaned up the next time the folder is opened. A complete-looking checkpoint
whose files were damaged later fails to restore with a `CheckpointError` naming its path and the
key; `set_aside(step)` renames it to `step_<N>.unreadable` so that resuming can fall back to the
next older checkpoint (and the same step can be saved again). Step directories that this module did not write are never
deleted or overwritten: opening a folder that holds them raises `CheckpointError`.

    ckpt = CheckpointManager("runs/ckpt", interval=100, keep_latest_k=3)
    state = {"model": model_state(model), "optim": optimizer_state(opt), "step": step}
    if ckpt.latest_step() is not None:
        restored = ckpt.restore(target=state)          # tpu tensors updated in place
        load_optimizer_state(opt, restored["optim"])   # creates lazily-initialised state
        step = restored["step"]
    ...
    ckpt.save(step, state)                            # every `interval` steps, asynchronously
    ckpt.close()                                      # waits for the last save
"""
from __future__ import annotations

import base64
import os
import re
from typing import Any

import jax
import numpy as np
import torch

from torchtpu.backend import dtypes
from torchtpu.backend.views import array_of, write
from torchtpu.backend.tensor import TpuTensor
from torchtpu.backend.transfer import from_jax

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "CheckpointManager",
    "model_state",
    "load_model_state",
    "optimizer_state",
    "load_optimizer_state",
    "model_only_state",
    "is_model_only",
    "load_model_weights",
    "split_step_path",
    "canonical_name",
]

FORMAT_VERSION = 1
_PREFIX = "step"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Orbax's temporary directory for a save in progress: step_<N>.orbax-checkpoint-tmp-<id>
_PARTIAL_DIR = re.compile(r"^step_(\d+)\.orbax-checkpoint-tmp")
_SET_ASIDE = ".unreadable"
_ARRAYS = "arrays"
_MANIFEST = "manifest"
_ASYNC_MODES = {"async": True, "async_with_pinned_mem": True, "sync": False, "disabled": False}


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path, key and fix."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files cannot be read back (truncated, damaged, or partly deleted); `.path` is
    its step folder. Unlike a checkpoint written for another model, an older one may still be good."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


# ----------------------------------------------------------------------------- encoding
# The manifest is a tree of tagged JSON nodes:
#   {"dict": [[key, node], ...]}  {"list": [node, ...]}  {"tuple": [node, ...]}
#   {"value": json scalar}        {"bytes": base64}
#   {"array": name, "kind": "tpu"|"cpu"|"numpy"|"npscalar"|"jax", "dtype": str, "shape": [...]}


def _keystr(path) -> str:
    return "".join(f"[{k!r}]" for k in path) or "<root>"


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return np.dtype(dtype).name


def _jax_dtype(name: str):
    t = getattr(torch, name, None)
    if isinstance(t, torch.dtype):
        return dtypes.to_jax_dtype(t)
    return np.dtype(name)


def _torch_dtype(name: str) -> torch.dtype:
    t = getattr(torch, name, None)
    if not isinstance(t, torch.dtype):
        raise CheckpointError(f"checkpoint holds dtype {name!r} that torch does not know")
    return t


_NAME_BAD = re.compile(r"[^A-Za-z0-9_.-]")


class _Encoder:
    def __init__(self):
        self.arrays: dict[str, Any] = {}

    def _name(self, path) -> str:
        base = _NAME_BAD.sub("_", ".".join(str(k) for k in path)) or "root"
        name, i = base, 1
        while name in self.arrays:
            name = f"{base}__{i}"
            i += 1
        return name

    def _array(self, path, value, kind, dtype, shape, extra=None) -> dict:
        name = self._name(path)
        self.arrays[name] = value
        node = {"array": name, "kind": kind, "dtype": _dtype_name(dtype), "shape": list(shape)}
        if extra:
            node.update(extra)
        return node

    def encode(self, obj, path=()):
        if isinstance(obj, TpuTensor):
            a = array_of(obj)
            return self._array(path, a, "tpu", obj.dtype, obj.shape, {"requires_grad": bool(obj.requires_grad)})
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                raise CheckpointError(
                    f"cannot checkpoint key {_keystr(path)}: tensor on device {obj.device}; "
                    "move it to 'tpu' or 'cpu' first"
                )
            a = np.array(dtypes.torch_to_numpy(obj.detach()), copy=True)  # later writes must not show
            return self._array(path, a, "cpu", obj.dtype, obj.shape, {"requires_grad": bool(obj.requires_grad)})
        if isinstance(obj, jax.Array):
            return self._array(path, obj, "jax", obj.dtype, obj.shape)
        if isinstance(obj, np.ndarray):
            return self._array(path, np.array(obj, copy=True), "numpy", obj.dtype, obj.shape)
        if isinstance(obj, np.generic):
            return self._array(path, np.asarray(obj), "npscalar", obj.dtype, ())
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return {"value": obj}
        if isinstance(obj, bytes):
            return {"bytes": base64.b64encode(obj).decode("ascii")}
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise CheckpointError(
                        f"cannot checkpoint key {_keystr(path + (k,))}: dict keys must be str, int, float, "
                        f"bool or None, got {type(k).__name__}"
                    )
                items.append([k, self.encode(v, path + (k,))])
            return {"dict": items}
        if isinstance(obj, (list, tuple)):
            tag = "tuple" if isinstance(obj, tuple) else "list"
            return {tag: [self.encode(v, path + (i,)) for i, v in enumerate(obj)]}
        raise CheckpointError(
            f"cannot checkpoint key {_keystr(path)}: unsupported type {type(obj).__module__}.{type(obj).__qualname__}; "
            "use tensors, arrays, Python scalars/strings or dicts/lists of them (e.g. call .state_dict())"
        )


def _get(target, key):
    """target[key] for a dict/list/tuple target, or _MISSING."""
    if isinstance(target, dict):
        return target.get(key, _MISSING)
    if isinstance(target, (list, tuple)) and isinstance(key, int) and 0 <= key < len(target):
        return target[key]
    return _MISSING


_MISSING = object()


def _array_nodes(node, path=()):
    """(path, node) for every array node of a manifest tree."""
    if "array" in node:
        yield path, node
    elif "dict" in node:
        for k, v in node["dict"]:
            yield from _array_nodes(v, path + (k,))
    elif "list" in node or "tuple" in node:
        for i, v in enumerate(node.get("list", node.get("tuple"))):
            yield from _array_nodes(v, path + (i,))


def _children(node) -> dict | list:
    """The children of a manifest container node as a dict (or list), for `_get`."""
    if "dict" in node:
        return {k: v for k, v in node["dict"]}
    return list(node.get("list", node.get("tuple", [])))


def _tensor_leaves(obj, path=()):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensor_leaves(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensor_leaves(v, path + (i,))


# ----------------------------------------------------------------------------- manager


class CheckpointManager:
    """Save the training state every `interval` steps and restore it, with Orbax.

    folder: where `step_<N>` directories go (created on the first save).
    interval: save when `step % interval == 0` (and whenever `save(..., force=True)`).
    keep_latest_k: keep only the newest k checkpoints (0 keeps all).
    async_mode: "async" (write in the background; `save` returns once the arrays have been copied
        to host memory) or "sync"; torchtitan's "disabled"/"async_with_pinned_mem" are accepted.
    enable: False makes `save` a no-op and `latest_step()` None.
    """

    def __init__(self, folder: str, interval: int, keep_latest_k: int = 0, async_mode: str = "async", enable: bool = True):
        if async_mode not in _ASYNC_MODES:
            raise ValueError(f"checkpoint async_mode={async_mode!r} is not one of {', '.join(_ASYNC_MODES)}")
        if int(interval) < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {interval}")
        if int(keep_latest_k) < 0:
            raise ValueError(f"checkpoint keep_latest_k must be >= 0 (0 keeps all), got {keep_latest_k}")
        self.folder = os.path.abspath(os.path.expanduser(str(folder)))
        self.interval = int(interval)
        self.keep_latest_k = int(keep_latest_k)
        self.async_mode = async_mode
        self.enable = bool(enable)
        self._mgr = None
        self._pending_step = None
        # saves that never finished (a process killed mid-save), found before Orbax removes them
        self.partial_saves: list[str] = self._find_partial_saves()

    # -- orbax manager

    def _find_partial_saves(self) -> list[str]:
        if not os.path.isdir(self.folder):
            return []
        return [os.path.join(self.folder, e) for e in sorted(os.listdir(self.folder))
                if _PARTIAL_DIR.match(e) and os.path.isdir(os.path.join(self.folder, e))]

    def _check_folder(self):
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise CheckpointError(
                f"checkpoint folder {self.folder} is a file, not a directory; choose another checkpoint folder"
            )
        if not os.path.isdir(self.folder):
            return
        for entry in sorted(os.listdir(self.folder)):
            full = os.path.join(self.folder, entry)
            if _STEP_DIR.match(entry) and os.path.isdir(full) and not os.path.isdir(os.path.join(full, _MANIFEST)):
                raise CheckpointError(
                    f"checkpoint folder {self.folder} holds {entry}, which torchtpu did not write; it will not be "
                    "overwritten or deleted: choose another checkpoint folder (or move that directory away)"
                )

    def _manager(self, create: bool):
        if self._mgr is not None:
            return self._mgr
        import orbax.checkpoint as ocp

        self._check_folder()
        if not create and not os.path.isdir(self.folder):
            raise CheckpointError(
                f"no checkpoint folder at {self.folder}: nothing to restore; check the checkpoint folder setting "
                "or start without resuming"
            )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep_latest_k or None,
            step_prefix=_PREFIX,
            create=create,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=_ASYNC_MODES[self.async_mode],
        )
        try:
            self._mgr = ocp.CheckpointManager(self.folder, options=options, item_names=(_ARRAYS, _MANIFEST))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"cannot open checkpoint folder {self.folder}: {_first_line(e)}; check the path and its permissions"
            ) from e
        return self._mgr

    # -- queries

    def all_steps(self) -> list[int]:
        if not self.enable or (self._mgr is None and not os.path.isdir(self.folder)):
            return []
        return sorted(self._manager(create=False).all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None (also when checkpointing is disabled)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_path(self, step: int) -> str:
        return os.path.join(self.folder, f"{_PREFIX}_{int(step)}")

    def set_aside(self, step: int) -> str:
        """Rename the (unreadable) checkpoint `step` to step_<N>.unreadable[-k] so it is no longer
        a step of this folder: resuming skips it, and step N can be saved again. Nothing is deleted.
        Returns the new path. In a multi-host job only process 0 renames."""
        src = self.step_path(step)
        dst, k = src + _SET_ASIDE, 1
        while os.path.exists(dst):
            dst, k = f"{src}{_SET_ASIDE}-{k}", k + 1
        if self._mgr is not None:
            self._mgr.close()
            self._mgr = None
        if jax.process_index() == 0 and os.path.isdir(src):
            os.rename(src, dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"torchtpu checkpoint set aside {src}")
        return dst

    def should_save(self, step: int, force: bool = False) -> bool:
        return self.enable and (force or (step > 0 and step % self.interval == 0))

    # -- save

    def save(self, step: int, state: dict, force: bool = False) -> bool:
        """Save `state` as checkpoint `step` if it is due (or `force`); returns whether it started.

        In async mode this returns once the arrays are copied off the devices; the files are
        written in the background (`wait()` blocks until they are complete). A step that is
        already on disk is not written again.
        """
        step = int(step)
        if not self.should_save(step, force):
            return False
        mgr = self._manager(create=True)
        if step in mgr.all_steps() or step == self._pending_step:
            return False
        enc = _Encoder()
        manifest = {
            "format": FORMAT_VERSION,
            "writer": "torchtpu",
            "step": step,
            "tree": enc.encode(state),
        }
        import orbax.checkpoint as ocp

        items = {_MANIFEST: ocp.args.JsonSave(manifest)}
        if enc.arrays:
            items[_ARRAYS] = ocp.args.StandardSave(enc.arrays)
        try:
            mgr.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"saving checkpoint {self.step_path(step)} failed: {_first_line(e)}; check free disk space and "
                "write permission for the checkpoint folder"
            ) from e
        self._pending_step = step
        return True

    def wait(self) -> None:
        """Block until the last asynchronous save is complete on disk."""
        if self._mgr is None:
            return
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            step = self._pending_step
            raise CheckpointError(
                f"saving checkpoint {self.step_path(step) if step is not None else self.folder} failed: "
                f"{_first_line(e)}; check free disk space and write permission for the checkpoint folder"
            ) from e
        finally:
            self._pending_step = None

    def close(self) -> None:
        """Wait for pending saves and release Orbax's resources."""
        if self._mgr is None:
            return
        try:
            self.wait()
        finally:
            self._mgr.close()
            self._mgr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- restore

    def manifest(self, step: int) -> dict:
        """The manifest tree of checkpoint `step` (structure, Python values, array dtypes and shapes),
        read without touching any array data."""
        mgr = self._manager(create=False)
        steps = sorted(mgr.all_steps())
        if int(step) not in steps:
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.folder} (available: {steps or 'none'}); "
                "pass one of the available steps"
            )
        import orbax.checkpoint as ocp

        try:
            return mgr.restore(int(step), args=ocp.args.Composite(**{_MANIFEST: ocp.args.JsonRestore()}))[_MANIFEST]["tree"]
        except Exception as e:  # noqa: BLE001
            raise _corrupt(self.step_path(step), "manifest", e, steps, int(step)) from e

    def restore(self, step: int | None = None, target: Any = None, subtree: tuple = (), skip: tuple = ()) -> Any:
        """Restore checkpoint `step` (default: the newest) into `target`.

        Returns the checkpoint's structure. Where `target` has a tensor at the same key, that
        tensor is filled in place and returned (a tpu tensor keeps its own sharding: each device
        reads only its shard). A `jax.ShapeDtypeStruct` in `target` gives the sharding for a new
        tensor. Other array leaves come back as new tensors/arrays (tpu tensors without a target
        go to the first local device), Python values as they were saved.

        subtree: a key path, e.g. ("model",): restore only that part of the checkpoint (`target`
        then describes that part); no other array is read.
        skip: top-level keys (of the part restored) whose arrays are not read at all; their tensors
        in `target` stay untouched and they come back as None.
        """
        mgr = self._manager(create=False)
        steps = sorted(mgr.all_steps())
        if step is None:
            if not steps:
                raise CheckpointError(
                    f"no checkpoint in {self.folder}: nothing to restore; check the checkpoint folder setting "
                    "or start without resuming"
                )
            step = steps[-1]
        step = int(step)
        path = self.step_path(step)
        if step not in steps:
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.folder} (available: {steps or 'none'}); "
                "pass one of the available steps"
            )
        import orbax.checkpoint as ocp

        try:
            manifest = mgr.restore(step, args=ocp.args.Composite(**{_MANIFEST: ocp.args.JsonRestore()}))[_MANIFEST]
            tree = manifest["tree"]
        except Exception as e:  # noqa: BLE001
            raise _corrupt(path, "manifest", e, steps, step) from e
        for k in subtree:
            sub = _get(_children(tree), k)
            if sub is _MISSING:
                raise CheckpointError(f"checkpoint {path} has no part {_keystr(subtree)}: it holds "
                                      f"{sorted(map(str, _children(tree)))}; it was written by a different program")
            tree = sub

        # Build the abstract array tree from the manifest and the target.
        abstract = {}
        placed = {}  # array name -> target tensor (filled in place) or None
        skipped = {k for k in skip if isinstance(tree, dict) and "dict" in tree}
        nodes = [(kp, n) for kp, n in _array_nodes(tree) if not (kp and kp[0] in skipped)]
        for kpath, node in nodes:
            t = target
            for k in kpath:
                t = _get(t, k) if t is not _MISSING else _MISSING
            abstract[node["array"]] = self._abstract(path, kpath, node, t)
            placed[node["array"]] = t if isinstance(t, torch.Tensor) else None
        # Tensors the target has but the checkpoint lacks: the model or optimizer differs.
        saved = {kp for kp, _ in nodes}
        for kpath, t in _tensor_leaves(target):
            if kpath not in saved and not (kpath and kpath[0] in skipped):
                raise CheckpointError(
                    f"checkpoint {path} has no key {_keystr(kpath)} that the target needs: the checkpoint was written "
                    "by a different model/optimizer; restore with the matching model config or use a fresh checkpoint folder"
                )

        arrays = {}
        if abstract and (subtree or skipped):
            # Only this part's arrays: a partial PyTree restore of the arrays item reads just the
            # names given (the manager's standard handler insists on the whole tree).
            try:
                reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
                arrays = reader.restore(os.path.join(path, _ARRAYS), args=ocp.args.PyTreeRestore(
                    item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                    partial_restore=True))
            except Exception as e:  # noqa: BLE001
                raise _corrupt(path, _guess_key(e, nodes), e, steps, step) from e
        elif abstract:
            try:
                arrays = mgr.restore(step, args=ocp.args.Composite(**{_ARRAYS: ocp.args.StandardRestore(abstract)}))[_ARRAYS]
            except Exception as e:  # noqa: BLE001
                raise _corrupt(path, _guess_key(e, nodes), e, steps, step) from e
        if skipped:
            tree = {"dict": [[k, {"value": None} if k in skipped else v] for k, v in tree["dict"]]}
        return _decode(tree, arrays, placed)

    @staticmethod
    def _abstract(path, kpath, node, t):
        shape = tuple(node["shape"])
        kind = node["kind"]
        jdt = _jax_dtype(node["dtype"])
        if isinstance(t, (torch.Tensor, jax.ShapeDtypeStruct, jax.Array)):
            t_shape = tuple(t.shape)
            t_dtype = _dtype_name(t.dtype)
            if t_shape != shape or t_dtype != node["dtype"]:
                raise CheckpointError(
                    f"checkpoint {path} key {_keystr(kpath)} is {node['dtype']}{list(shape)} but the target is "
                    f"{t_dtype}{list(t_shape)}: the model/optimizer config differs from the one that wrote the "
                    "checkpoint; use the matching config or a fresh checkpoint folder"
                )
        if isinstance(t, TpuTensor):
            return jax.ShapeDtypeStruct(shape, jdt, sharding=array_of(t).sharding)
        if isinstance(t, jax.ShapeDtypeStruct) and t.sharding is not None:
            return jax.ShapeDtypeStruct(shape, jdt, sharding=t.sharding)
        if isinstance(t, jax.Array):
            return jax.ShapeDtypeStruct(shape, jdt, sharding=t.sharding)
        if kind in ("tpu", "jax"):
            dev = jax.local_devices()[0]
            return jax.ShapeDtypeStruct(shape, jdt, sharding=jax.sharding.SingleDeviceSharding(dev))
        return jax.ShapeDtypeStruct(shape, jdt)  # host array (NumPy)


def _decode(node, arrays, placed):
    if "array" in node:
        name = node["array"]
        a = arrays[name]
        t = placed.get(name)
        kind = node["kind"]
        if isinstance(t, TpuTensor):
            write(t, a if isinstance(a, jax.Array) else jax.device_put(a, array_of(t).sharding))
            return t
        if isinstance(t, torch.Tensor):  # CPU tensor target: copy in place
            with torch.no_grad():
                t.copy_(dtypes.numpy_to_torch(np.asarray(a), t.dtype))
            return t
        if kind == "tpu":
            if not isinstance(a, jax.Array):
                a = jax.device_put(a, jax.local_devices()[0])
            r = from_jax(a)
            if node.get("requires_grad"):
                r.requires_grad_(True)
            return r
        if kind == "cpu":
            r = dtypes.numpy_to_torch(np.array(a, copy=True), _torch_dtype(node["dtype"]))
            if node.get("requires_grad"):
                r.requires_grad_(True)
            return r
        if kind == "jax":
            return a if isinstance(a, jax.Array) else jax.numpy.asarray(a)
        if kind == "npscalar":
            return np.asarray(a).reshape(())[()]
        return np.asarray(a)
    if "value" in node:
        return node["value"]
    if "bytes" in node:
        return base64.b64decode(node["bytes"])
    if "dict" in node:
        return {k: _decode(v, arrays, placed) for k, v in node["dict"]}
    if "tuple" in node:
        return tuple(_decode(v, arrays, placed) for v in node["tuple"])
    if "list" in node:
        return [_decode(v, arrays, placed) for v in node["list"]]
    raise CheckpointError(f"unknown manifest node {sorted(node)}")


def _first_line(e: BaseException, limit: int = 500) -> str:
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0] if text else ''}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _guess_key(e: BaseException, nodes) -> str:
    text = str(e)
    for kpath, node in nodes:
        if re.search(rf"(?<![A-Za-z0-9_.-]){re.escape(node['array'])}(?![A-Za-z0-9_.-])", text):
            return _keystr(kpath)
    return "arrays"


def _corrupt(path, key, e, steps, step) -> CheckpointError:
    older = [s for s in steps if s < step]
    fix = (f"restore an earlier step (restore(step={older[-1]})) or delete {path}" if older
           else f"delete {path} and start without resuming")
    return CorruptCheckpointError(
        f"checkpoint {path} is unreadable at key {key}: it is corrupt or incomplete; {fix} (cause: {_first_line(e, 240)})",
        path)


# ----------------------------------------------------------------------------- module and optimizer helpers


def model_state(module: torch.nn.Module) -> dict:
    """The module's parameters and buffers by name, as the tensors themselves (restoring fills them in place)."""
    return module.state_dict(keep_vars=True)


def load_model_state(module: torch.nn.Module, state: dict) -> None:
    """Load a restored model state; a no-op for tensors that `restore` already filled in place."""
    own = module.state_dict(keep_vars=True)
    if all(own.get(k) is v for k, v in state.items()) and len(own) == len(state):
        return
    module.load_state_dict(state)


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()`: its state tensors are the optimizer's own (restoring fills them in place)."""
    return optimizer.state_dict()


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a restored optimizer state, including one restored before the optimizer's first step.

    State tensors that `restore` created (no target existed because the optimizer initialises
    its state lazily) are moved to the sharding of their parameter.
    """
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, TpuTensor):
                continue
            st = optimizer.state.get(p)
            if not st:
                continue
            want = array_of(p).sharding
            for key, v in st.items():
                if isinstance(v, TpuTensor) and tuple(v.shape) == tuple(p.shape):
                    a = array_of(v)
                    if not a.sharding.is_equivalent_to(want, a.ndim):
                        write(v, jax.device_put(a, want))


# ----------------------------------------------------------------------------- model-only saves
# A model-only save (torchtitan's last_save_model_only) is {"model": {name: tensor}, "model_only":
# True, "step": N}, the weights possibly cast to an export dtype. Names are the module's own
# parameter/buffer names without activation-checkpoint wrapper prefixes, so a job with another
# activation-checkpointing setting can load them.

_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def _canonical(name: str) -> str:
    return name.replace(_WRAPPER_PREFIX, "")


def canonical_name(name: str) -> str:
    """A parameter/buffer name without activation-checkpoint wrapper prefixes (the model's own name)."""
    return _canonical(name)


def model_only_state(module: torch.nn.Module, step: int, dtype: torch.dtype | None = None) -> dict:
    """The model's weights as a model-only save; floating tensors cast to `dtype` when given
    (the cast copies keep each tensor's sharding)."""
    out = {}
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=True).items():
            t = t.detach()
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            out[_canonical(name)] = t
    return {"model": out, "model_only": True, "step": int(step)}


def split_step_path(path: str) -> tuple[str, int | None]:
    """A checkpoint folder, or one of its step_N folders, as (folder, N or None)."""
    path = os.path.abspath(os.path.expanduser(str(path))).rstrip(os.sep)
    m = _STEP_DIR.match(os.path.basename(path))
    return (os.path.dirname(path), int(m.group(1))) if m else (path, None)


def is_model_only(tree: dict) -> bool:
    """Whether a manifest tree (CheckpointManager.manifest) is a model-only save."""
    node = _children(tree).get("model_only") if "dict" in tree else None
    return bool(node and node.get("value"))


def load_model_weights(manager: "CheckpointManager", step: int, module: torch.nn.Module) -> None:
    """Fill `module`'s parameters and buffers in place from the "model" part of checkpoint `step`
    (a full or a model-only save). Each device reads only its shards; weights saved in another
    floating dtype (an export dtype) are cast to the module's. Nothing else is read."""
    path = manager.step_path(step)
    tree = manager.manifest(step)
    model = _children(tree).get("model") if "dict" in tree else None
    if not model or "dict" not in model:
        raise CheckpointError(f"checkpoint {path} holds no model weights (no 'model' part); it was not written by "
                              "torchtpu-train: point to a torchtpu-train checkpoint")
    saved = {_canonical(k): (k, node) for k, node in model["dict"] if "array" in node}
    own = {_canonical(k): t for k, t in module.state_dict(keep_vars=True).items()}
    missing = sorted(set(own) - set(saved))
    extra = sorted(set(saved) - set(own))
    if missing or extra:
        few = lambda names: ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")  # noqa: E731
        what = "; ".join([f"missing {few(missing)}"] * bool(missing) + [f"unexpected {few(extra)}"] * bool(extra))
        raise CheckpointError(f"checkpoint {path} does not hold this model's weights ({what}): it was written for "
                              "another model; use the [model] name/flavor that wrote it")
    target = {}
    for canon, (key, node) in saved.items():
        t = own[canon]
        if tuple(node["shape"]) != tuple(t.shape):
            raise CheckpointError(f"checkpoint {path} key {key!r} is {node['dtype']}{list(node['shape'])} but the model "
                                  f"has {_dtype_name(t.dtype)}{list(t.shape)}: it was written for another model; use the "
                                  "[model] name/flavor that wrote it")
        if t.is_floating_point() != _torch_dtype(node["dtype"]).is_floating_point:
            raise CheckpointError(f"checkpoint {path} key {key!r} is {node['dtype']} but the model's is "
                                  f"{_dtype_name(t.dtype)}: it was written for another model")
        sharding = array_of(t).sharding if isinstance(t, TpuTensor) else None
        target[key] = jax.ShapeDtypeStruct(tuple(node["shape"]), _jax_dtype(node["dtype"]), sharding=sharding)
    restored = manager.restore(step, target=target, subtree=("model",))
    with torch.no_grad():
        for canon, (key, _) in saved.items():
            t, r = own[canon], restored[key]
            if isinstance(t, TpuTensor):
                a = array_of(r) if isinstance(r, TpuTensor) else jax.numpy.asarray(r)
                want = array_of(t)
                if a.dtype != want.dtype:
                    a = a.astype(want.dtype)
                if not a.sharding.is_equivalent_to(want.sharding, a.ndim):
                    a = jax.device_put(a, want.sharding)
                write(t, a)
            else:
                t.copy_(r.to(device=t.device, dtype=t.dtype) if isinstance(r, torch.Tensor)
                        else torch.from_numpy(np.asarray(r)).to(t.dtype))
