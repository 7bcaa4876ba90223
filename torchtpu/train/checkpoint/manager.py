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

import os
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec

from torchtpu.backend import TpuTensor, array_of, write

from .files import (
    ARRAYS,
    MANIFEST,
    STEP_PREFIX,
    CheckpointError,
    CorruptCheckpointError,
    aside_path,
    check_folder,
    corrupt_error,
    find_partial_saves,
    first_line,
    save_error,
    split_step_path,
)
from .manifest import (
    FORMAT_VERSION,
    MISSING,
    Encoder,
    array_nodes,
    child,
    children,
    decode,
    dtype_name,
    guess_key,
    jax_dtype,
    keystr,
    tensor_leaves,
    torch_dtype,
)

__all__ = [
    "CheckpointError",  # from checkpoint_files
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

_ASYNC_MODES = {"async": True, "async_with_pinned_mem": True, "sync": False, "disabled": False}


# ----------------------------------------------------------------------------- manager


class CheckpointManager:
    """Save the training state every `interval` steps and restore it, with Orbax.

    folder: where `step_<N>` directories go (created on the first save).
    interval: save when `step % interval == 0` (and whenever `save(..., force=True)`).
    keep_latest_k: keep only the newest k checkpoints (0 keeps all).
    async_mode: "async" (write in the background; `save` returns once the arrays have been copied
        to host memory) or "sync"; torchtitan's "disabled"/"async_with_pinned_mem" are accepted.
    enable: False makes `save` a no-op and `latest_step()` None.
    read_only: only read the folder (generate, convert, a resume from another job's folder): Orbax's
        clean-up of unfinished saves' temporary folders stays off, so a reader never removes the save a
        running job has in flight, and leaves no clean-up thread behind.
    """

    def __init__(
        self,
        folder: str,
        interval: int,
        keep_latest_k: int = 0,
        async_mode: str = "async",
        enable: bool = True,
        read_only: bool = False,
    ):
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
        self.read_only = bool(read_only)
        self._mgr = None
        self._pending_step = None
        # saves that never finished (a process killed mid-save), found before Orbax removes them
        self.partial_saves: list[str] = find_partial_saves(self.folder)

    # -- orbax manager

    def _manager(self, create: bool):
        if self._mgr is not None:
            return self._mgr
        import orbax.checkpoint as ocp

        check_folder(self.folder)
        if not create and not os.path.isdir(self.folder):
            raise CheckpointError(
                f"no checkpoint folder at {self.folder}: nothing to restore; check the checkpoint folder setting "
                "or start without resuming"
            )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep_latest_k or None,
            step_prefix=STEP_PREFIX,
            create=create,
            cleanup_tmp_directories=not self.read_only,
            enable_async_checkpointing=_ASYNC_MODES[self.async_mode],
        )
        try:
            self._mgr = ocp.CheckpointManager(self.folder, options=options, item_names=(ARRAYS, MANIFEST))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"cannot open checkpoint folder {self.folder}: {first_line(e)}; check the path and its permissions"
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
        return os.path.join(self.folder, f"{STEP_PREFIX}_{int(step)}")

    def set_aside(self, step: int) -> str:
        """Rename the (unreadable) checkpoint `step` to step_<N>.unreadable[-k] so it is not
        a step of this folder: resuming skips it, and step N can be saved again. Nothing is deleted.
        Returns the new path. In a multi-host job only process 0 renames."""
        src = self.step_path(step)
        dst = aside_path(src)
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
        if self.read_only:
            raise CheckpointError(f"{self.folder} is opened read-only; open it without read_only=True to save")
        if not self.should_save(step, force):
            return False
        mgr = self._manager(create=True)
        if step in mgr.all_steps() or step == self._pending_step:
            return False
        enc = Encoder()
        manifest = {
            "format": FORMAT_VERSION,
            "writer": "torchtpu",
            "step": step,
            "tree": enc.encode(state),
        }
        import orbax.checkpoint as ocp

        items = {MANIFEST: ocp.args.JsonSave(manifest)}
        if enc.arrays:
            items[ARRAYS] = ocp.args.StandardSave(enc.arrays)
        try:
            mgr.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # noqa: BLE001
            raise save_error(self.step_path(step), e) from e
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
            raise save_error(self.step_path(step) if step is not None else self.folder, e) from e
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
            return mgr.restore(int(step), args=ocp.args.Composite(**{MANIFEST: ocp.args.JsonRestore()}))[MANIFEST][
                "tree"
            ]
        except Exception as e:  # noqa: BLE001
            raise corrupt_error(self.step_path(step), "manifest", e, steps, int(step)) from e

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
            manifest = mgr.restore(step, args=ocp.args.Composite(**{MANIFEST: ocp.args.JsonRestore()}))[MANIFEST]
            tree = manifest["tree"]
        except Exception as e:  # noqa: BLE001
            raise corrupt_error(path, "manifest", e, steps, step) from e
        for k in subtree:
            sub = child(children(tree), k)
            if sub is MISSING:
                raise CheckpointError(
                    f"checkpoint {path} has no part {keystr(subtree)}: it holds "
                    f"{sorted(map(str, children(tree)))}; it was written by a different program"
                )
            tree = sub

        # Build the abstract array tree from the manifest and the target.
        abstract = {}
        placed = {}  # array name -> target tensor (filled in place) or None
        skipped = {k for k in skip if isinstance(tree, dict) and "dict" in tree}
        nodes = [(kp, n) for kp, n in array_nodes(tree) if not (kp and kp[0] in skipped)]
        mesh = _target_mesh(target)
        for kpath, node in nodes:
            t = target
            for k in kpath:
                t = child(t, k) if t is not MISSING else MISSING
            abstract[node["array"]] = self._abstract(path, kpath, node, t, mesh)
            placed[node["array"]] = t if isinstance(t, torch.Tensor) else None
        # Tensors the target has but the checkpoint lacks: the model or optimizer differs.
        saved = {kp for kp, _ in nodes}
        for kpath, _ in tensor_leaves(target):
            if kpath not in saved and not (kpath and kpath[0] in skipped):
                raise CheckpointError(
                    f"checkpoint {path} has no key {keystr(kpath)} that the target needs: the checkpoint was written "
                    "by a different model/optimizer; restore with the matching model config or use a fresh checkpoint folder"
                )

        arrays = {}
        if abstract and (subtree or skipped):
            # Only this part's arrays: a partial PyTree restore of the arrays item reads just the
            # names given (the manager's standard handler insists on the whole tree).
            try:
                reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
                arrays = reader.restore(
                    os.path.join(path, ARRAYS),
                    args=ocp.args.PyTreeRestore(
                        item=abstract,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                        partial_restore=True,
                    ),
                )
            except Exception as e:  # noqa: BLE001
                raise corrupt_error(path, guess_key(e, nodes), e, steps, step) from e
        elif abstract:
            try:
                arrays = mgr.restore(step, args=ocp.args.Composite(**{ARRAYS: ocp.args.StandardRestore(abstract)}))[
                    ARRAYS
                ]
            except Exception as e:  # noqa: BLE001
                raise corrupt_error(path, guess_key(e, nodes), e, steps, step) from e
        if skipped:
            tree = {"dict": [[k, {"value": None} if k in skipped else v] for k, v in tree["dict"]]}
        return decode(tree, arrays, placed)

    @staticmethod
    def _abstract(path, kpath, node, t, mesh=None):
        shape = tuple(node["shape"])
        kind = node["kind"]
        jdt = jax_dtype(node["dtype"])
        if isinstance(t, (torch.Tensor, jax.ShapeDtypeStruct, jax.Array)):
            t_shape = tuple(t.shape)
            t_dtype = dtype_name(t.dtype)
            if t_shape != shape or t_dtype != node["dtype"]:
                raise CheckpointError(
                    f"checkpoint {path} key {keystr(kpath)} is {node['dtype']}{list(shape)} but the target is "
                    f"{t_dtype}{list(t_shape)}: the model/optimizer config differs from the one that wrote the "
                    "checkpoint; use the matching config or a fresh checkpoint folder"
                )
        if isinstance(t, TpuTensor):
            a = array_of(t)
            sharding = a.sharding
            if not getattr(a, "_committed", True) and mesh is not None:
                # a tensor made with no layout (a buffer that init_weights created, such as an MoE
                # layer's expert_bias) lives on one device, uncommitted, and JAX moves it wherever the
                # program needs it; restored there, it would be committed to that device and refused
                # beside the mesh's arrays. It is restored replicated over the target's mesh instead.
                sharding = NamedSharding(mesh, PartitionSpec())
            return jax.ShapeDtypeStruct(shape, jdt, sharding=sharding)
        if isinstance(t, jax.ShapeDtypeStruct) and t.sharding is not None:
            return jax.ShapeDtypeStruct(shape, jdt, sharding=t.sharding)
        if isinstance(t, jax.Array):
            return jax.ShapeDtypeStruct(shape, jdt, sharding=t.sharding)
        if kind in ("tpu", "jax"):
            dev = jax.local_devices()[0]
            return jax.ShapeDtypeStruct(shape, jdt, sharding=jax.sharding.SingleDeviceSharding(dev))
        return jax.ShapeDtypeStruct(shape, jdt)  # host array (NumPy)


def _target_mesh(target):
    """The device mesh of the first tensor of `target` laid out over several devices (None if none is)."""
    for _, t in tensor_leaves(target):
        if isinstance(t, TpuTensor):
            sharding = array_of(t).sharding
            if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
                return sharding.mesh
    return None


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
    """`optimizer.state_dict()`: its state tensors are the optimizer's own (restoring fills them in place).
    An optimizer over the layer scan's stacked slots gives it per parameter (optimizer.per_parameter_state)."""
    from ..optimizer import per_parameter_state

    return per_parameter_state(optimizer, optimizer.state_dict())


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a restored optimizer state, including one restored before the optimizer's first step.

    State tensors that `restore` created (no target existed because the optimizer initialises
    its state lazily) are moved to the sharding of their parameter.
    """
    from ..optimizer import stacked_state

    optimizer.load_state_dict(stacked_state(optimizer, state))
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, TpuTensor):
                continue
            st = optimizer.state.get(p)
            if not st:
                continue
            want = array_of(p).sharding
            for v in st.values():
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


def is_model_only(tree: dict) -> bool:
    """Whether a manifest tree (CheckpointManager.manifest) is a model-only save."""
    node = children(tree).get("model_only") if "dict" in tree else None
    return bool(node and node.get("value"))


def load_model_weights(manager: CheckpointManager, step: int, module: torch.nn.Module) -> None:
    """Fill `module`'s parameters and buffers in place from the "model" part of checkpoint `step`
    (a full or a model-only save). Each device reads only its shards; weights saved in another
    floating dtype (an export dtype) are cast to the module's. Nothing else is read."""
    path = manager.step_path(step)
    tree = manager.manifest(step)
    model = children(tree).get("model") if "dict" in tree else None
    if not model or "dict" not in model:
        raise CheckpointError(
            f"checkpoint {path} holds no model weights (no 'model' part); it was not written by "
            "torchtpu-train: point to a torchtpu-train checkpoint"
        )
    saved = {_canonical(k): (k, node) for k, node in model["dict"] if "array" in node}
    own = {_canonical(k): t for k, t in module.state_dict(keep_vars=True).items()}
    missing = sorted(set(own) - set(saved))
    extra = sorted(set(saved) - set(own))
    if missing or extra:
        few = lambda names: ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")  # noqa: E731
        what = "; ".join([f"missing {few(missing)}"] * bool(missing) + [f"unexpected {few(extra)}"] * bool(extra))
        raise CheckpointError(
            f"checkpoint {path} does not hold this model's weights ({what}): it was written for "
            "another model; use the [model] name/flavor that wrote it"
        )
    target = {}
    for canon, (key, node) in saved.items():
        t = own[canon]
        if tuple(node["shape"]) != tuple(t.shape):
            raise CheckpointError(
                f"checkpoint {path} key {key!r} is {node['dtype']}{list(node['shape'])} but the model "
                f"has {dtype_name(t.dtype)}{list(t.shape)}: it was written for another model; use the "
                "[model] name/flavor that wrote it"
            )
        if t.is_floating_point() != torch_dtype(node["dtype"]).is_floating_point:
            raise CheckpointError(
                f"checkpoint {path} key {key!r} is {node['dtype']} but the model's is "
                f"{dtype_name(t.dtype)}: it was written for another model"
            )
        sharding = array_of(t).sharding if isinstance(t, TpuTensor) else None
        target[key] = jax.ShapeDtypeStruct(tuple(node["shape"]), jax_dtype(node["dtype"]), sharding=sharding)
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
                t.copy_(
                    r.to(device=t.device, dtype=t.dtype)
                    if isinstance(r, torch.Tensor)
                    else torch.from_numpy(np.asarray(r)).to(t.dtype)
                )
