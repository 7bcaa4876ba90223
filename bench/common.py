"""Pieces shared by the benchmarks: the timing loop and the PyTorch language-model step."""

from __future__ import annotations

import statistics
import time

import torch


def timed(run_step, sync, *, warmup: int, steps: int) -> float:
    """Median seconds per call of `run_step` (each result passed to `sync`) after `warmup` calls."""
    for _ in range(warmup):
        sync(run_step())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sync(run_step())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def lm_step(model: torch.nn.Module, opt: torch.optim.Optimizer, max_norm: float):
    """A training step: cross-entropy of model(inputs) against labels, clipping, optimizer step."""

    def step(inputs, labels):
        opt.zero_grad()
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        return loss.detach()

    return step
