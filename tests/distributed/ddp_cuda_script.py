"""A DDP training script as people write it for CUDA GPUs under torchrun, with `cuda` changed to `tpu`
and nothing else: the process's device from LOCAL_RANK (`tpu:{LOCAL_RANK}`), `torch.tpu.set_device`,
the backend named for the device, a DistributedSampler and a DataLoader, `DDP(model,
device_ids=[local_rank])`, `torch.tpu.synchronize()`, a checkpoint saved by rank 0 and loaded with a
`map_location`. Run by tests/distributed/test_c10d.py under torchrun with 2 and 4 processes.

Lines marked "# test:" are the test's: a seed, prints of the losses and weights, and a second run of the
same training on the CPU with gloo in the same processes (the oracle)."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

ON_CPU = False  # test: True for the oracle run (CPU tensors, gloo)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    if ON_CPU:  # test: the oracle
        device = torch.device("cpu")
        dist.init_process_group("tpu")  # test: its gloo group serves CPU tensors (one default group per job)
    else:
        device = torch.device(f"tpu:{local_rank}")
        torch.tpu.set_device(device)
        dist.init_process_group(backend="tpu")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # every rank builds the same model (DDP also broadcasts rank 0's)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)

    model = Net().to(device)
    ddp = DDP(model, device_ids=None if ON_CPU else [local_rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.MSELoss()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
        if not ON_CPU:
            torch.tpu.synchronize()
        label = "cpu" if ON_CPU else "tpu"  # test
        print(f"epoch {epoch} {label} rank {rank} loss {loss.item()!r}", flush=True)  # test

    path = os.path.join(tempfile.gettempdir(), f"ddp_cuda_script.{os.environ['MASTER_PORT']}.pt")  # test: per job
    if rank == 0:
        torch.save(ddp.module.state_dict(), path)
    dist.barrier()
    map_location = "cpu" if ON_CPU else {"tpu:0": f"tpu:{local_rank}"}
    state = torch.load(path, map_location=map_location, weights_only=True)
    model.load_state_dict(state)
    flat = torch.cat([p.detach().cpu().reshape(-1) for p in model.parameters()])  # test
    print(f"weights {label} rank {rank} {flat.tolist()!r}", flush=True)  # test
    dist.barrier()
    if rank == 0:
        os.remove(path)
    dist.destroy_process_group()


if __name__ == "__main__":
    for ON_CPU in (False, True):  # noqa: B007  (read by main) # test: on tpu, then the oracle
        main()
    sys.stdout.flush()
