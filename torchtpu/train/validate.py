"""Held-out evaluation during training ([validation]), with torchtitan 0.2.2's meaning of each key.

    validator = Validator(cfg, model, tokenizer, dims, place, loss_context)   # the trainer's (build.py)
    if validator.should_validate(step):          # step 1 and every validation.freq steps
        metrics = validator.validate()            # {"validation/loss": ..., "validation/perplexity": ...}

- The data is `validation.dataset` / `validation.dataset_path`, read by the same loader as
  training (bundled corpus: its held-out split "bundled_validation", which training never reads),
  in batches of `validation.local_batch_size` sequences per data-parallel rank and
  `validation.seq_len` tokens. As for training, every row of the batch is its own stream and a
  process reads only the rows its devices hold, so the batches, and the loss, do not depend on the
  number of processes.
- `validation.steps = -1` evaluates the whole split (every complete batch: as many as the row
  stream with the fewest complete windows has), `steps = N` the
  first N batches, wrapping around the split if it has fewer. Unlike torchtitan, whose infinite
  validation loader moves on between evaluations, every evaluation reads the same batches, so two
  evaluations of the run measure the model on the same data and can be compared.
- The loss is the mean token cross entropy over those batches (each batch weighs the same: they
  all hold local_batch_size x seq_len tokens); the perplexity is exp(loss).
- The forward pass is its own compiled program (`torchtpu.compile`, no backward, no optimizer),
  over the same sharded parameters and the same batch layout as the training step; the losses
  stay on the devices until the one host read at the end of an evaluation.
"""

from __future__ import annotations

import math
import time

from .config.job_config import ConfigError

__all__ = ["Validator", "build_validator"]


def build_validator(cfg, model, tokenizer, dims, place, loss_context, host_rows=None, process_count: int = 1):
    """The job's Validator, or None when [validation] enable is false.

    place(x, global_rows): this process's rows of a batch -> the global tpu tensor; host_rows(global_rows,
    seq_len): the rows this process's devices hold (default: all, one process)."""
    if not cfg.validation.enable:
        return None
    return Validator(cfg, model, tokenizer, dims, place, loss_context, host_rows, process_count)


class Validator:
    def __init__(self, cfg, model, tokenizer, dims, place, loss_context, host_rows=None, process_count: int = 1):
        import torchtpu

        v = cfg.validation
        self.cfg = cfg
        self.freq = v.freq
        self.steps = v.steps
        self.model = model
        self.tokenizer = tokenizer
        self.place = place
        self.loss_context = loss_context
        micro = dims.micro_batch_for(v.local_batch_size)
        self.global_rows = micro
        self.rows = host_rows(micro, v.seq_len) if host_rows is not None else tuple(range(micro))
        self.host_batch = len(self.rows)
        self.tokens_per_batch = micro * v.seq_len
        self.process_count = process_count
        self._loader()  # fail now, at start-up, on a bad dataset rather than at the first evaluation
        self.num_batches = self._count_batches() if self.steps == -1 else self.steps
        self.eval_fn = torchtpu.compile(self._eval_step, warmup="abstract")  # compiled from the first call

    def _loader(self):
        from .data import build_global_batch_loader

        v = self.cfg.validation
        try:
            return build_global_batch_loader(
                v.dataset,
                v.dataset_path,
                self.tokenizer,
                v.seq_len,
                self.global_rows,
                self.rows,
                seed=0,
                infinite=self.steps != -1,
            )
        except (FileNotFoundError, ValueError, ConnectionError) as e:
            raise ConfigError(f"[validation] dataset = {v.dataset!r}, dataset_path = {v.dataset_path!r}: {e}") from None

    def _count_batches(self) -> int:
        """Complete batches in one pass over the split: the fewest any row stream has (this process's rows,
        then the minimum over processes)."""
        n = sum(1 for _ in self._loader())
        if self.process_count > 1:
            import numpy as np
            from jax.experimental import multihost_utils

            n = int(np.min(multihost_utils.process_allgather(np.asarray([n]))))
        if n == 0:
            v = self.cfg.validation
            raise ConfigError(
                f"[validation] dataset = {v.dataset!r}, dataset_path = {v.dataset_path!r}: the split holds fewer tokens "
                f"than one validation batch needs: one of its {self.global_rows} row streams (one per sequence of the "
                f"batch) has fewer than {v.seq_len + 1} tokens; lower validation.local_batch_size or seq_len, or give "
                "a larger validation set"
            )
        return n

    def should_validate(self, step: int) -> bool:
        """torchtitan's rule: the first step and every `freq`-th step."""
        return step == 1 or step % self.freq == 0

    def _eval_step(self, inputs, labels):
        import torch

        from .loss import cross_entropy_loss

        # Llama 3 has no dropout or batch-norm, so train/eval mode would not change the forward;
        # no_grad keeps the program forward-only.
        with torch.no_grad(), self.loss_context():
            return cross_entropy_loss(self.model(inputs), labels)

    def validate(self) -> dict:
        """Evaluate on the held-out batches; returns the metrics to log."""
        t0 = time.perf_counter()
        loader = self._loader()
        total = None
        for _ in range(self.num_batches):
            inputs, labels = next(loader)
            loss = self.eval_fn(self.place(inputs, self.global_rows), self.place(labels, self.global_rows))
            total = loss if total is None else total + loss
        mean = float(total.item()) / self.num_batches  # the one host read of the evaluation
        return {
            "validation/loss": mean,
            "validation/perplexity": math.exp(mean) if mean < 700 else math.inf,
            "validation/batches": self.num_batches,
            "validation/tokens": self.num_batches * self.tokens_per_batch,
            "validation/time_s": time.perf_counter() - t0,
        }
