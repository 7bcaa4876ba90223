"""The training loop behind `torchtpu-train`: one compiled XLA program per optimizer step.

    status = main(cfg)          # cfg from torchtpu.train.config.manager.load_config; returns the exit status

What a run does, in order:

1. Devices and mesh. The devices are this job's (all hosts') JAX devices, or with `[tpu] topology`
   and `--dry-run` the compile-only devices of that TPU slice. `resolve_dims(cfg, len(devices))`
   resolves the parallel degrees; the mesh has the axes `distributed.mesh.JOB_MESH_DIMS`.
2. Model. torchtitan's model for `[model] name` and `flavor` (torchtpu.models.registry) is built on
   `meta` (its vocab_size is the flavor's; a tokenizer with a larger vocabulary is refused; max_seq_len
   is the training seq_len), parallelized by its family's plan (FSDP/HSDP, tensor and sequence
   parallelism, mixed precision, activation checkpointing), then materialized: every parameter
   is created directly in its sharded layout, so no device and no host ever holds the whole
   model, and `init_weights()` fills them in place under the seed `[debug] seed`.
3. Optimizer and schedule. `torch.optim.AdamW(capturable=True, foreach=True)` with its learning
   rate held in a tpu tensor, so the LR schedule (a LambdaLR that writes that tensor in place)
   reaches the compiled step without recompiling it.
4. The step. Forward and backward over the gradient-accumulation micro-batches, gradient
   clipping, the MoE expert-bias update of the families that balance load that way
   (load_balance.py), the optimizer update and zeroing the gradients run as ONE `torchtpu.compile`
   program from the first step on (`warmup="abstract"`: the state is found on shapes, the optimizer's
   is created up front; no op-by-op first step). The loss
   and the gradient norm stay on the devices; the host reads them only at logging steps.
5. Data: each host reads its own shard of the token stream; batches are laid out over the
   data-parallel mesh axes.
6. Metrics (loss, grad_norm, lr, tokens/s per device, TFLOP/s, MFU, step time, memory) go to
   `<dump_folder>/metrics.jsonl`, the console and optionally TensorBoard / W&B, from process 0.
   With [validation] enable, the held-out loss and perplexity join them at step 1 and every
   validation.freq steps (a second compiled program, forward only; torchtpu/train/validate.py).
7. Checkpoints (Orbax): model, optimizer, LR schedule, data position and step, every
   `interval` steps and at the end; a run resumes from the newest checkpoint automatically,
   ignoring a save that never finished and setting aside (step_N.unreadable) a damaged one.
8. `--dry-run`: builds the same job without allocating any array, compiles the step ahead of
   time (for the TPU topology when one is named) and reports HBM needed vs available, FLOPs,
   XLA's estimated step time and the implied tokens/s and MFU; exit 0 if it fits, 1 if not.

`Trainer(cfg)` exposes the pieces (model, optimizer, step function, data loader) for tests and
notebooks; `Trainer.train()` runs the loop and returns the logged metrics.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time

from .config.job_config import ConfigError, JobConfig
from .config.manager import save_resolved_config
from .console import log
from .fault import Preempted, PreemptionWatch, StepWatchdog, attempt_number, injected_stall
from .load_balance import balanced_moe_layers, update_expert_bias
from .loader_state import load_loader_state, loader_states
from .loss import language_model_loss
from .lr import build_schedule
from .model_builder import ac_settings, build_meta_model, build_model_args, mixed_precision_dtypes
from .moe_metrics import load_metrics, moe_layers, reset_counts, step_counts
from .optimizer import build_optimizer, init_optimizer_state, track_stacked_state
from .parallel_dims import ParallelDims, check_expert_parallel, job_devices, resolve_dims
from .profiling import Profiler

__all__ = ["Trainer", "main"]


# --------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------


def resolve_seed(cfg: JobConfig) -> int | None:
    """The run's base seed: [debug] seed; when unset, 0 with debug.deterministic, else None (a fresh one)."""
    if cfg.debug.seed is not None:
        return cfg.debug.seed
    return 0 if cfg.debug.deterministic else None


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


def _memory_gib() -> float | None:
    """Device memory in use on this process's first device (GiB)."""
    import jax

    from torchtpu.backend import device_memory_stats

    return device_memory_stats(jax.local_devices()[0]).get("bytes_in_use", 0) / 1024**3


# --------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------


class Trainer:
    """A training job built from a configuration. `train()` runs it; `dry_run()` compiles it only.

    Attributes after construction: dims (ParallelDims), mesh, devices, tokenizer, model_args,
    model, optimizer, lr_scheduler, dataloader (None in a dry run), step_fn (the compiled step),
    checkpointer (or None), step (the last completed step), history (the logged metrics).
    """

    def __init__(self, cfg: JobConfig, n_layers: int | None = None, model_overrides: dict | None = None):
        """`n_layers` overrides the flavor's depth (the dry run costs 0- and 1-layer copies);
        `model_overrides` other fields of the flavor's arguments (tests train narrower copies)."""
        import jax
        import torch

        import torchtpu  # noqa: F401  (registers the tpu device)
        from torchtpu.distributed import init_device_mesh, materialize
        from torchtpu.distributed.scan import optimizer_parameters, stacked_parameters
        from torchtpu.models.registry import get_family

        from .tokenizer import build_tokenizer

        self.cfg = cfg
        self.dry = bool(cfg.tpu.dry_run)
        self.history: list[dict] = []
        self.step = 0
        self.watchdog = None  # a fault.StepWatchdog, set by main()

        # -- devices, mesh
        self.devices = job_devices(cfg)
        self.dims: ParallelDims = resolve_dims(cfg, len(self.devices))
        dims = self.dims
        kwargs = {}
        if cfg.tpu.topology:
            kwargs["devices"] = self.devices
        if dims.num_slices > 1:
            kwargs["dcn_mesh_shape"] = dims.dcn_mesh_shape
        self.mesh = init_device_mesh("tpu", dims.mesh_shape, mesh_dim_names=dims.mesh_axis_names, **kwargs)
        if dims.ep_enabled:
            from torchtpu.distributed.mesh import expert_parallel_mesh

            # expert parallelism takes every tp rank and the inner ranks of the FSDP dim (torchtitan's
            # efsdp x ep with expert_tensor_parallel_degree 1)
            self.mesh = expert_parallel_mesh(self.mesh, dims.ep)

        # -- tokenizer and model arguments
        try:
            self.tokenizer = build_tokenizer(cfg.model.hf_assets_path or None)
        except (FileNotFoundError, ValueError) as e:
            where = cfg.origin("model", "hf_assets_path") or "default"
            raise ConfigError(f"{where}: [model] hf_assets_path = {cfg.model.hf_assets_path!r}: {e}") from None
        overrides = {**(model_overrides or {}), **({} if n_layers is None else {"n_layers": n_layers})}
        self.model_args = build_model_args(cfg, self.tokenizer.vocab_size, overrides)
        hf_opts = [o for o in ("initial_load_in_hf", "last_save_in_hf") if getattr(cfg.checkpoint, o)]
        if hf_opts and not get_family(cfg.model.name).has_hf_weights():
            from torchtpu.models.registry import FAMILIES

            raise ConfigError(
                f"[checkpoint] {hf_opts[0]}: model family {cfg.model.name!r} has no Hugging Face weights in torchtpu; "
                f"families with them: {', '.join(n for n, f in FAMILIES.items() if f.has_hf_weights())}"
            )
        if cfg.checkpoint.last_save_in_hf:  # a model transformers cannot compute stops here, not after training
            from torchtpu.models.hf_adapter import HFLayout, HFLayoutError

            try:
                HFLayout(self.model_args).hf_config("float32")
            except (ValueError, HFLayoutError) as e:
                raise ConfigError(f"[checkpoint] last_save_in_hf: {e}") from None
        check_expert_parallel(cfg, dims, self.model_args)

        # -- seed
        seed = resolve_seed(cfg)
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
            log(f"seed {seed} (set [debug] seed to repeat this run)")
        if cfg.debug.deterministic:
            torch.use_deterministic_algorithms(True)
        self.seed = seed
        torch.manual_seed(seed)
        torch.tpu.manual_seed_all(seed)

        # -- model on meta, parallelized, materialized sharded, initialised in place
        model = build_meta_model(cfg, self.model_args)
        family = get_family(cfg.model.name)
        self.num_params, self.flops_per_token = family.flops_per_token(model, self.model_args, cfg.training.seq_len)
        mp_param, mp_reduce = mixed_precision_dtypes(cfg)
        ac_mode, ac_every = ac_settings(cfg)
        from torchtpu.backend.activation_checkpoint import EVERY_BLOCK_AC_MODES

        family.parallelize(
            model,
            self.mesh,
            sequence_parallel=dims.tp > 1,
            loss_parallel=dims.tp > 1,
            param_dtype=mp_param,
            reduce_dtype=mp_reduce,
            ac_mode=ac_mode,
            ac_every=ac_every,
            # the layer scan recomputes every block, so it stands in for full or per-op checkpointing
            # only; a single block has nothing to scan
            scan_layers=cfg.tpu.scan_layers and ac_mode in EVERY_BLOCK_AC_MODES and self.model_args.n_layers > 1,
        )
        materialize(model)
        if not self.dry:
            with torch.no_grad():
                model.init_weights(buffer_device=torch.device("tpu"))
        self.model = model
        self.model.train()
        # auxiliary-loss-free load balancing, as the family's torchtitan optimizer does it (load_balance.py)
        self.balanced_moe = balanced_moe_layers(model) if family.moe_load_balancing else []
        self.moe_layers = moe_layers(model)  # MoE layers' load statistics go into the metrics

        # -- optimizer, schedule
        # In a dry run the learning rate is an unfilled program input too, and there is no schedule
        # to write it (the compiled program is the same: the rate is an input either way).
        # the layer scan's blocks have stacked storage (distributed.params.materialize): the optimizer
        # updates each stacked slot as one tensor, and checkpoints keep the per-parameter format
        self.stacked = stacked_parameters(model)
        self.optimizer = build_optimizer(optimizer_parameters(model, self.stacked), cfg, self.mesh, lazy=self.dry)
        if self.stacked:
            track_stacked_state(self.optimizer, list(model.parameters()), self.stacked)
        self.lr_scheduler = None if self.dry else build_schedule(self.optimizer, cfg)

        # -- the step: compiled from its first call. The optimizer's state exists before it (zeros and
        # step 0, what Adam would create in its first step) and the step sets the gradients to None,
        # so the abstract warm-up finds all the state on shapes, with no op-by-op first step.
        import torchtpu as _tt

        if not self.dry:
            init_optimizer_state(self.optimizer, self.mesh)
        self.step_fn = _tt.compile(self._train_step, warmup="abstract")

        # -- data
        self.dataloader = None
        if not self.dry:
            self.dataloader = build_train_dataloader(
                cfg, self.tokenizer, dims, self._host_rows(dims.micro_batch_size, cfg.training.seq_len)
            )

        # -- held-out evaluation ([validation])
        self.validator = None
        if not self.dry:
            from .validate import build_validator

            self.validator = build_validator(
                cfg,
                self.model,
                self.tokenizer,
                dims,
                place=self._place,
                loss_context=self._loss_context,
                host_rows=self._host_rows,
                process_count=jax.process_count(),
            )

        # -- checkpoints
        self.checkpointer = None
        if not self.dry:
            self.checkpointer = build_checkpointer(cfg)

    # -- the compiled step -------------------------------------------------------------------

    def _train_step(self, microbatches):
        """Forward + backward over the micro-batches, clip, update, zero grads. One XLA program."""
        import torch

        from torchtpu.distributed.scan import stack_gradients

        n = len(microbatches)
        total = None
        reset_counts(self.moe_layers)  # MoE load statistics: this step's tokens per expert
        for inputs, labels in microbatches:
            # With tensor parallelism the logits stay split over the vocabulary (torchtitan's
            # loss_parallel): the cross entropy reduces across the tp shards, never gathering them,
            # the whole logits' or each chunk's ([tpu] loss_chunk_size).
            with self._loss_context():
                loss = language_model_loss(self.model, inputs, labels, self.cfg.tpu.loss_chunk_size)
            (loss / n if n > 1 else loss).backward()
            d = loss.detach()
            total = d if total is None else total + d
        stack_gradients(self.stacked, self.model)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.training.max_norm, foreach=True)
        counts = step_counts(self.moe_layers)  # the MoE metrics' (a bias update zeroes the buffers)
        if self.balanced_moe:  # torchtitan: an optimizer step pre-hook
            update_expert_bias(self.balanced_moe)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return (total / n if n > 1 else total), grad_norm, counts

    def _loss_context(self):
        import contextlib

        if self.dims.tp > 1:
            from torchtpu.distributed import loss_parallel

            return loss_parallel(self.mesh["tp"])
        return contextlib.nullcontext()

    # -- data ----------------------------------------------------------------------------------

    def _host_rows(self, global_rows: int, seq_len: int) -> tuple[int, ...]:
        """The rows of a (global_rows, seq_len) token batch that this process's devices hold."""
        from torchtpu.distributed.batch import host_rows

        return host_rows(self.mesh, global_rows, seq_len)

    def _place(self, x, global_rows: int):
        """This process's rows (self._host_rows order) of a (global_rows, seq_len) batch of token ids, a
        host numpy array -> the global int32 tpu tensor laid out over the dp axes (64-bit integers are
        emulated on TPU; see docs/DESIGN_NOTES.md)."""
        from torchtpu.distributed.batch import place_batch

        from .data import token_ids_int32

        return place_batch(token_ids_int32(x, self.model_args.vocab_size), self.mesh, global_rows)

    def next_batch(self):
        """The next optimizer step's micro-batches: [(inputs, labels)] * grad_accum_steps on tpu."""
        out = []
        for _ in range(self.dims.grad_accum_steps):
            inputs, labels = next(self.dataloader)
            rows = self.dataloader.global_rows
            out.append((self._place(inputs, rows), self._place(labels, rows)))
        return out

    # -- checkpoint state --------------------------------------------------------------------

    def state(self) -> dict:
        from .checkpoint.manager import model_state, optimizer_state

        return {
            "model": model_state(self.model),
            "optimizer": optimizer_state(self.optimizer),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "dataloader": loader_states(self.dataloader),
            "step": self.step,
        }

    def _save_state(self, final: bool) -> dict:
        """What a checkpoint holds: the whole state, or at the last step with
        checkpoint.last_save_model_only the weights only, in checkpoint.export_dtype."""
        ck = self.cfg.checkpoint
        if final and ck.last_save_model_only:
            import torch

            from .checkpoint.manager import model_only_state

            return model_only_state(self.model, self.step, getattr(torch, ck.export_dtype))
        return self.state()

    def _save(self, step: int, state: dict, force: bool) -> None:
        """Checkpoint `step` and say what was written: its size and time (an asynchronous save: the
        time to copy it off the devices; the files follow in the background)."""
        from .checkpoint.files import describe_size, folder_size

        t0 = time.perf_counter()
        if not self.checkpointer.save(step, state, force=force):
            return
        dt = time.perf_counter() - t0
        path = self.checkpointer.step_path(step)
        if os.path.isdir(path):
            log(f"checkpoint {path} written: {describe_size(folder_size(path))} in {dt:.1f} s")
        else:
            log(f"checkpoint {path}: copied off the devices in {dt:.1f} s, writing in the background")

    def _save_hf(self, step: int) -> None:
        """checkpoint.last_save_in_hf: the final weights also as a Hugging Face folder
        (<checkpoint folder>/hf_step_N, in checkpoint.export_dtype), with the job's tokenizer."""
        import torch

        from .checkpoint.hf import save_model_as_hf

        ck = self.cfg.checkpoint
        folder = os.path.join(self.cfg.job.dump_folder, ck.folder, f"hf_step_{step}")
        save_model_as_hf(
            folder,
            self.model,
            self.model_args,
            getattr(torch, ck.export_dtype),
            tokenizer=self.tokenizer,
        )
        log(f"final weights as a Hugging Face folder: {folder}")

    def maybe_resume(self) -> bool:
        """Restore this run's newest checkpoint, or the initial one; see checkpoint/resume.py."""
        from .checkpoint.resume import maybe_resume

        return maybe_resume(self)

    def restore_full(self, ck, step: int) -> None:
        """Restore the whole training state of checkpoint `step` of `ck` in place."""
        from .checkpoint.manager import load_model_state, load_optimizer_state

        cfg = self.cfg.checkpoint
        init_optimizer_state(self.optimizer, self.mesh)
        excluded = set(cfg.exclude_from_loading)
        target = self.state()
        # excluded parts are not read at all (restoring fills tensors in place, so reading them and
        # then not loading them would still overwrite the optimizer state)
        restored = ck.restore(step, target=target, skip=tuple(excluded))
        load_model_state(self.model, restored["model"])
        if "optimizer" not in excluded:
            load_optimizer_state(self.optimizer, restored["optimizer"])
        if "lr_scheduler" not in excluded:
            self.lr_scheduler.load_state_dict(restored["lr_scheduler"])
        if "dataloader" not in excluded:
            load_loader_state(self.dataloader, restored["dataloader"], self.dims)
        self.step = int(restored["step"])

    # -- the loop ------------------------------------------------------------------------------

    def current_lr(self) -> float:
        """The learning rate the next step uses, computed on the host (no device read)."""
        sch = self.lr_scheduler
        return float(self.cfg.optimizer.lr * sch.lr_lambdas[0](sch.last_epoch))

    def train(self) -> list[dict]:
        import jax

        from .metrics import build_metrics_logger, peak_flops

        cfg = self.cfg
        dims = self.dims
        self.maybe_resume()
        total_steps = cfg.training.steps
        logger = build_metrics_logger(cfg, jax.process_index(), total_steps, start_step=self.step)
        peak, peak_src = peak_flops(self.devices[0].device_kind)
        tokens_per_step = dims.tokens_per_step
        world = dims.world_size
        log(
            f"{cfg.model.name} {cfg.model.flavor}: {self.num_params:,} parameters, mesh "
            f"{dict(zip(dims.mesh_axis_names, dims.mesh_shape))}"
            f"{f' (experts over ep {dims.ep} x efsdp {dims.efsdp})' if dims.ep_enabled else ''} "
            f"over {world} {self.devices[0].platform} devices, "
            f"global batch {dims.global_batch_size} x {dims.seq_len} tokens "
            f"({dims.grad_accum_steps} micro-batch(es)), steps {self.step + 1}..{total_steps}"
        )
        log(f"peak {peak / 1e12:.2f} TFLOP/s per device ({peak_src})")
        if self.stacked:
            from torchtpu.distributed.scan import loop_unrolled

            if loop_unrolled():
                log(
                    "layer scan: the blocks run unrolled, not in a loop, on the CPU devices of several processes "
                    "(XLA:CPU would run collectives after a loop concurrently with the loop's own, which gloo "
                    "mismatches; torchtpu.distributed.scan.loop_unrolled)"
                )

        profiler = Profiler(cfg)
        preemption = PreemptionWatch()  # SIGTERM: stop at a step boundary all processes agree on
        stall = injected_stall(cfg.debug.inject_stall, jax.process_index())
        t_last = time.perf_counter()
        steps_since = 0
        gc_was = gc.isenabled()
        gc.disable()
        try:
            while self.step < total_steps:
                step = self.step + 1
                profiler.before(step)
                batch = self.next_batch()
                lr = self.current_lr()
                loss, grad_norm, moe_counts = self.step_fn(batch)
                if stall is not None:
                    stall(step)
                self.lr_scheduler.step()
                self.step = step
                steps_since += 1
                profiler.after(step, loss)
                if gc_due(cfg, step):
                    gc.collect(1)
                val = self._maybe_validate(step, loss)
                if val is not None:
                    t_last += val["validation/time_s"]  # keep evaluation time out of the step time
                if logger.should_log(step):
                    loss_v = float(loss.item())  # the one host sync per log interval
                    gn_v = float(grad_norm.item())
                    now = time.perf_counter()
                    dt = (now - t_last) / steps_since
                    tps = tokens_per_step / dt / world
                    tflops = self.flops_per_token * tps / 1e12
                    rec = {
                        "loss": loss_v,
                        "grad_norm": gn_v,
                        "lr": lr,
                        "tps": tps,
                        "tflops": tflops,
                        "mfu": 100.0 * tflops * 1e12 / peak,
                        "step_time": dt,
                        "memory_gib": _memory_gib(),
                    }
                    if cfg.training.max_bad_records:  # this host's rows since step 1 (a resume continues)
                        rec["bad_records"] = self.dataloader.bad_records.count
                    if not math.isfinite(loss_v):
                        logger.log(step, rec)
                        raise FloatingPointError(
                            f"loss is {loss_v} at step {step}; lower [optimizer] lr or check the data"
                        )
                    rec.update(load_metrics(self.moe_layers, moe_counts))
                    rec.update(val or {})
                    logger.log(step, rec)
                    self.history.append({"step": step, **rec})
                    t_last = time.perf_counter()
                    steps_since = 0
                elif val is not None:
                    logger.log(step, val)
                    self.history.append({"step": step, **val})
                else:
                    logger.progress(step)
                due, force = save_due(cfg, self.checkpointer, step)
                if due:
                    self._save(step, self._save_state(final=step == total_steps), force)
                if (
                    step == total_steps
                    and self.checkpointer is not None
                    and not cfg.checkpoint.load_only
                    and cfg.checkpoint.last_save_in_hf
                ):
                    self._save_hf(step)
                if self.watchdog is not None:
                    self.watchdog.step_done()
                if step < total_steps and preemption.should_stop(step):
                    raise self._preempted(step, preemption.stop_signal)
        finally:
            profiler.close()
            if gc_was:
                gc.enable()
            logger.close()
            if self.checkpointer is not None:
                self.checkpointer.close()  # waits for a save in flight; a first Ctrl-C does not cut it short
            preemption.close()
        return self.history

    def _maybe_validate(self, step: int, loss) -> dict | None:
        """[validation]: evaluate on the held-out data at step 1 and every validation.freq steps."""
        if self.validator is None or not self.validator.should_validate(step):
            return None
        import jax

        import torchtpu

        jax.block_until_ready(torchtpu.to_jax(loss))  # the training step's time is not the evaluation's
        return self.validator.validate()

    def _preempted(self, step: int, signal_name: str) -> Preempted:
        """SIGTERM or Ctrl-C: checkpoint the step just finished (unless it was saved already); exit 42
        (SIGINT: 130) follows."""
        ck = self.checkpointer
        if ck is None or self.cfg.checkpoint.load_only:
            return Preempted(step, None, signal_name)
        if ck.latest_step() != step:
            self._save(step, self.state(), force=True)
        ck.close()  # waits for an asynchronous save to be complete on disk
        return Preempted(step, ck.step_path(step), signal_name)

    # -- dry run -------------------------------------------------------------------------------

    def dry_run(self) -> int:
        """Compile the step ahead of time without allocating arrays; report; 0 if it fits else 1."""
        from .dry_run.estimate import dry_run

        return dry_run(self)


def _lock_dump_folder(cfg: JobConfig):
    """Hold the dump folder for this job (dump_lock.py), or raise ConfigError naming the job that does.

    The processes of a torchelastic job share the lock under its run id; the processes of a job joined
    otherwise (a TPU slice's own discovery) have no shared name, so process 0 holds it for them."""
    import jax

    from .dump_lock import RUN_ID_ENV, hold_dump_folder

    if RUN_ID_ENV not in os.environ and jax.process_index() != 0:
        return None
    return hold_dump_folder(cfg)


def main(cfg: JobConfig) -> int:
    """Run the job `cfg` describes; returns the exit status (0 done, 1 dry run does not fit).

    Configuration problems raise ConfigError (the CLI prints one line and exits 2)."""
    watchdog = None
    lock = None
    if not cfg.tpu.dry_run:
        # Multi-host: join the job (coordinator from torchrun / the TPU slice) before any device work.
        from torchtpu.distributed import initialize

        initialize(init_timeout_seconds=cfg.comm.init_timeout_seconds)
        lock = _lock_dump_folder(cfg)  # before anything is written there
    try:
        save_resolved_config(cfg)
        if not cfg.tpu.dry_run:
            if "TORCHELASTIC_RUN_ID" in os.environ:
                log(
                    f"attempt {attempt_number()} (torchelastic restarts allowed: "
                    f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '0')})"
                )
            watchdog = StepWatchdog(cfg.comm.init_timeout_seconds, cfg.comm.train_timeout_seconds)
        if cfg.tpu.dry_run:
            from .dry_run.estimate import phase

            with phase("building the job (model on meta, parallelized)"):
                trainer = Trainer(cfg)
            return trainer.dry_run()
        trainer = Trainer(cfg)
        trainer.watchdog = watchdog
        t0 = time.perf_counter()
        try:
            history = trainer.train()
        except Preempted as p:
            print(f"[torchtpu-train] {p}", file=sys.stderr, flush=True)  # every process: each exits 42 (130)
            return p.exit_status
    finally:
        if watchdog is not None:
            watchdog.close()
        if lock is not None:
            lock.release()
    if history:
        log(f"done: {trainer.step} steps in {time.perf_counter() - t0:.1f} s, final loss {history[-1]['loss']:.4f}")
    return 0
