"""A compiled training step of a PyTorch TransformerEncoder: torchtpu vs PyTorch's own device.

    python -m bench.encoder_step                      # tpu device on XLA:CPU vs torch CPU
    TORCHTPU_PLATFORM=gpu python3 bench/encoder_step.py --torch-device cuda   # XLA:GPU vs CUDA eager

Needs only torch (no torchtitan), so it runs on machines that lack the project's other pins.
Reports step time and tokens/s for torchtpu (one XLA program per step via torchtpu.compile)
and PyTorch eager on the comparison device, same model, same initial weights, same data.
The PyTorch reference runs in a child process that never imports torchtpu: registering any
PrivateUse1 backend makes it PyTorch's accelerator, after which CUDA backward trips an
autograd-engine assert (pytorch/pytorch#161129).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys

import torch

from bench.common import lm_step, timed


def make_step(model, head, opt):
    return lm_step(torch.nn.Sequential(model, head), opt, 1.0)


def build(a):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        a.dim, a.dim // 64, 4 * a.dim, dropout=0.0, batch_first=True, norm_first=True
    )
    base = torch.nn.TransformerEncoder(layer, a.layers, enable_nested_tensor=False)
    base_head = torch.nn.Linear(a.dim, a.vocab)
    x = torch.randn(a.batch, a.seq, a.dim)
    y = torch.randint(0, a.vocab, (a.batch, a.seq))
    return base, base_head, x, y


def torch_reference(a):
    base, base_head, x, y = build(a)
    dev = torch.device(a.torch_device)
    model, head = base.to(dev), base_head.to(dev)
    opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-3)
    step = make_step(model, head, opt)
    xd, yd = x.to(dev), y.to(dev)
    return timed(lambda: step(xd, yd), lambda l: l.item(), warmup=2, steps=a.steps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch-device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reference-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.reference_only:
        print(json.dumps({"s": torch_reference(a)}))
        return
    child = subprocess.run(
        [sys.executable, "-m", "bench.encoder_step", "--reference-only"] + sys.argv[1:],
        capture_output=True,
        text=True,
        env=os.environ,
    )
    if child.returncode != 0:
        raise SystemExit(f"PyTorch reference failed:\n{child.stderr[-3000:]}")
    reference_s = json.loads(child.stdout.strip().splitlines()[-1])["s"]

    import torchtpu

    base, base_head, x, y = build(a)
    ntok = a.batch * a.seq
    model, head = copy.deepcopy(base).to("tpu"), copy.deepcopy(base_head).to("tpu")
    opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-3, capturable=True)
    step = torchtpu.compile(make_step(model, head, opt))
    xt, yt = x.to("tpu"), y.to("tpu")
    rows = {
        f"torchtpu compiled ({torchtpu.platform()})": timed(
            lambda: step(xt, yt), lambda l: l.item(), warmup=3, steps=a.steps
        ),
        f"PyTorch eager ({a.torch_device})": reference_s,
    }
    nparams = sum(p.numel() for p in base.parameters()) + sum(p.numel() for p in base_head.parameters())
    print(f"TransformerEncoder {a.layers}x{a.dim}, {nparams / 1e6:.1f}M params, {ntok} tokens/step")
    print(f"{'path':<34}{'ms/step':>10}{'tokens/s':>12}")
    for k, t in rows.items():
        print(f"{k:<34}{t * 1e3:>10.2f}{ntok / t:>12.0f}")
    keys = list(rows)
    print(f"torchtpu / PyTorch eager throughput: {rows[keys[1]] / rows[keys[0]]:.2f}x")


if __name__ == "__main__":
    main()
