"""First-step time of a fresh process with a cold and with a warm persistent compilation cache.

    python -m bench.compile_cache

Each measurement is a new Python process that builds a small transformer on tpu and runs the
first two calls of a `torchtpu.compile`d training step (the eager warm-up call and the call
that traces and compiles the whole step), timed from just before the first call. The cold run
uses an empty cache folder; the warm run reuses it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import os, time, json
import torch, torchtpu
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, batch_first=True, dropout=0.0)
model = torch.nn.Sequential(layer).to("tpu")
head = torch.nn.Linear(128, 1000).to("tpu")
params = list(model.parameters()) + list(head.parameters())
opt = torch.optim.AdamW(params, lr=1e-3, capturable=True)
def step(x, y):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(head(model(x)).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    return loss.detach()
cstep = torchtpu.compile(step)
x = torch.randn(8, 64, 128).to("tpu")
y = torch.randint(0, 1000, (8, 64)).to("tpu")
t0 = time.perf_counter()
cstep(x, y).item()
cstep(x, y).item()
first = time.perf_counter() - t0
print(json.dumps({"first_step_s": first, "cache": torchtpu.persistent_cache_stats()}))
"""


def run(cache_dir):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=cache_dir, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    with tempfile.TemporaryDirectory() as d:
        cold = run(d)
        warm = run(d)
    print(f"{'cache':<8}{'first step (s)':>16}{'cache hits':>12}{'misses':>8}")
    for name, r in (("cold", cold), ("warm", warm)):
        print(f"{name:<8}{r['first_step_s']:>16.2f}{r['cache']['hits']:>12}{r['cache']['misses']:>8}")
    print(f"warm start is {cold['first_step_s'] / warm['first_step_s']:.1f}x faster")


if __name__ == "__main__":
    main()
