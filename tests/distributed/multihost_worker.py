"""One process of a real multi-process job (run by tests/distributed/test_multihost.py): joins the job through
jax.distributed over loopback, shards torchtitan's Llama 3 debugmodel (its arguments with the
fields of the JSON argument replaced: the test's narrow, shallow model) with FSDP over every device
of every process and prints the losses of 3 compiled training steps."""

import dataclasses
import json
import sys

port, pid, n, overrides = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
import torch

import torchtpu

torchtpu.distributed.initialize(f"127.0.0.1:{port}", n, pid)
import jax
import torch.nn.functional as F
from torchtitan.models.llama3 import Transformer, llama3_args

from torchtpu.distributed import distribute_tensor, init_device_mesh
from torchtpu.models.llama3 import parallelize_llama
from torchtpu.models.llama3.parallelize import batch_placements

assert jax.process_count() == n and jax.device_count() == 8, (jax.process_count(), jax.device_count())
mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp_shard",))
torch.manual_seed(0)
m = Transformer(dataclasses.replace(llama3_args["debugmodel"], **overrides))
with torch.no_grad():
    m.init_weights()
parallelize_llama(m, mesh)  # CPU params -> sharded tpu params straight from host memory
opt = torch.optim.AdamW(m.parameters(), lr=8e-4, capturable=True, foreach=True)


def step(inp, lab):
    loss = F.cross_entropy(m(inp).flatten(0, 1).float(), lab.flatten(0, 1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss.detach()


cs = torchtpu.compile(step)
g = torch.Generator().manual_seed(1)
out = []
for _ in range(3):
    b = torch.randint(0, 2048, (8, 33), generator=g)
    out.append(
        cs(
            distribute_tensor(b[:, :-1], mesh, batch_placements(mesh)),
            distribute_tensor(b[:, 1:], mesh, batch_placements(mesh)),
        )
    )
print("losses", [float(x.item()) for x in out], flush=True)
