"""torch.distributed.checkpoint (DCP) on tpu, the way torchtitan's checkpointer uses it: `dcp.save` of
`get_state_dict(model, optimizer)` (parameters, fused AdamW's moments and its step counts, which fused
optimizers keep on the parameters' device) and the learning-rate scheduler, then `dcp.load` into a
fresh model's and optimizer's own tensors (in place) and `set_state_dict`. No process group: DCP runs
in one process without one.

The oracle is the run that never stopped: the resumed steps give its losses, parameters and optimizer
state bitwise, as they do on CPU (checked here too: the harness itself resumes exactly there). A
checkpoint written on tpu reads back on CPU with the same bits, and the other way round.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

import torchtpu  # noqa: F401

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    # PyTorch pins staging memory only with CUDA
    pytest.mark.filterwarnings("ignore:Ignoring pin_memory flag:UserWarning"),
]

VOCAB, DIM, SEQ, BATCH = 32, 16, 8, 4
SAVE_AT, STEPS = 3, 6


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.RMSNorm(DIM)
        self.mid = nn.Linear(DIM, 2 * DIM)
        self.out = nn.Linear(2 * DIM, VOCAB, bias=False)

    def forward(self, ids):
        return self.out(torch.nn.functional.silu(self.mid(self.norm(self.embed(ids)))))


class Run:
    """A model, fused AdamW (weight decay, as torchtitan configures it) and a warmup-then-decay
    schedule on `device`; the weights come from `seed`."""

    def __init__(self, device, seed=0):
        torch.manual_seed(seed)
        self.device = device
        self.model = TinyLM().to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2, weight_decay=0.1, fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 2) / (1 + 0.1 * s))

    def step(self, i) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(self.device)
        logits = self.model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        return loss.detach().cpu()

    def save(self, path):
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict()}, checkpoint_id=path)

    def load(self, path):
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        sd = {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict()}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["sched"])

    def tensors(self) -> dict[str, torch.Tensor]:
        """Parameters and optimizer state (moments and step counts), on CPU."""
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        out = {f"model.{k}": v.detach().cpu() for k, v in model_sd.items()}
        for fqn, state in optim_sd["state"].items():
            out.update({f"optim.{fqn}.{k}": v.detach().cpu() for k, v in state.items()})
        return out


def _bitwise(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), (k, (got[k] - want[k]).abs().max())


def _straight_and_resumed(device, path):
    """Losses and final tensors of a run that saves at SAVE_AT and goes on, and of a fresh run
    (other weights) that loads that checkpoint and takes the remaining steps."""
    a = Run(device)
    losses = []
    for i in range(STEPS):
        if i == SAVE_AT:
            a.save(path)
        losses.append(a.step(i))
    b = Run(device, seed=1)
    b.load(path)
    resumed = [b.step(i) for i in range(SAVE_AT, STEPS)]
    return torch.stack(losses), torch.stack(resumed), a.tensors(), b.tensors()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for device in ("tpu", "cpu"):
        out[device] = _straight_and_resumed(device, str(tmp_path_factory.mktemp(f"dcp_{device}")))
    return out


@pytest.mark.parametrize("device", ["tpu", "cpu"])
def test_resume_gives_the_straight_run_bitwise(runs, device):
    losses, resumed, straight_state, resumed_state = runs[device]
    assert torch.equal(resumed, losses[SAVE_AT:]), (resumed, losses)
    _bitwise(resumed_state, straight_state)


def test_tpu_run_follows_cpu(runs):
    tpu_losses, _, tpu_state, _ = runs["tpu"]
    cpu_losses, _, cpu_state, _ = runs["cpu"]
    torch.testing.assert_close(tpu_losses, cpu_losses, rtol=1e-6, atol=1e-6)
    assert tpu_state.keys() == cpu_state.keys()
    for k in cpu_state:
        torch.testing.assert_close(tpu_state[k], cpu_state[k], rtol=1e-5, atol=1e-6, msg=k)
    # fused optimizers keep their step counts on the parameters' device, as float32
    assert all(v.dtype == torch.float32 and v.dim() == 0 for k, v in tpu_state.items() if k.endswith(".step"))


def test_save_does_not_change_the_run(runs):
    """Saving reads tensors (DCP copies them to the host, non_blocking, through torch.tpu's stream
    API); a run that never saves takes the same steps bitwise."""
    losses, _, state, _ = runs["tpu"]
    a = Run("tpu")
    unsaved = torch.stack([a.step(i) for i in range(STEPS)])
    assert torch.equal(unsaved, losses)
    _bitwise(a.tensors(), state)


@pytest.mark.parametrize(("src", "dst"), [("tpu", "cpu"), ("cpu", "tpu")])
def test_checkpoint_crosses_devices_bitwise(tmp_path, src, dst):
    a = Run(src)
    for i in range(SAVE_AT):
        a.step(i)
    a.save(str(tmp_path))
    b = Run(dst, seed=1)
    b.load(str(tmp_path))
    _bitwise(b.tensors(), a.tensors())
    assert all(t.device.type == dst for t in b.model.parameters())
    assert all(v.device.type == dst for s in b.opt.state.values() for v in s.values())
    # and the next step from the same state agrees across devices
    torch.testing.assert_close(b.step(SAVE_AT), a.step(SAVE_AT), rtol=1e-6, atol=1e-6)


def test_load_writes_the_live_tensors_in_place(tmp_path):
    """torchtitan's checkpointer takes the model's state dict once, when it is built, and loads into
    those tensors after training has replaced the parameters' values many times: the load must
    reach the parameters and the optimizer state themselves, before any set_state_dict."""
    a = Run("tpu")
    for i in range(SAVE_AT):
        a.step(i)
    a.save(str(tmp_path))
    want = a.tensors()

    b = Run("tpu", seed=1)
    cached = get_model_state_dict(b.model)  # taken before training, as torchtitan's ModelWrapper does
    b.step(0)  # creates the optimizer state
    optim_sd = get_optimizer_state_dict(b.model, b.opt)
    for i in range(1, 5):  # replaces every parameter's and moment's values
        b.step(i)
    assert not torch.equal(b.model.mid.weight.detach().cpu(), want["model.mid.weight"])

    sd = {"model": cached, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    for name, p in b.model.named_parameters():
        assert torch.equal(p.detach().cpu(), want[f"model.{name}"]), name
    for p, (fqn, _) in zip(b.model.parameters(), b.model.named_parameters(), strict=True):
        for k, v in b.opt.state[p].items():
            assert torch.equal(v.cpu(), want[f"optim.{fqn}.{k}"]), (fqn, k)


@pytest.mark.parametrize("pinned", [False, True], ids=["async", "async_with_pinned_mem"])
def test_async_save_writes_the_state_of_its_call(tmp_path, pinned):
    """`dcp.async_save` (torchtitan's async_mode "async" and "async_with_pinned_mem") stages host
    copies, then writes them on another thread while training goes on: the steps taken meanwhile,
    which give the parameters and moments new buffers, leave the checkpoint at the state of the
    call. With "async_with_pinned_mem" the staging itself runs on a thread, on a stream of its own,
    in shared memory, and torchtitan waits for it before the next optimizer step."""
    a = Run("tpu")
    for i in range(SAVE_AT):
        a.step(i)
    want = a.tensors()
    model_sd, optim_sd = get_state_dict(a.model, a.opt)
    state = {"model": model_sd, "optim": optim_sd}
    stager = DefaultStager(StagingOptions(True, True, True, True)) if pinned else None
    saved = dcp.async_save(state, checkpoint_id=str(tmp_path), async_stager=stager)
    if pinned:
        saved.staging_completion.result()
        saved = saved.upload_completion
    for i in range(SAVE_AT, STEPS):
        a.step(i)
    saved.result()
    if stager is not None:
        stager.close()
    b = Run("tpu", seed=1)
    b.step(0)
    model_sd, optim_sd = get_state_dict(b.model, b.opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    _bitwise(b.tensors(), want)


@pytest.mark.parametrize("share_memory", [False, True])
def test_stager_gives_host_copies_of_the_values(share_memory):
    """DCP's StateDictStager (what an async save stages with) on tpu tensors: bases, a view and
    bfloat16 become CPU tensors holding their values, in shared memory when it is asked for; a
    CPU tensor beside them takes PyTorch's own path."""
    base = torch.randn(4, 6)
    want = {"base": base, "view": base[1:3, ::2], "bf16": base.to(torch.bfloat16), "step": torch.tensor(3.0)}
    on_tpu = {k: v.to("tpu") for k, v in want.items()}
    on_tpu["view"] = on_tpu["base"][1:3, ::2]
    on_tpu["cpu"] = want["cpu"] = torch.arange(5)
    staged = StateDictStager(share_memory=share_memory).stage(on_tpu)
    for k, w in want.items():
        assert type(staged[k]) is torch.Tensor and staged[k].device.type == "cpu", k
        assert staged[k].dtype == w.dtype and torch.equal(staged[k], w), k
        assert staged[k].is_shared() == share_memory, k
        assert not hasattr(staged[k], "_st"), k  # no copy of the device array rides along


def test_narrowed_load_target_writes_its_base():
    """DCP's load copies each stored chunk into `narrow_tensor_by_index(target, ...).detach()`."""
    base = torch.zeros(6, 5).to("tpu")
    keep = base.detach()  # another handle on the same tensor, as a cached state dict holds
    chunk = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    narrow_tensor_by_index(base, (3, 0), (2, 5)).detach().copy_(chunk)
    cols = torch.arange(12, dtype=torch.float32).reshape(6, 2) + 100
    narrow_tensor_by_index(base, (0, 1), (6, 2)).detach().copy_(cols)
    want = torch.zeros(6, 5)
    want[3:5] = chunk
    want[:, 1:3] = cols
    assert torch.equal(base.cpu(), want)
    assert torch.equal(keep.cpu(), want)


def test_compiled_model_sees_a_load_into_its_parameters(tmp_path):
    """A model under torch.compile(backend="tpu") reads the loaded values on its next call: the
    parameters are program inputs, not constants of the compiled program."""
    a = Run("tpu")
    a.model = torch.compile(a.model, backend="tpu")
    for i in range(2):
        a.step(i)
    a.save(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        after = torch.stack([a.step(i) for i in range(2, 4)])
        a.load(str(tmp_path))  # back to step 2, into the same live tensors
        again = torch.stack([a.step(i) for i in range(2, 4)])
    assert torch.equal(again, after), (again, after)
