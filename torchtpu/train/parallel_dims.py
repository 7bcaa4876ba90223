"""The parallelism of a run: the degrees of the mesh axes and the batch arithmetic, resolved from a
configuration for a device count.

    dims = resolve_dims(cfg, num_devices=8)   # ParallelDims(dp_replicate=1, dp_shard=8, tp=1, ...)
    dims.mesh_shape, dims.micro_batch_size, dims.grad_accum_steps, dims.tokens_per_step

This module only imports the standard library.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config.job_config import ConfigError, JobConfig
from .config.manager import check_fields, check_paths, check_relations, describe_keys

__all__ = ["ParallelDims", "resolve_dims", "job_devices", "check_expert_parallel"]


@dataclass(frozen=True)
class ParallelDims:
    """Resolved parallelism for a device count (what resolve_dims returns).

    Mesh axes, outermost first: dp_replicate, dp_shard, tp (pp and cp are always 1 in torchtpu).
    Expert parallelism (`ep` > 1) borrows its ranks as torchtitan's does with
    expert_tensor_parallel_degree 1: every tp rank and the inner ep / tp ranks of dp_shard, which
    splits into `efsdp` x ep / tp; the routed experts are split over ep and sharded over efsdp
    (dp_shard x tp / ep ranks), everything else stays as it is.
    """

    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    local_batch_size: int
    global_batch_size: int
    grad_accum_steps: int
    seq_len: int
    pp: int = 1
    cp: int = 1
    num_slices: int = 1
    dcn_axis: str = "dp_replicate"
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    def micro_batch_for(self, local_batch_size: int) -> int:
        """Sequences in one micro-batch over all data-parallel ranks when each rank takes
        `local_batch_size` of them (a training or a validation batch)."""
        return local_batch_size * self.dp

    @property
    def micro_batch_size(self) -> int:
        """Sequences in one training micro-batch: local_batch_size x dp, the rows of the token arrays."""
        return self.micro_batch_for(self.local_batch_size)

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def ep_shards(self) -> int:
        """The FSDP shards expert parallelism borrows (ep / tp: it takes every tp rank)."""
        return self.ep // self.tp if self.ep > 1 else 1

    @property
    def efsdp(self) -> int:
        """Ranks each routed expert is sharded over under expert parallelism (dp_shard x tp / ep)."""
        return self.dp_shard // self.ep_shards

    @property
    def mesh_axis_names(self) -> tuple[str, ...]:
        """The mesh's dims, in mesh_shape's order (distributed.mesh.JOB_MESH_DIMS; imported when
        asked, so that resolving a configuration needs only the standard library)."""
        from torchtpu.distributed.mesh import JOB_MESH_DIMS

        return JOB_MESH_DIMS

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.dp_shard, self.tp)

    @property
    def dcn_mesh_shape(self) -> tuple[int, ...]:
        """Per-axis split across slices (for jax mesh_utils.create_hybrid_device_mesh)."""
        return tuple(self.num_slices if name == self.dcn_axis else 1 for name in self.mesh_axis_names)

    @property
    def ici_mesh_shape(self) -> tuple[int, ...]:
        """Per-axis size within one slice; ici_mesh_shape[i] * dcn_mesh_shape[i] == mesh_shape[i]."""
        return tuple(m // d for m, d in zip(self.mesh_shape, self.dcn_mesh_shape))

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


def resolve_dims(cfg: JobConfig, num_devices: int) -> ParallelDims:
    """Check cfg for a run on num_devices chips (all hosts together) and resolve the parallel degrees.

    torchtitan's rules: data_parallel_shard_degree = -1 takes the devices the other degrees leave;
    the degrees must multiply to num_devices; global_batch_size = -1 means local_batch_size x dp,
    otherwise it must be a multiple of that and the quotient is the gradient-accumulation steps.
    Paths that are set (tokenizer folder, dataset paths, initial checkpoint) must exist.
    Raises ConfigError (one line).
    """
    check_fields(cfg)
    check_relations(cfg)
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ConfigError(f"resolve_dims: num_devices = {num_devices!r}: must be a positive integer")
    par = cfg.parallelism
    sec = ("parallelism",)
    rep, shard, tp = par.data_parallel_replicate_degree, par.data_parallel_shard_degree, par.tensor_parallel_degree
    pp, cp = par.pipeline_parallel_degree, par.context_parallel_degree
    others = rep * tp * pp * cp
    keys = ["data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree"]
    if shard == -1:
        if num_devices % others:
            raise ConfigError(
                f"{describe_keys(cfg, sec, keys)}: the other degrees multiply to {others}, which does "
                f"not divide the {num_devices} devices, so data_parallel_shard_degree = -1 has no "
                f"whole number to take; choose degrees whose product divides {num_devices}"
            )
        shard = num_devices // others
    elif others * shard != num_devices:
        raise ConfigError(
            f"{describe_keys(cfg, sec, keys)}: the degrees multiply to {others * shard} but there are "
            f"{num_devices} devices; their product must equal {num_devices} (or set "
            "data_parallel_shard_degree = -1 to use the devices left over)"
        )
    if par.num_slices > 1:
        if num_devices % par.num_slices:
            raise ConfigError(
                f"{describe_keys(cfg, sec, ['num_slices'])}: {num_devices} devices cannot be split "
                f"evenly into {par.num_slices} slices"
            )
        axis_degree = {"dp_replicate": rep, "dp_shard": shard}[par.dcn_axis]
        if axis_degree % par.num_slices:
            degree_key = {"dp_replicate": "data_parallel_replicate_degree", "dp_shard": "data_parallel_shard_degree"}[
                par.dcn_axis
            ]
            raise ConfigError(
                f"{describe_keys(cfg, sec, ['num_slices', 'dcn_axis', degree_key])}: the {par.dcn_axis} "
                f"degree ({axis_degree}) must be a multiple of num_slices ({par.num_slices})"
            )
    ep = par.expert_parallel_degree
    if ep > 1:
        if tp > 1 and (ep % tp or shard % (ep // tp)):
            raise ConfigError(
                f"{describe_keys(cfg, sec, ['expert_parallel_degree', 'tensor_parallel_degree', 'data_parallel_shard_degree'])}: "
                f"with tensor parallelism, expert parallelism takes every one of the {tp} tensor-parallel ranks and "
                f"part of the {shard} FSDP shards (torchtitan's expert_tensor_parallel_degree = 1), so "
                f"expert_parallel_degree must be {tp} times a divisor of {shard}; choose one of "
                f"{', '.join(str(tp * d) for d in range(1, shard + 1) if shard % d == 0)}"
            )
        if tp == 1 and shard % ep:
            raise ConfigError(
                f"{describe_keys(cfg, sec, ['expert_parallel_degree', 'data_parallel_shard_degree'])}: "
                f"expert parallelism takes its ranks from the {shard} FSDP shards (as in torchtitan), so "
                f"expert_parallel_degree must divide {shard}; choose one of "
                f"{', '.join(str(d) for d in range(1, shard + 1) if shard % d == 0)}"
            )
    tr = cfg.training
    if tp > 1:
        if tr.seq_len % tp:
            raise ConfigError(
                f"{describe_keys(cfg, ('training',), ['seq_len'])}: with tensor_parallel_degree = {tp} "
                f"(sequence parallel) seq_len must be a multiple of {tp}"
            )
        if cfg.validation.enable and cfg.validation.seq_len % tp:
            raise ConfigError(
                f"{describe_keys(cfg, ('validation',), ['seq_len'])}: with tensor_parallel_degree = "
                f"{tp} (sequence parallel) seq_len must be a multiple of {tp}"
            )
    dims = ParallelDims(
        world_size=num_devices,
        dp_replicate=rep,
        dp_shard=shard,
        tp=tp,
        pp=pp,
        cp=cp,
        local_batch_size=tr.local_batch_size,
        global_batch_size=tr.global_batch_size,
        grad_accum_steps=1,
        seq_len=tr.seq_len,
        num_slices=par.num_slices,
        dcn_axis=par.dcn_axis,
        ep=ep,
    )
    micro = dims.micro_batch_size
    if tr.global_batch_size == -1:
        global_batch = micro
    else:
        global_batch = tr.global_batch_size
        if global_batch % micro:
            raise ConfigError(
                f"{describe_keys(cfg, ('training',), ['global_batch_size', 'local_batch_size'])}: "
                f"global_batch_size must be a multiple of local_batch_size x data-parallel degree "
                f"= {tr.local_batch_size} x {dims.dp} = {micro} (e.g. {micro} or {2 * micro}), or -1 "
                f"for {micro}"
            )
    check_paths(cfg)
    return dataclasses.replace(dims, global_batch_size=global_batch, grad_accum_steps=global_batch // micro)


def check_expert_parallel(cfg: JobConfig, dims: ParallelDims, model_args) -> None:
    """Expert parallelism needs a Mixture-of-Experts model whose expert count the degree divides
    (torchtitan's model arguments: `moe_enabled`, `moe_args.num_experts`). Raises ConfigError."""
    if dims.ep == 1:
        return
    keys = describe_keys(cfg, ("parallelism",), ["expert_parallel_degree"])
    moe = getattr(model_args, "moe_args", None)
    if not getattr(model_args, "moe_enabled", moe is not None) or moe is None:
        raise ConfigError(
            f"{keys}: {cfg.model.name} {cfg.model.flavor} is a dense model with no experts to split; set "
            "expert_parallel_degree = 1 or choose a Mixture-of-Experts flavor"
        )
    n = moe.num_experts
    if n % dims.ep:
        raise ConfigError(
            f"{keys}: {cfg.model.name} {cfg.model.flavor} has {n} experts per layer, which {dims.ep} ranks cannot "
            f"split evenly; choose one of {', '.join(str(d) for d in _ep_choices(dims) if n % d == 0)}"
        )


def _ep_choices(dims: ParallelDims) -> list[int]:
    """The expert-parallel degrees the mesh allows: 1, or the tp ranks times a divisor of dp_shard."""
    return sorted({1} | {dims.tp * d for d in range(1, dims.dp_shard + 1) if dims.dp_shard % d == 0})


def job_devices(cfg: JobConfig) -> list:
    """The devices the job runs on: the attached ones, or with [tpu] topology and a dry run the
    compile-only devices of that TPU slice (training on a named slice needs its chips)."""
    import jax

    if not cfg.tpu.topology:
        return jax.devices()
    if cfg.tpu.dry_run:
        from torchtpu.distributed.topology import topology_devices

        return topology_devices(cfg.tpu.topology)
    local = jax.devices()
    if local[0].platform != "tpu":
        raise ConfigError(
            f"[tpu] topology = {cfg.tpu.topology!r}: training on a named TPU slice needs its TPU chips; "
            f"this host has {local[0].platform} devices. Use --dry-run to compile for the topology "
            "here, or leave topology empty to train on the attached devices"
        )
    return local
