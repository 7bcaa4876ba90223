"""A 2-stage pipeline with torch.distributed.pipelining on tpu (GPipe, 4 micro-batches) training a
small transformer, against the same training in one process (run from c10d_worker.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB, DIM, SEQ, BATCH, MICRO, STEPS = 64, 32, 8, 8, 4, 2


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.block = nn.TransformerEncoderLayer(DIM, 4, 64, dropout=0.0, batch_first=True)

    def forward(self, ids):
        return self.block(self.tok(ids))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(DIM, 4, 64, dropout=0.0, batch_first=True)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, h):
        return self.out(self.block(h))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def batches():
    g = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        yield ids[:, :-1], ids[:, 1:]


def models():
    torch.manual_seed(0)
    return Embed(), Head()


def one_process_losses() -> list[list[float]]:
    """Each step's per-micro-batch losses, training the whole model in one process on tpu."""
    stages = [m.to("tpu") for m in models()]
    opt = torch.optim.SGD([p for m in stages for p in m.parameters()], lr=0.1)
    out = []
    for x, y in batches():
        losses = []
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
            loss = loss_fn(stages[1](stages[0](xm.to("tpu"))), ym.to("tpu")) / MICRO
            loss.backward()
            losses.append(loss.item() * MICRO)
        opt.step()
        opt.zero_grad()
        out.append(losses)
    return out


def run_pipeline(rank: int, world: int) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    device = torch.device("tpu", 0)
    module = models()[rank].to(device)
    stage = PipelineStage(module, rank, world, device)
    schedule = ScheduleGPipe(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    got = []
    for x, y in batches():
        if rank == 0:
            schedule.step(x.to(device))
        else:
            losses = []
            schedule.step(target=y.to(device), losses=losses)
            got.append([float(loss.item()) for loss in losses])
        opt.step()
        opt.zero_grad()
    done = []
    if rank == world - 1:
        want = one_process_losses()
        print("pipeline losses", got, "one process", want, flush=True)
        for a, b in zip(got, want):
            assert len(a) == MICRO and all(abs(p - q) <= 1e-5 * max(1.0, abs(q)) for p, q in zip(a, b)), (got, want)
        assert len(got) == STEPS
        done.append("GPipe over 2 stages, 4 micro-batches = one process")
    dist.barrier()
    return done
