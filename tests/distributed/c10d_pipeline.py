"""Pipelines with torch.distributed.pipelining on tpu training a small transformer, one stage per
rank, against the same training in one process (run from c10d_worker.py): GPipe and 1F1B over 2
stages, GPipe and 1F1B over 4 stages, 4 micro-batches each."""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB, DIM, SEQ, BATCH, MICRO, STEPS = 64, 16, 8, 8, 4, 2


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.block = nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, ids):
        return self.block(self.tok(ids))


class Middle(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, h):
        return self.block(h)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.0, batch_first=True)
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


def models(stages: int):
    torch.manual_seed(0)
    return [Embed()] + [Middle() for _ in range(stages - 2)] + [Head()]


def one_process_losses(stages: int) -> list[list[float]]:
    """Each step's per-micro-batch losses, training the whole model in one process on tpu."""
    parts = [m.to("tpu") for m in models(stages)]
    opt = torch.optim.SGD([p for m in parts for p in m.parameters()], lr=0.1)
    out = []
    for x, y in batches():
        losses = []
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
            h = xm.to("tpu")
            for m in parts:
                h = m(h)
            loss = loss_fn(h, ym.to("tpu")) / MICRO
            loss.backward()
            losses.append(loss.item() * MICRO)
        opt.step()
        opt.zero_grad()
        out.append(losses)
    return out


def _train(rank: int, world: int, schedule_cls) -> list[list[float]]:
    from torch.distributed.pipelining import PipelineStage

    device = torch.device("tpu", 0)
    module = models(world)[rank].to(device)
    stage = PipelineStage(module, rank, world, device)
    schedule = schedule_cls(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    got = []
    for x, y in batches():
        if rank == 0:
            schedule.step(x.to(device))
        elif rank == world - 1:
            losses = []
            schedule.step(target=y.to(device), losses=losses)
            got.append([float(loss.item()) for loss in losses])
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
    return got


def run_pipeline(rank: int, world: int) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    runs = {"GPipe": _train(rank, world, ScheduleGPipe), "1F1B": _train(rank, world, Schedule1F1B)}
    done = []
    if rank == world - 1:
        want = one_process_losses(world)
        for name, got in runs.items():
            print(f"{name} pipeline losses", got, "one process", want, flush=True)
            assert len(got) == STEPS, got
            for a, b in zip(got, want):
                assert len(a) == MICRO and all(abs(p - q) <= 1e-5 * max(1.0, abs(q)) for p, q in zip(a, b)), (
                    name,
                    got,
                    want,
                )
            done.append(f"{name} over {world} stages, {MICRO} micro-batches = one process")
    dist.barrier()
    return done
