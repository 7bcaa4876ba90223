"""A real multi-host job on one machine: 2 processes x 4 XLA CPU devices joined by
jax.distributed over loopback (gloo collectives), against the same training on one device."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401

from ..processes import free_port, run_together

WORKER = Path(__file__).with_name("multihost_worker.py")


def _one_device_losses():
    from torchtitan.models.llama3 import Transformer, llama3_args

    torch.manual_seed(0)
    m = Transformer(llama3_args["debugmodel"])
    with torch.no_grad():
        m.init_weights()
    m = m.to("tpu")
    opt = torch.optim.AdamW(m.parameters(), lr=8e-4, capturable=True, foreach=True)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        b = torch.randint(0, 2048, (8, 33), generator=g).to("tpu")
        loss = F.cross_entropy(m(b[:, :-1]).flatten(0, 1).float(), b[:, 1:].flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_two_processes_fsdp_matches_one_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    port = free_port()
    outs = run_together([[sys.executable, str(WORKER), str(port), str(i), "2"] for i in range(2)], env)
    losses = []
    for out in outs:
        m = re.search(r"^losses (\[.*\])$", out, re.M)
        assert m, out[-3000:]
        losses.append(eval(m.group(1)))
    assert losses[0] == losses[1]  # every process sees the same global loss
    np.testing.assert_allclose(losses[0], _one_device_losses(), rtol=1e-5)
