"""Per-op dispatch cost of a small pointwise op, side by side in one run.

    python -m bench.eager_overhead

Compares `a + 1` on a 16-element float32 tensor for: torchtpu eager (tpu device on XLA's CPU
backend), PyTorch eager on CPU, and a bare jitted JAX op (the floor torchtpu sits on). Steady
state: every executable is compiled before timing. Reports microseconds per op (median of
several rounds) and the ratio of torchtpu over bare JAX. Then the same for the copy of an
(8, 64) float32 batch from the CPU: `batch.to("tpu")` against `jax.device_put` of its NumPy
array (the transfer JAX users write) and a CPU `batch.clone()`.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import torchtpu  # noqa: E402

N = 5000
ROUNDS = 7


def per_op_us(step, sync) -> float:
    for _ in range(500):
        step()
    sync()
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(N):
            step()
        sync()
        times.append((time.perf_counter() - t0) / N * 1e6)
    return statistics.median(times)


def main():
    a_tpu = torch.randn(16).to("tpu")
    a_cpu = torch.randn(16)
    a_jax = jnp.ones(16, jnp.float32)
    add_one = jax.jit(lambda x: x + 1)
    box = {}

    def tpu_step():
        box["t"] = a_tpu + 1

    def cpu_step():
        box["c"] = a_cpu + 1

    def jax_step():
        box["j"] = add_one(a_jax)

    torchtpu.reset_cache_stats()
    tpu = per_op_us(tpu_step, lambda: torchtpu.to_jax(box["t"]).block_until_ready())
    stats = torchtpu.cache_stats()
    cpu = per_op_us(cpu_step, lambda: None)
    bare = per_op_us(jax_step, lambda: box["j"].block_until_ready())
    print(f"{'path':<28}{'us/op':>10}")
    print(f"{'torchtpu eager (tpu)':<28}{tpu:>10.1f}")
    print(f"{'torch eager (cpu)':<28}{cpu:>10.1f}")
    print(f"{'bare jax.jit':<28}{bare:>10.1f}")
    print(f"torchtpu / bare jax: {tpu / bare:.2f}x   torchtpu / torch cpu: {tpu / cpu:.2f}x")
    print(f"executable cache during the timed loop: {stats['misses']} misses, {stats['hits']} hits")

    batch = torch.randn(8, 64)
    host = batch.numpy()

    def to_tpu():
        box["t"] = batch.to("tpu")

    def device_put():
        box["j"] = jax.device_put(host)

    def clone():
        box["c"] = batch.clone()

    tpu = per_op_us(to_tpu, lambda: torchtpu.to_jax(box["t"]).block_until_ready())
    put = per_op_us(device_put, lambda: box["j"].block_until_ready())
    cpu = per_op_us(clone, lambda: None)
    print(f"\n{'(8, 64) float32 batch':<28}{'us/copy':>10}")
    label = "torchtpu batch.to('tpu')"
    print(f"{label:<28}{tpu:>10.1f}")
    print(f"{'jax.device_put(array)':<28}{put:>10.1f}")
    print(f"{'torch batch.clone() (cpu)':<28}{cpu:>10.1f}")
    print(f"torchtpu / jax.device_put: {tpu / put:.2f}x")


if __name__ == "__main__":
    main()
