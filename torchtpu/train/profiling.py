"""[profiling]: jax.profiler traces of chosen steps and device-memory profiles.

profiler = Profiler(cfg)
for step in ...:
    profiler.before(step); out = step_fn(...); profiler.after(step, out)
profiler.close()
"""

from __future__ import annotations

import os

from .config.job_config import JobConfig
from .console import log

__all__ = ["Profiler"]


class Profiler:
    """jax.profiler traces of `profiler_active` steps ending at each multiple of profile_freq."""

    def __init__(self, cfg: JobConfig):
        p = cfg.profiling
        self.enabled = p.enable_profiling
        self.freq = p.profile_freq
        self.active = min(p.profiler_active, p.profile_freq)
        self.folder = os.path.join(cfg.job.dump_folder, p.save_traces_folder)
        self.memory = p.enable_memory_snapshot
        self.memory_folder = os.path.join(cfg.job.dump_folder, p.save_memory_snapshot_folder)
        self.on = False

    def before(self, step: int) -> None:
        if not self.enabled or self.on:
            return
        end = -(-step // self.freq) * self.freq
        if step == end - self.active + 1:
            import jax

            self.dir = os.path.join(self.folder, f"iteration_{end}")
            os.makedirs(self.dir, exist_ok=True)
            jax.profiler.start_trace(self.dir)
            self.on = True

    def after(self, step: int, out) -> None:
        if self.memory and step % self.freq == 0:
            import jax

            import torchtpu

            jax.block_until_ready(torchtpu.to_jax(out))
            folder = os.path.join(self.memory_folder, f"iteration_{step}")
            os.makedirs(folder, exist_ok=True)
            jax.profiler.save_device_memory_profile(os.path.join(folder, "memory.prof"))
            log(f"device memory profile of step {step} in {folder}/memory.prof")
        if self.on and step % self.freq == 0:
            import jax

            import torchtpu

            jax.block_until_ready(torchtpu.to_jax(out))
            jax.profiler.stop_trace()
            self.on = False
            log(f"profiler trace of step(s) {step - self.active + 1}..{step} in {self.dir}")

    def close(self) -> None:
        if self.on:
            import jax

            jax.profiler.stop_trace()
            self.on = False
