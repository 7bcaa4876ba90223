"""The pieces of a training job, each built from the configuration and the values it needs: the
mesh, the tokenizer, the seed, the parallelized model, the batch layout, the data loader and the
checkpointer. `Trainer.__init__` (trainer.py) calls them in order; none of them sees the trainer.

    mesh = job_mesh(cfg, dims, devices)
    model, family, num_params, flops_per_token = parallel_model(cfg, mesh, dims, model_args, init=True)
    place = functools.partial(place_tokens, mesh, model_args.vocab_size)   # host rows -> a tpu batch
"""

from __future__ import annotations

import os

from .config.job_config import ConfigError, JobConfig
from .console import log
from .parallel_dims import ParallelDims, check_expert_parallel

__all__ = [
    "build_checkpointer",
    "build_train_dataloader",
    "check_model_options",
    "gc_due",
    "job_mesh",
    "load_tokenizer",
    "loss_context",
    "parallel_model",
    "place_tokens",
    "resolve_seed",
    "save_due",
    "seed_run",
]


def job_mesh(cfg: JobConfig, dims: ParallelDims, devices):
    """The job's device mesh (axes distributed.mesh.JOB_MESH_DIMS) over `devices`; with expert
    parallelism, the mesh whose expert axes take every tp rank and the inner ranks of the FSDP dim
    (torchtitan's efsdp x ep with expert_tensor_parallel_degree 1)."""
    from torchtpu.distributed import init_device_mesh

    kwargs = {}
    if cfg.tpu.topology:
        kwargs["devices"] = devices
    if dims.num_slices > 1:
        kwargs["dcn_mesh_shape"] = dims.dcn_mesh_shape
    mesh = init_device_mesh("tpu", dims.mesh_shape, mesh_dim_names=dims.mesh_axis_names, **kwargs)
    if dims.ep_enabled:
        from torchtpu.distributed.mesh import expert_parallel_mesh

        mesh = expert_parallel_mesh(mesh, dims.ep)
    return mesh


def load_tokenizer(cfg: JobConfig):
    """The tokenizer of [model] hf_assets_path (empty: the bundled one), or a ConfigError naming the key."""
    from .tokenizer import build_tokenizer

    try:
        return build_tokenizer(cfg.model.hf_assets_path or None)
    except (FileNotFoundError, ValueError) as e:
        where = cfg.origin("model", "hf_assets_path") or "default"
        raise ConfigError(f"{where}: [model] hf_assets_path = {cfg.model.hf_assets_path!r}: {e}") from None


def check_model_options(cfg: JobConfig, dims: ParallelDims, model_args) -> None:
    """Refuse, before the model is built, the Hugging Face checkpoint options of a family without Hugging
    Face weights or of a model transformers cannot compute, and expert-parallel degrees the model cannot take."""
    from torchtpu.models.registry import FAMILIES, get_family

    hf_opts = [o for o in ("initial_load_in_hf", "last_save_in_hf") if getattr(cfg.checkpoint, o)]
    if hf_opts and not get_family(cfg.model.name).has_hf_weights():
        raise ConfigError(
            f"[checkpoint] {hf_opts[0]}: model family {cfg.model.name!r} has no Hugging Face weights in torchtpu; "
            f"families with them: {', '.join(n for n, f in FAMILIES.items() if f.has_hf_weights())}"
        )
    if cfg.checkpoint.last_save_in_hf:  # a model transformers cannot compute stops here, not after training
        from torchtpu.models.hf_adapter import HFLayout, HFLayoutError

        try:
            HFLayout(model_args).hf_config("float32")
        except (ValueError, HFLayoutError) as e:
            raise ConfigError(f"[checkpoint] last_save_in_hf: {e}") from None
    check_expert_parallel(cfg, dims, model_args)


def resolve_seed(cfg: JobConfig) -> int | None:
    """The run's base seed: [debug] seed; when unset, 0 with debug.deterministic, else None (a fresh one)."""
    if cfg.debug.seed is not None:
        return cfg.debug.seed
    return 0 if cfg.debug.deterministic else None


def seed_run(cfg: JobConfig) -> int:
    """Seed PyTorch's host and tpu generators with the run's seed (a fresh one, announced, when none is
    set), and turn on deterministic algorithms with [debug] deterministic; returns the seed."""
    import torch

    seed = resolve_seed(cfg)
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        log(f"seed {seed} (set [debug] seed to repeat this run)")
    if cfg.debug.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    torch.tpu.manual_seed_all(seed)
    return seed


def parallel_model(cfg: JobConfig, mesh, dims: ParallelDims, model_args, init: bool):
    """(model, family, parameters, FLOPs per token): the model built on meta and counted there (the
    family's count), parallelized by its family's plan, materialized directly in its sharded layout and,
    with `init`, initialised in place; in training mode."""
    import torch

    from torchtpu.backend.activation_checkpoint import EVERY_BLOCK_AC_MODES
    from torchtpu.distributed import materialize
    from torchtpu.models.registry import get_family

    from .model_builder import ac_settings, build_meta_model, mixed_precision_dtypes

    model = build_meta_model(cfg, model_args)
    family = get_family(cfg.model.name)
    num_params, flops_per_token = family.flops_per_token(model, model_args, cfg.training.seq_len)
    mp_param, mp_reduce = mixed_precision_dtypes(cfg)
    ac_mode, ac_every = ac_settings(cfg)
    family.parallelize(
        model,
        mesh,
        sequence_parallel=dims.tp > 1,
        loss_parallel=dims.tp > 1,
        param_dtype=mp_param,
        reduce_dtype=mp_reduce,
        ac_mode=ac_mode,
        ac_every=ac_every,
        # the layer scan recomputes every block, so it stands in for full or per-op checkpointing
        # only; a single block has nothing to scan
        scan_layers=cfg.tpu.scan_layers and ac_mode in EVERY_BLOCK_AC_MODES and model_args.n_layers > 1,
    )
    materialize(model)
    if init:
        with torch.no_grad(), _one_program():
            model.init_weights(buffer_device=torch.device("tpu"))
    model.train()
    return model, family, num_params, flops_per_token


def _one_program():
    """Fused eager for the weights' initialization, unless the user chose another mode: the model's
    init ops (one small program each in strict eager: 78 compiles for the debug model) recorded and
    run together, with the same random numbers, up to each point where Python reads a value
    (PyTorch's trunc_normal_ checks one per parameter): 46 compiles."""
    import contextlib

    import torchtpu

    if torchtpu.get_eager_mode() != "strict":
        return contextlib.nullcontext()
    return torchtpu.eager_mode("fused")


def place_tokens(mesh, vocab_size: int, x, global_rows: int):
    """This process's rows (distributed.batch.host_rows order) of a (global_rows, seq_len) batch of token
    ids, a host numpy array -> the global int32 tpu tensor laid out over the dp axes (64-bit integers are
    emulated on TPU; see docs/DESIGN_NOTES.md)."""
    from torchtpu.distributed.batch import place_batch

    from .data import token_ids_int32

    return place_batch(token_ids_int32(x, vocab_size), mesh, global_rows)


def loss_context(mesh, tp: int):
    """With tensor parallelism the logits stay split over the vocabulary (torchtitan's loss_parallel):
    the cross entropy reduces across the tp shards, never gathering them."""
    import contextlib

    if tp > 1:
        from torchtpu.distributed import loss_parallel
        from torchtpu.hardware import TP_AXIS

        return loss_parallel(mesh[TP_AXIS])
    return contextlib.nullcontext()


def build_train_dataloader(cfg: JobConfig, tokenizer, dims: ParallelDims, rows=None):
    """The loader of training micro-batches ([training] dataset, dataset_path, seq_len, batch): the rows
    `rows` (default: all) of each micro-batch of local_batch_size x dp sequences, each row its own stream,
    so every process count reads the same global batches (data.build_global_batch_loader)."""
    from .data import build_global_batch_loader

    try:
        return build_global_batch_loader(
            cfg.training.dataset,
            cfg.training.dataset_path,
            tokenizer,
            cfg.training.seq_len,
            dims.micro_batch_size,
            rows,
            seed=cfg.debug.seed if cfg.debug.seed is not None else 0,
            max_bad_records=cfg.training.max_bad_records,
        )
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(
            f"[training] dataset = {cfg.training.dataset!r}, dataset_path = {cfg.training.dataset_path!r}: {e}"
        ) from None


def build_checkpointer(cfg: JobConfig):
    """The run's CheckpointManager ([checkpoint] enable, folder, interval, keep_latest_k, async_mode), or None."""
    ck = cfg.checkpoint
    if not ck.enable:
        return None
    from .checkpoint.manager import CheckpointManager

    return CheckpointManager(
        os.path.join(cfg.job.dump_folder, ck.folder),
        interval=ck.interval,
        keep_latest_k=ck.keep_latest_k,
        async_mode=ck.async_mode,
    )


def save_due(cfg: JobConfig, checkpointer, step: int) -> tuple[bool, bool]:
    """(save a checkpoint after `step`?, forced?): every interval steps, the last step, and step 1 with
    enable_first_step_checkpoint; never with load_only or without a checkpointer."""
    if checkpointer is None or cfg.checkpoint.load_only:
        return False, False
    force = step == cfg.training.steps or (step == 1 and cfg.checkpoint.enable_first_step_checkpoint)
    return checkpointer.should_save(step, force), force


def gc_due(cfg: JobConfig, step: int) -> bool:
    """Python's garbage collector is off during training and runs every training.gc_freq steps."""
    return step % cfg.training.gc_freq == 0
