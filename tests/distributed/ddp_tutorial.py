"""PyTorch's DDP tutorial (tutorials/intermediate_source/ddp_tutorial.rst, the torchrun version:
ToyModel, demo_basic, demo_checkpoint), run by tests/distributed/test_c10d.py under torchrun and
under torchtpu-launch local. The tutorial's code is kept as written; the changes, each marked
"# test:", are a seed, an `import torchtpu`, prints of the losses and weights, the eager mode of
each rank (DDP_TUTORIAL_FUSED_RANKS: the ranks that run fused eager) and a second run of both demos
on CPU with gloo in the same processes (the oracle)."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import torchtpu  # noqa: F401  # test: the tpu device

DEVICE = None  # test: "tpu" (the accelerator) or "cpu" (the oracle)


def accelerator():  # test: the tutorial's torch.accelerator.current_accelerator(), or cpu for the oracle
    return torch.accelerator.current_accelerator() if DEVICE != "cpu" else torch.device("cpu")


def report(what, loss, model):  # test: one short line each (two ranks share torchrun's stdout)
    rank = dist.get_rank()
    flushes = torchtpu.cache_stats()["fused_flushes"]  # test: graphs run in fused eager mode so far
    print(f"{what} {DEVICE} rank {rank} mode {torchtpu.get_eager_mode()} flushes {flushes}", flush=True)
    print(f"{what} {DEVICE} rank {rank} loss {loss.item()!r}", flush=True)
    for i, p in enumerate(model.parameters()):
        print(f"{what} {DEVICE} rank {rank} param {i} {p.detach().cpu().reshape(-1).tolist()!r}", flush=True)


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()  # noqa: UP008  (as the tutorial writes it)
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic():
    acc = accelerator()
    if acc.type != "cpu":  # test: the oracle has no accelerator to pick
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]) % torch.accelerator.device_count())
    backend = torch.distributed.get_default_backend_for_device(acc)
    # test: the oracle's gloo is the tpu group's own gloo group for CPU tensors: a second gloo default
    # group in one torchrun job would find the first one's addresses in the agent's store
    dist.init_process_group("tpu" if acc.type == "cpu" else backend)
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    # create model and move it to GPU with id rank
    device_id = rank % torch.accelerator.device_count() if acc.type != "cpu" else "cpu"
    model = ToyModel().to(device_id)
    ddp_model = DDP(model, device_ids=[device_id] if acc.type != "cpu" else None)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5).to(device_id)
    loss = loss_fn(outputs, labels)  # test: kept to print
    loss.backward()
    optimizer.step()
    report("basic", loss, ddp_model)  # test
    dist.destroy_process_group()
    print(f"Finished running basic DDP example on rank {rank}.")


def demo_checkpoint():
    acc = accelerator()
    backend = torch.distributed.get_default_backend_for_device(acc)
    # test: the oracle's gloo is the tpu group's own gloo group for CPU tensors: a second gloo default
    # group in one torchrun job would find the first one's addresses in the agent's store
    dist.init_process_group("tpu" if acc.type == "cpu" else backend)
    rank = dist.get_rank()
    print(f"Running DDP checkpoint example on rank {rank}.")
    device_id = rank % torch.accelerator.device_count() if acc.type != "cpu" else "cpu"
    model = ToyModel().to(device_id)
    ddp_model = DDP(model, device_ids=[device_id] if acc.type != "cpu" else None)

    CHECKPOINT_PATH = tempfile.gettempdir() + f"/model.{os.environ['MASTER_PORT']}.checkpoint"  # test: per job
    if rank == 0:
        # All processes should see same parameters as they all start from same
        # random parameters and gradients are synchronized in backward passes.
        # Therefore, saving it in one process is sufficient.
        torch.save(ddp_model.state_dict(), CHECKPOINT_PATH)

    # Use a barrier() to make sure that process 1 loads the model after process
    # 0 saves it.
    dist.barrier()
    # configure map_location properly
    map_location = {f"{acc.type}:0": f"{acc.type}:{device_id}"} if acc.type != "cpu" else None
    ddp_model.load_state_dict(torch.load(CHECKPOINT_PATH, map_location=map_location, weights_only=True))

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5).to(device_id)
    loss = loss_fn(outputs, labels)  # test: kept to print
    loss.backward()
    optimizer.step()
    report("checkpoint", loss, ddp_model)  # test

    # Not necessary to use a dist.barrier() to guard the file deletion below
    # as the AllReduce ops in the DDP backward pass are synchronized.
    if rank == 0:
        os.remove(CHECKPOINT_PATH)

    dist.destroy_process_group()


if __name__ == "__main__":
    # test: the ranks named in DDP_TUTORIAL_FUSED_RANKS run the tpu demos in fused eager mode, the others strict
    fused_ranks = os.environ.get("DDP_TUTORIAL_FUSED_RANKS", "").split(",")
    for DEVICE in ("tpu", "cpu"):  # noqa: B007  (read by the demos) # test: the same demos on tpu, then on CPU with gloo
        torch.manual_seed(int(os.environ["RANK"]))  # test: the same random numbers in both runs
        torchtpu.set_eager_mode("fused" if DEVICE == "tpu" and os.environ["RANK"] in fused_ranks else "strict")  # test
        demo_basic()
        demo_checkpoint()
    sys.stdout.flush()
