"""Device meshes: PyTorch's `DeviceMesh` API over one global `jax.sharding.Mesh`.

In single-program SPMD there is one mesh for the whole job, covering every device of every
process. A `DeviceMesh` here is a *view* of that mesh: a tuple of mesh dimensions, each of
which is one or more named JAX mesh axes. The root mesh has one axis per dimension;
`mesh["tp"]` selects a dimension; `mesh["dp_replicate", "dp_shard"]` selects several; and
`mesh["dp_replicate", "dp_shard"]._flatten("dp")` makes a one-dimensional view whose single
dimension spans both axes (registered on the root, so `root["dp"]` finds it afterwards).

Placements on a sub-mesh only talk about that sub-mesh's axes; the other axes of the global
mesh are left to the program (see placements.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ..hardware import TP_AXIS

__all__ = [
    "JOB_MESH_DIMS",
    "CoordinatorUnreachable",
    "DeviceMesh",
    "init_device_mesh",
    "split_dim",
    "expert_parallel_mesh",
    "current_mesh",
    "set_mesh",
    "initialize",
    "free_port",
]

# The dims of a training job's mesh, outermost first: data-parallel replicas (HSDP's replicate
# axis, the one multislice jobs split across slices by default), data-parallel shards (FSDP) and
# tensor parallelism. Every other spelling of these names derives from this one.
JOB_MESH_DIMS = ("dp_replicate", "dp_shard", TP_AXIS)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids=None,
    *,
    init_timeout_seconds: int = 300,
) -> bool:
    """Join this process to a multi-host job (`jax.distributed.initialize`); True if it joined one.

    Where the job's coordinator comes from, first match wins:

    1. the arguments, when `coordinator_address` is given;
    2. on a host with TPU chips (a TPU VM, a GKE TPU node): JAX's own cluster auto-detection;
    3. under torchrun / torchelastic (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` set) with
       WORLD_SIZE > 1: process `RANK` of `WORLD_SIZE`, coordinator on `MASTER_ADDR`. Its port is
       never torchrun's `MASTER_PORT` (that is torchelastic's own store): rank 0 picks a free port
       and hands it to the others through that store;
    4. otherwise a single-process job: nothing to join, returns False.

    `init_timeout_seconds` bounds how long the processes wait for each other to join. Call it
    before any tpu tensor is made (JAX's backend must not have started yet); `torchtpu-train`
    does it for you.
    """
    from jax._src import distributed, xla_bridge

    from .._platform import has_tpu_chips

    if distributed.global_state.client is not None:
        return True  # already joined
    env = os.environ
    under_torchrun = all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    auto = coordinator_address is None and has_tpu_chips()
    if coordinator_address is None and not auto and not (under_torchrun and int(env["WORLD_SIZE"]) > 1):
        return False  # a single-process job: nothing to join
    if xla_bridge.backends_are_initialized():
        if auto and not under_torchrun:
            return False  # a TPU host already in use by this process on its own (a notebook, a test)
        raise RuntimeError(
            "torchtpu.distributed.initialize() must run before the first tpu tensor or jax call in this "
            "process (JAX's backend is already running); call it right after `import torchtpu`"
        )
    kwargs = {"initialization_timeout": int(init_timeout_seconds)}
    if local_device_ids is not None:
        kwargs["local_device_ids"] = local_device_ids
    if auto:
        jax.distributed.initialize(**kwargs)  # JAX finds the slice's hosts (GCE metadata / GKE env)
        return True
    if coordinator_address is None:
        num_processes, process_id = int(env["WORLD_SIZE"]), int(env["RANK"])
        coordinator_address = _coordinator_from_torchelastic(process_id, init_timeout_seconds)
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
    except Exception as e:  # noqa: BLE001  (every failure here is a failure to join the job)
        raise CoordinatorUnreachable(
            coordinator_address, "JAX's coordinator", init_timeout_seconds, e, process_id or 0
        ) from e
    return True


class CoordinatorUnreachable(RuntimeError):
    """This process could not join its job: the coordinator did not answer in time."""

    def __init__(self, address: str, what: str, timeout_seconds: float, error: BaseException, process_id: int):
        lines = str(error).strip().splitlines()
        cause = f"{type(error).__name__}: {lines[0] if lines else ''}"
        serve = "this process serves it" if process_id == 0 else "process 0 of the job serves it"
        super().__init__(
            f"process {process_id} could not reach {what} at {address} within {timeout_seconds:.0f} s ({cause}). "
            f"Start every host of the job ({serve}), check that {address} is reachable from this host "
            "(address, port, firewall), or raise [comm] init_timeout_seconds"
        )


def free_port() -> int:
    """A TCP port free on every interface now (for a coordinator to listen on)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))  # JAX's coordinator listens on every interface
        return s.getsockname()[1]


def _coordinator_from_torchelastic(rank: int, timeout_seconds: int) -> str:
    """host:port for JAX's coordinator, agreed through torchelastic's store at MASTER_ADDR:MASTER_PORT."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    env = os.environ
    host, store_port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    # One key per job and attempt: a restarted attempt must not read the previous attempt's port.
    # TORCHTPU_ATTEMPT (torchtpu.launch.agent) is the same on every host; plain torchrun's restart
    # count can differ between hosts after a restart that a peer caused.
    attempt = env.get("TORCHTPU_ATTEMPT") or env.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"torchtpu/jax_coordinator/{env.get('TORCHELASTIC_RUN_ID', '')}/{attempt}"
    try:
        store = TCPStore(host, store_port, is_master=False, timeout=timedelta(seconds=timeout_seconds))
        if rank == 0:
            port = free_port()
            while port == store_port:
                port = free_port()
            store.set(key, str(port))
        else:
            port = int(store.get(key).decode())
    except Exception as e:  # noqa: BLE001  (DistNetworkError, DistStoreError: the store is not there)
        raise CoordinatorUnreachable(
            f"{host}:{store_port}", "torchelastic's store (MASTER_ADDR:MASTER_PORT)", timeout_seconds, e, rank
        ) from e
    return f"{host}:{port}"


class DeviceMesh:
    """A view of the global JAX mesh: `dims[i]` is the tuple of JAX axis names of mesh dim i."""

    def __init__(
        self, jax_mesh: Mesh, dims: Sequence[tuple[str, ...]], names: Sequence[str], root: DeviceMesh | None = None
    ):
        self.jax_mesh = jax_mesh
        self.dims = tuple(tuple(d) for d in dims)
        self._names = tuple(names)
        self._root = root
        self._flattened: dict[str, tuple[str, ...]] = {}

    # -- torch.distributed.DeviceMesh API
    @property
    def device_type(self) -> str:
        return "tpu"

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._dim_size(d) for d in self.dims)

    def _dim_size(self, axes) -> int:
        return math.prod(self.jax_mesh.shape[a] for a in axes)

    def size(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            return math.prod(self.shape)
        return self._dim_size(self.dims[self._index(mesh_dim)])

    def numel(self) -> int:
        return self.size()

    @property
    def mesh(self):
        """Device ids laid out like this mesh (the global mesh's ids for the selected axes)."""
        import torch

        ids = np.vectorize(lambda d: d.id)(self.jax_mesh.devices)
        order = [a for d in self.dims for a in d]
        rest = [a for a in self.jax_mesh.axis_names if a not in order]
        names = list(self.jax_mesh.axis_names)
        ids = np.transpose(ids, [names.index(a) for a in order + rest])
        ids = ids.reshape(self.shape + (-1,))[..., 0] if rest else ids.reshape(self.shape)
        return torch.as_tensor(ids)

    def root(self) -> DeviceMesh:
        return self._root or self

    def _index(self, mesh_dim) -> int:
        if isinstance(mesh_dim, int):
            if not -self.ndim <= mesh_dim < self.ndim:
                raise IndexError(f"mesh dim {mesh_dim} out of range for a {self.ndim}-D mesh {self._names}")
            return mesh_dim % self.ndim
        if mesh_dim not in self._names:
            raise KeyError(f"mesh has no dimension named {mesh_dim!r}; its dimensions are {self._names}")
        return self._names.index(mesh_dim)

    def __getitem__(self, names) -> DeviceMesh:
        if isinstance(names, str):
            names = (names,)
        names = tuple(names)
        root = self.root()
        dims = []
        for n in names:
            if n in self._names:
                dims.append(self.dims[self._names.index(n)])
            elif n in root._flattened:
                dims.append(root._flattened[n])
            else:
                valid = list(self._names) + [k for k in root._flattened if k not in self._names]
                raise KeyError(f"mesh has no dimension named {n!r}; valid names: {valid}")
        axes = [a for d in dims for a in d]
        if len(set(axes)) != len(axes):
            raise ValueError(f"mesh dimensions {names} overlap")
        return DeviceMesh(self.jax_mesh, dims, names, root)

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """One mesh dimension spanning all of this mesh's axes (torch's DeviceMesh._flatten)."""
        axes = tuple(a for d in self.dims for a in d)
        name = mesh_dim_name or "_".join(self._names)
        root = self.root()
        known = root._flattened.get(name)
        if (name in root._names and root.dims[root._names.index(name)] != axes) or (known and known != axes):
            raise ValueError(f"mesh dimension name {name!r} is already used for other axes")
        root._flattened[name] = axes
        return DeviceMesh(self.jax_mesh, (axes,), (name,), root)

    def get_group(self, mesh_dim=None):
        # Collectives here are XLA collectives over mesh axes; a "group" is the mesh dim itself.
        return self if mesh_dim is None else self[self._names[self._index(mesh_dim)]]

    def get_local_rank(self, mesh_dim=None) -> int:
        """This process's coordinate along `mesh_dim`, from its first addressable device."""
        idx = 0 if mesh_dim is None else self._index(mesh_dim)
        if mesh_dim is None and self.ndim != 1:
            raise RuntimeError("get_local_rank() needs mesh_dim on a multi-dimensional mesh")
        return self.get_coordinate()[idx]

    def get_coordinate(self) -> list[int]:
        dev = jax.local_devices()[0]
        pos = dict(zip(self.jax_mesh.axis_names, [int(i[0]) for i in np.nonzero(self.jax_mesh.devices == dev)]))
        coords = []
        for axes in self.dims:
            c = 0
            for a in axes:
                c = c * self.jax_mesh.shape[a] + pos[a]
            coords.append(c)
        return coords

    def __eq__(self, other):
        return isinstance(other, DeviceMesh) and other.jax_mesh == self.jax_mesh and other.dims == self.dims

    def __hash__(self):
        return hash((self.jax_mesh, self.dims))

    def __repr__(self):
        dims = ", ".join(f"{n}={s}" for n, s in zip(self._names, self.shape))
        return f"DeviceMesh(tpu, {dims})"


_CURRENT: DeviceMesh | None = None


def current_mesh() -> DeviceMesh | None:
    """The root mesh made by the last `init_device_mesh` (None while there is none)."""
    return _CURRENT


def set_mesh(mesh: DeviceMesh | None) -> None:
    global _CURRENT
    _CURRENT = mesh
    if mesh is not None:
        from ..backend import note_mesh

        note_mesh(mesh.jax_mesh)


def _device_grid(devices, shape: tuple[int, ...], dcn_shape: tuple[int, ...] | None):
    from jax.experimental import mesh_utils

    platform = devices[0].platform
    slices = sorted({getattr(d, "slice_index", 0) or 0 for d in devices})
    if platform == "tpu" and len(slices) > 1:
        if dcn_shape is None:
            # Slices go on the outermost dimension that they divide (data parallelism over DCN).
            dcn_shape = [1] * len(shape)
            for i, n in enumerate(shape):
                if n % len(slices) == 0:
                    dcn_shape[i] = len(slices)
                    break
            else:
                raise ValueError(
                    f"mesh shape {shape} has no dimension divisible by the {len(slices)} slices; "
                    "pass dcn_mesh_shape= to say which dimensions span slices"
                )
        ici = tuple(n // d for n, d in zip(shape, dcn_shape))
        return mesh_utils.create_hybrid_device_mesh(ici, tuple(dcn_shape), devices)
    if platform == "tpu":
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return np.array(devices).reshape(shape)


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
    dcn_mesh_shape: Sequence[int] | None = None,
    devices=None,
) -> DeviceMesh:
    """Build the job's mesh over all devices of all processes (torch's `init_device_mesh`).

    On TPUs the device order follows the physical topology; with several slices the mesh is
    hybrid: `dcn_mesh_shape` (default: slices on the first dimension they divide) spans slices
    over the data-centre network, the rest lies inside a slice on the chip interconnect.
    """
    if device_type != "tpu":
        raise ValueError(
            f"torchtpu.distributed.init_device_mesh builds meshes of tpu devices, got device_type={device_type!r}"
        )
    shape = tuple(int(n) for n in mesh_shape)
    if not shape or any(n < 1 for n in shape):
        raise ValueError(f"mesh_shape must be a non-empty tuple of positive sizes, got {tuple(mesh_shape)}")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else tuple(f"dim{i}" for i in range(len(shape)))
    if len(names) != len(shape):
        raise ValueError(f"mesh_dim_names {names} has {len(names)} names for a {len(shape)}-D mesh_shape {shape}")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names must be unique, got {names}")
    devices = list(devices) if devices is not None else jax.devices()
    if math.prod(shape) != len(devices):
        raise ValueError(
            f"mesh shape {shape} ({'x'.join(map(str, shape))} = {math.prod(shape)} devices) does not match the "
            f"{len(devices)} devices of this job; choose degrees whose product is {len(devices)}"
        )
    grid = _device_grid(devices, shape, tuple(dcn_mesh_shape) if dcn_mesh_shape is not None else None)
    mesh = DeviceMesh(Mesh(grid, names), [(n,) for n in names], names)
    set_mesh(mesh)
    return mesh


def split_dim(mesh: DeviceMesh, name: str, parts: Sequence[tuple[str, int]]) -> DeviceMesh:
    """The root mesh `mesh` with its one-axis dim `name` split into several JAX axes, outermost
    first (`parts`: (axis name, size) pairs whose sizes multiply to the dim's). The devices keep
    their order, so every layout on the old mesh is the same layout on the new one: the dim `name`
    spans the new axes, and each part is also a dim of its own (`mesh["ep"]`). This is how expert
    parallelism borrows the inner ranks of the FSDP dim (torchtitan's `efsdp` x `ep`). Becomes the
    current mesh."""
    if mesh.root() is not mesh:
        raise ValueError(f"split_dim splits a dim of the root mesh, not of the view {mesh}")
    i = mesh._index(name)
    if len(mesh.dims[i]) != 1:
        raise ValueError(f"split_dim: mesh dim {name!r} already spans several axes {mesh.dims[i]}")
    axis = mesh.dims[i][0]
    names = [n for n, _ in parts]
    sizes = [int(k) for _, k in parts]
    if math.prod(sizes) != mesh.size(name):
        raise ValueError(f"split_dim: parts {tuple(parts)} do not multiply to the {mesh.size(name)} ranks of {name!r}")
    taken = set(mesh.jax_mesh.axis_names) - {axis}
    if len(set(names)) != len(names) or taken & set(names) or set(names) & (set(mesh.mesh_dim_names) - {name}):
        raise ValueError(f"split_dim: part names {names} must be new and distinct")
    old = list(mesh.jax_mesh.axis_names)
    k = old.index(axis)
    grid = mesh.jax_mesh.devices.reshape(
        mesh.jax_mesh.devices.shape[:k] + tuple(sizes) + mesh.jax_mesh.devices.shape[k + 1 :]
    )
    axes = old[:k] + names + old[k + 1 :]
    dims = [tuple(names) if d == (axis,) else d for d in mesh.dims]
    out = DeviceMesh(Mesh(grid, tuple(axes)), dims, mesh.mesh_dim_names)
    for n in names:
        out._flattened[n] = (n,)
    set_mesh(out)
    return out


def expert_parallel_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The job's root mesh (dims dp_replicate, dp_shard, tp) with torchtitan's expert-parallel dims
    for expert_tensor_parallel_degree 1: the dim "ep" of `ep` ranks takes every rank of "tp" and the
    inner ep / tp ranks of "dp_shard", which splits into the JAX axes `efsdp` x `ep` (`split_dim`);
    the dim "efsdp" is the rest of dp_shard, over which each expert is sharded. Without tensor
    parallelism "ep" is the JAX axis `ep` alone; with it, the axes `ep` and `tp` (tp inner), and the
    axis `ep` may have one rank (ep = tp). Becomes the current mesh."""
    if mesh.root() is not mesh:
        raise ValueError(f"expert_parallel_mesh takes the root mesh, not the view {mesh}")
    tp = mesh.size(TP_AXIS) if TP_AXIS in mesh.mesh_dim_names else 1
    shard = mesh.size("dp_shard")
    if ep < 1 or ep % tp or shard % (ep // tp):
        raise ValueError(
            f"expert_parallel_mesh: {ep} expert-parallel ranks must be the {tp} tensor-parallel ranks times a "
            f"divisor of the {shard} FSDP shards"
        )
    inner = ep // tp
    out = split_dim(mesh, "dp_shard", (("efsdp", shard // inner), ("ep", inner)))
    if tp > 1:
        out._flattened["ep"] = ("ep",) + out.dims[out._index(TP_AXIS)]
    return out
