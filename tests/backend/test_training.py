"""Training on the tpu device matches the identical run on CPU (fp32).

Small models train a few optimizer steps on both devices from the same initial weights and
the same batches; loss trajectories and final parameters must agree.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchtpu  # noqa: F401
from tests.conftest import assert_close_to_cpu

DEV = "tpu"


close = partial(assert_close_to_cpu, rtol=1e-4, atol=1e-5)


def assert_trajectories_match(tpu_losses, cpu_losses, rtol=1e-4):
    assert len(tpu_losses) == len(cpu_losses)
    for i, (a, b) in enumerate(zip(tpu_losses, cpu_losses)):
        assert abs(a - b) <= rtol * abs(b) + 1e-6, (
            f"step {i}: tpu loss {a!r} vs CPU loss {b!r}\n tpu: {tpu_losses}\n cpu: {cpu_losses}"
        )


# ----------------------------------------------------------------------------- models


class SmallCNN(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        # No conv biases: a bias right before BatchNorm has an exactly-zero gradient in exact
        # arithmetic, so Adam would amplify each device's rounding noise into its updates.
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, stride=2, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 2 * 2, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)  # 8x8 -> 4x4
        x = F.relu(self.bn2(self.conv2(x)))  # -> 2x2
        x = F.adaptive_avg_pool2d(x, 2)
        return self.fc(x.flatten(1))


class SmallTransformer(nn.Module):
    def __init__(self, vocab=32, dim=16, heads=4, ff=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(8, dim) * 0.02)
        self.layer = nn.TransformerEncoderLayer(dim, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        s = tokens.shape[1]
        h = self.emb(tokens) + self.pos[:s]
        mask = nn.Transformer.generate_square_subsequent_mask(s, device=tokens.device)
        h = self.layer(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def _train(model, batches, loss_fn, device, steps, opt_factory, clip=None):
    model = model.to(device)
    opt = opt_factory(model.parameters())
    losses = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(float(loss.detach().cpu()))
    return model, losses


def _adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def test_cnn_trains_like_cpu():
    torch.manual_seed(0)
    model = SmallCNN()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(4)]
    tpu_model, tpu_losses = _train(copy.deepcopy(model), batches, F.cross_entropy, DEV, 20, _adamw)
    cpu_model, cpu_losses = _train(model, batches, F.cross_entropy, "cpu", 20, _adamw)
    assert_trajectories_match(tpu_losses, cpu_losses)
    assert cpu_losses[-1] < cpu_losses[0]
    for (n, pc), (_, pt) in zip(cpu_model.named_parameters(), tpu_model.named_parameters()):
        close(pt, pc, f"param {n}", rtol=1e-3, atol=1e-4)
    for (n, bc), (_, bt) in zip(cpu_model.named_buffers(), tpu_model.named_buffers()):
        close(bt, bc, f"buffer {n}", rtol=1e-3, atol=1e-4)


def test_transformer_trains_like_cpu():
    torch.manual_seed(0)
    model = SmallTransformer()
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        t = torch.randint(0, 32, (4, 9), generator=g)
        batches.append((t[:, :-1], t[:, 1:]))

    def lm_loss(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    tpu_model, tpu_losses = _train(copy.deepcopy(model), batches, lm_loss, DEV, 20, _adamw, clip=1.0)
    cpu_model, cpu_losses = _train(model, batches, lm_loss, "cpu", 20, _adamw, clip=1.0)
    assert_trajectories_match(tpu_losses, cpu_losses)
    assert cpu_losses[-1] < cpu_losses[0]
    dim = model.emb.embedding_dim
    for (n, pc), (_, pt) in zip(cpu_model.named_parameters(), tpu_model.named_parameters()):
        if n.endswith("in_proj_bias"):
            # The key bias cancels in softmax: its gradient is rounding noise that Adam
            # normalises into full-size steps, differently on each device. Compare q and v.
            pc = torch.cat([pc[:dim], pc[2 * dim :]])
            pt = torch.cat([pt[:dim], pt[2 * dim :]])
        close(pt, pc, f"param {n}", rtol=1e-3, atol=1e-4)


# ----------------------------------------------------------------------------- optimizers

_OPTIMIZERS = {
    "sgd": lambda p, fe: torch.optim.SGD(p, lr=0.1, foreach=fe),
    "sgd_momentum": lambda p, fe: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=fe),
    "sgd_nesterov": lambda p, fe: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, dampening=0, foreach=fe),
    "adam": lambda p, fe: torch.optim.Adam(p, lr=0.01, foreach=fe),
    "adam_amsgrad_wd": lambda p, fe: torch.optim.Adam(p, lr=0.01, amsgrad=True, weight_decay=0.1, foreach=fe),
    "adamw": lambda p, fe: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, foreach=fe),
}


def _mlp():
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_optimizer_matches_cpu(name, foreach):
    torch.manual_seed(0)
    model = _mlp()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(5)]
    make = _OPTIMIZERS[name]
    tpu_model, tpu_losses = _train(copy.deepcopy(model), batches, F.mse_loss, DEV, 5, lambda p: make(p, foreach))
    cpu_model, cpu_losses = _train(model, batches, F.mse_loss, "cpu", 5, lambda p: make(p, foreach))
    assert_trajectories_match(tpu_losses, cpu_losses, rtol=1e-5)
    for (n, pc), (_, pt) in zip(cpu_model.named_parameters(), tpu_model.named_parameters()):
        close(pt, pc, f"param {n}", rtol=1e-5, atol=1e-6)


def test_optimizer_state_lives_on_tpu():
    torch.manual_seed(0)
    model = _mlp().to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    model(torch.randn(2, 6).to(DEV)).sum().backward()
    opt.step()
    for state in opt.state.values():
        assert state["exp_avg"].device.type == DEV
        assert state["exp_avg_sq"].device.type == DEV


def test_lr_scheduler():
    torch.manual_seed(0)
    model = _mlp()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(3)]
    results = []
    for dev, m in ((DEV, copy.deepcopy(model)), ("cpu", model)):
        m = m.to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=6)
        for i in range(6):
            x, y = batches[i % 3]
            opt.zero_grad()
            F.mse_loss(m(x.to(dev)), y.to(dev)).backward()
            opt.step()
            sched.step()
        results.append(m)
    for (n, pt), (_, pc) in zip(results[0].named_parameters(), results[1].named_parameters()):
        close(pt, pc, f"param {n}", rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- gradient clipping


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.1, 100.0])
def test_clip_grad_norm(norm_type, max_norm, foreach):
    torch.manual_seed(0)
    model = _mlp()
    tpu_model = copy.deepcopy(model).to(DEV)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    F.mse_loss(model(x), y).backward()
    F.mse_loss(tpu_model(x.to(DEV)), y.to(DEV)).backward()
    nc = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    nt = torch.nn.utils.clip_grad_norm_(tpu_model.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    close(nt, nc, "total norm", rtol=1e-5, atol=1e-6)
    for (n, pc), (_, pt) in zip(model.named_parameters(), tpu_model.named_parameters()):
        close(pt.grad, pc.grad, f"clipped grad {n}", rtol=1e-5, atol=1e-6)


def test_clip_grad_value():
    torch.manual_seed(0)
    model = _mlp()
    tpu_model = copy.deepcopy(model).to(DEV)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    F.mse_loss(model(x), y).backward()
    F.mse_loss(tpu_model(x.to(DEV)), y.to(DEV)).backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
    torch.nn.utils.clip_grad_value_(tpu_model.parameters(), 0.05)
    for (n, pc), (_, pt) in zip(model.named_parameters(), tpu_model.named_parameters()):
        close(pt.grad, pc.grad, f"clipped grad {n}", rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- state dicts


def test_state_dict_roundtrip_through_cpu():
    torch.manual_seed(0)
    model = SmallCNN()
    tpu_model = copy.deepcopy(model).to(DEV)
    sd = {k: v.cpu() for k, v in tpu_model.state_dict().items()}
    for k, v in model.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0)
    fresh = SmallCNN().to(DEV)
    fresh.load_state_dict(model.state_dict())
    for (n, a), (_, b) in zip(fresh.state_dict().items(), model.state_dict().items()):
        close(a, b, f"loaded {n}", rtol=0, atol=0)
