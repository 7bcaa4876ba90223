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

Where the pieces live: build.py (each piece from the config and values), step.py (the compiled step),
train_state.py (what a checkpoint holds), metrics.py (a logged step's throughput and MFU), startup.py
(joining the job, the dump-folder lock, the watchdog). A component receives values (a TrainState, a
dry_run.estimate.BuiltStep, functions of the mesh), never the Trainer.
"""

from __future__ import annotations

import functools
import gc
import math
import sys
import time

from .build import (
    build_checkpointer,
    build_train_dataloader,
    check_model_options,
    gc_due,
    job_mesh,
    load_tokenizer,
    loss_context,
    parallel_model,
    place_tokens,
    save_due,
    seed_run,
)
from .config.job_config import JobConfig
from .console import log
from .fault import Preempted, PreemptionWatch, injected_stall
from .load_balance import balanced_moe_layers
from .lr import build_schedule
from .model_builder import build_model_args
from .moe_metrics import load_metrics, moe_layers
from .optimizer import build_optimizer, init_optimizer_state, track_stacked_state
from .parallel_dims import ParallelDims, job_devices, resolve_dims
from .profiling import Profiler
from .startup import joined_job
from .step import StepParts, compile_train_step
from .train_state import TrainState

__all__ = ["Trainer", "main"]


class Trainer:
    """A training job built from a configuration. `train()` runs it; `dry_run()` compiles it only.

    Attributes after construction: dims (ParallelDims), mesh, devices, tokenizer, model_args,
    model, optimizer, lr_scheduler, dataloader (None in a dry run), step_fn (the compiled step),
    checkpointer (or None), step (the last completed step), history (the logged metrics).
    """

    def __init__(self, cfg: JobConfig, n_layers: int | None = None, model_overrides: dict | None = None):
        """`n_layers` overrides the flavor's depth (the dry run costs shallow copies), `model_overrides`
        other fields of its arguments (tests train narrower copies), after [model] n_layers and
        flavor_overrides."""
        import jax

        import torchtpu  # noqa: F401  (registers the tpu device)
        from torchtpu.distributed.batch import host_rows
        from torchtpu.distributed.scan import optimizer_parameters, stacked_parameters

        from .validate import build_validator

        self.cfg, self.dry, self.history, self.step = cfg, bool(cfg.tpu.dry_run), [], 0
        self.devices = job_devices(cfg)
        self.dims: ParallelDims = resolve_dims(cfg, len(self.devices))
        dims = self.dims
        self.mesh = job_mesh(cfg, dims, self.devices)
        self.tokenizer = load_tokenizer(cfg)
        overrides = {**(model_overrides or {}), **({} if n_layers is None else {"n_layers": n_layers})}
        self.model_args = build_model_args(cfg, self.tokenizer.vocab_size, overrides)
        check_model_options(cfg, dims, self.model_args)
        self.seed = seed_run(cfg)
        self.model, family, self.num_params, self.flops_per_token = parallel_model(
            cfg, self.mesh, dims, self.model_args, init=not self.dry
        )
        # auxiliary-loss-free load balancing, as the family's torchtitan optimizer does it (load_balance.py)
        self.balanced_moe = balanced_moe_layers(self.model) if family.moe_load_balancing else []
        self.moe_layers = moe_layers(self.model)  # MoE layers' load statistics go into the metrics

        # The layer scan's blocks have stacked storage: the optimizer updates each stacked slot as one
        # tensor, and checkpoints keep the per-parameter format. In a dry run the learning rate is an
        # unfilled program input too, with no schedule to write it (the program is the same).
        self.stacked = stacked_parameters(self.model)
        params = optimizer_parameters(self.model, self.stacked)
        self.optimizer = build_optimizer(params, cfg, self.mesh, lazy=self.dry)
        if self.stacked:
            track_stacked_state(self.optimizer, list(self.model.parameters()), self.stacked)
        self.lr_scheduler = None if self.dry else build_schedule(self.optimizer, cfg)

        if not self.dry:  # the state Adam's first step would create, so the step compiles from its first call
            init_optimizer_state(self.optimizer, self.mesh)
        self.loss_context = functools.partial(loss_context, self.mesh, dims.tp)
        parts = StepParts(
            cfg, self.model, self.optimizer, self.stacked, self.balanced_moe, self.moe_layers, self.loss_context
        )
        self.step_fn = compile_train_step(parts)

        # data, held-out evaluation ([validation]) and checkpoints: none in a dry run
        self.place = functools.partial(place_tokens, self.mesh, self.model_args.vocab_size)
        rows = functools.partial(host_rows, self.mesh)
        self.dataloader = self.validator = self.checkpointer = None
        if not self.dry:
            self.dataloader = build_train_dataloader(
                cfg, self.tokenizer, dims, rows(dims.micro_batch_size, cfg.training.seq_len)
            )
            self.validator = build_validator(
                cfg, self.model, self.tokenizer, dims, self.place, self.loss_context, rows, jax.process_count()
            )
            self.checkpointer = build_checkpointer(cfg)

    # -- the pieces components receive ----------------------------------------------------------

    def train_state(self) -> TrainState:
        """What a checkpoint saves and restores (train_state.TrainState)."""
        return TrainState(
            self.model, self.optimizer, self.lr_scheduler, self.dataloader, self.dims, self.mesh, self.model_args
        )

    def built_step(self):
        """What the dry run compiles and reports on (dry_run.estimate.BuiltStep), its costing copies
        built as this class builds the job."""
        from .dry_run.estimate import BuiltStep

        return BuiltStep(
            self.cfg,
            self.devices,
            self.dims,
            self.mesh,
            self.model_args,
            self.model,
            self.moe_layers,
            self.flops_per_token,
            self.step_fn,
            at_depth=functools.partial(_built_at_depth, type(self)),
        )

    def next_batch(self):
        """The next optimizer step's micro-batches: [(inputs, labels)] * grad_accum_steps on tpu."""
        out = []
        for _ in range(self.dims.grad_accum_steps):
            inputs, labels = next(self.dataloader)
            rows = self.dataloader.global_rows
            out.append((self.place(inputs, rows), self.place(labels, rows)))
        return out

    def state(self) -> dict:
        """The whole training state at the current step, as a checkpoint holds it."""
        return self.train_state().tree(self.step)

    def maybe_resume(self) -> bool:
        """Restore this run's newest checkpoint, or the initial one (checkpoint/resume.py); True when a
        checkpoint of this run was restored."""
        from .checkpoint.resume import maybe_resume

        resumed, step = maybe_resume(self.checkpointer, self.cfg, self.train_state())
        if step is not None:
            self.step = step
        return resumed

    def current_lr(self) -> float:
        """The learning rate the next step uses, computed on the host (no device read)."""
        sch = self.lr_scheduler
        return float(self.cfg.optimizer.lr * sch.lr_lambdas[0](sch.last_epoch))

    # -- the loop ------------------------------------------------------------------------------

    def train(self, watchdog=None) -> list[dict]:
        """Run the steps left up to training.steps; returns the logged metrics. `watchdog`: the job's
        fault.StepWatchdog, told of every finished step."""
        import jax

        from .metrics import StepTimer, build_metrics_logger

        cfg = self.cfg
        self.maybe_resume()
        logger = build_metrics_logger(cfg, jax.process_index(), cfg.training.steps, start_step=self.step)
        peak = self._announce()
        profiler = Profiler(cfg)
        preemption = PreemptionWatch()  # SIGTERM: stop at a step boundary all processes agree on
        stall = injected_stall(cfg.debug.inject_stall, jax.process_index())
        timer = StepTimer()
        gc_was = gc.isenabled()
        gc.disable()
        try:
            while self.step < cfg.training.steps:
                step = self.step + 1
                profiler.before(step)
                batch = self.next_batch()
                lr = self.current_lr()
                loss, grad_norm, moe_counts = self.step_fn(batch)
                if stall is not None:
                    stall(step)
                self.lr_scheduler.step()
                self.step = step
                timer.step_done()
                profiler.after(step, loss)
                if gc_due(cfg, step):
                    gc.collect(1)
                val = self._maybe_validate(step, loss)
                if val is not None:
                    timer.leave_out(val["validation/time_s"])  # keep evaluation time out of the step time
                if logger.should_log(step):
                    self._log_step(logger, step, loss, grad_norm, lr, moe_counts, val, timer, peak)
                elif val is not None:
                    self._log(logger, step, val)
                else:
                    logger.progress(step)
                self._checkpoint(step)
                if watchdog is not None:
                    watchdog.step_done()
                if step < cfg.training.steps and preemption.should_stop(step):
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

    def _announce(self) -> float:
        """Say what is trained on what (and how the layer scan runs); returns the chip's peak FLOP/s."""
        from .metrics import peak_flops

        dims = self.dims
        peak, peak_src = peak_flops(self.devices[0].device_kind)
        log(
            f"{self.cfg.model.name} {self.cfg.model.flavor}: {self.num_params:,} parameters, mesh "
            f"{dict(zip(dims.mesh_axis_names, dims.mesh_shape))}"
            f"{f' (experts over ep {dims.ep} x efsdp {dims.efsdp})' if dims.ep_enabled else ''} "
            f"over {dims.world_size} {self.devices[0].platform} devices, "
            f"global batch {dims.global_batch_size} x {dims.seq_len} tokens "
            f"({dims.grad_accum_steps} micro-batch(es)), steps {self.step + 1}..{self.cfg.training.steps}"
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
        return peak

    def _log_step(self, logger, step: int, loss, grad_norm, lr: float, moe_counts, val, timer, peak: float):
        """A logging step's metrics: the one host read of the interval; a loss that is not finite is
        logged, then raised."""
        from .metrics import device_memory_gib, step_metrics

        loss_v = float(loss.item())  # the one host sync per log interval
        rec = {"loss": loss_v, "grad_norm": float(grad_norm.item()), "lr": lr}
        dims = self.dims
        rec.update(
            step_metrics(timer.seconds_per_step(), dims.tokens_per_step, dims.world_size, self.flops_per_token, peak)
        )
        rec["memory_gib"] = device_memory_gib()
        if self.cfg.training.max_bad_records:  # this host's rows since step 1 (a resume continues)
            rec["bad_records"] = self.dataloader.bad_records.count
        if not math.isfinite(loss_v):
            logger.log(step, rec)
            raise FloatingPointError(f"loss is {loss_v} at step {step}; lower [optimizer] lr or check the data")
        rec.update(load_metrics(self.moe_layers, moe_counts))
        rec.update(val or {})
        self._log(logger, step, rec)
        timer.restart()

    def _log(self, logger, step: int, rec: dict) -> None:
        logger.log(step, rec)
        self.history.append({"step": step, **rec})

    def _maybe_validate(self, step: int, loss) -> dict | None:
        """[validation]: evaluate on the held-out data at step 1 and every validation.freq steps."""
        if self.validator is None or not self.validator.should_validate(step):
            return None
        import jax

        import torchtpu

        jax.block_until_ready(torchtpu.to_jax(loss))  # the training step's time is not the evaluation's
        return self.validator.validate()

    # -- checkpoints ---------------------------------------------------------------------------

    def _checkpoint(self, step: int) -> None:
        """The saves due after `step`: every interval steps and the last step (checkpoint.last_save_model_only:
        the weights only, in checkpoint.export_dtype), and with checkpoint.last_save_in_hf a Hugging Face folder."""
        cfg = self.cfg
        last = step == cfg.training.steps
        due, force = save_due(cfg, self.checkpointer, step)
        if due:
            if last and cfg.checkpoint.last_save_model_only:
                import torch

                from .checkpoint.manager import model_only_state

                state = model_only_state(self.model, self.step, getattr(torch, cfg.checkpoint.export_dtype))
            else:
                state = self.state()
            self._save(step, state, force)
        if last and self.checkpointer is not None and not cfg.checkpoint.load_only and cfg.checkpoint.last_save_in_hf:
            self._save_hf(step)

    def _save(self, step: int, state: dict, force: bool) -> None:
        """Checkpoint `step` and say what was written: its size and time (an asynchronous save: the
        time to copy it off the devices; the files follow in the background)."""
        import os

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
        import os

        import torch

        from .checkpoint.hf import save_model_as_hf

        ck = self.cfg.checkpoint
        folder = os.path.join(self.cfg.job.dump_folder, ck.folder, f"hf_step_{step}")
        save_model_as_hf(folder, self.model, self.model_args, getattr(torch, ck.export_dtype), tokenizer=self.tokenizer)
        log(f"final weights as a Hugging Face folder: {folder}")

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

        return dry_run(self.built_step())


def _built_at_depth(cls, cfg: JobConfig, n_layers: int):
    """The BuiltStep of the job `cfg` built by `cls` with `n_layers` blocks (the dry run's costing copies)."""
    return cls(cfg, n_layers=n_layers).built_step()


def main(cfg: JobConfig) -> int:
    """Run the job `cfg` describes; returns the exit status (0 done, 1 dry run does not fit, 42 / 130
    preempted). Configuration problems raise ConfigError (the CLI prints one line and exits 2)."""
    with joined_job(cfg) as watchdog:
        if cfg.tpu.dry_run:
            from .dry_run.estimate import phase

            with phase("building the job (model on meta, parallelized)"):
                trainer = Trainer(cfg)
            return trainer.dry_run()
        trainer = Trainer(cfg)
        t0 = time.perf_counter()
        try:
            history = trainer.train(watchdog)
        except Preempted as p:
            print(f"[torchtpu-train] {p}", file=sys.stderr, flush=True)  # every process: each exits 42 (130)
            return p.exit_status
    if history:
        log(f"done: {trainer.step} steps in {time.perf_counter() - t0:.1f} s, final loss {history[-1]['loss']:.4f}")
    return 0
