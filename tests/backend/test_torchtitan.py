"""torchtitan's Llama 3 `debugmodel`, imported unmodified, runs on tpu exactly like on CPU."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import torchtpu  # noqa: F401
from tests.conftest import assert_close_to_cpu

DEV = "tpu"

llama3 = pytest.importorskip("torchtitan.models.llama3")

BATCH, SEQ = 2, 32


def _debugmodel_args(**overrides):
    args = copy.deepcopy(llama3.llama3_args["debugmodel"])
    if not overrides:
        return args  # the flavor exactly as torchtitan ships it
    # The RoPE table is precomputed for max_seq_len positions; 131072 only costs time here.
    return dataclasses.replace(args, **{"max_seq_len": 64, **overrides})


def _build(args):
    from torchtitan.models.llama3.model.model import Transformer

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def _tokens(vocab):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)


def _run(model, tokens, device):
    from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_loss

    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, -5:] = IGNORE_INDEX  # padding, as torchtitan's dataloader marks it
    n_tokens = int((labels != IGNORE_INDEX).sum())
    logits = model(inputs.to(device))
    # torchtitan's own loss: sum-reduced cross entropy, normalised by the token count
    loss = cross_entropy_loss(logits, labels.to(device)) / n_tokens
    loss.backward()
    return logits, loss


_close = assert_close_to_cpu


def _relative_error(actual, expected):
    a, e = actual.detach().cpu().double(), expected.detach().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


@pytest.mark.parametrize("n_kv_heads", [None, 4], ids=["mha", "gqa"])
def test_llama3_debugmodel_matches_cpu(n_kv_heads):
    args = _debugmodel_args(n_kv_heads=n_kv_heads) if n_kv_heads else _debugmodel_args()
    cpu_model = _build(args)
    tpu_model = copy.deepcopy(cpu_model).to(DEV)
    assert tpu_model.freqs_cis.device.type == DEV and tpu_model.freqs_cis.dtype == torch.complex64
    for name, p in tpu_model.named_parameters():
        assert p.device.type == DEV, name

    tokens = _tokens(args.vocab_size)
    cpu_logits, cpu_loss = _run(cpu_model, tokens, "cpu")
    tpu_logits, tpu_loss = _run(tpu_model, tokens, DEV)

    assert tpu_logits.shape == (BATCH, SEQ, args.vocab_size)
    _close(tpu_logits, cpu_logits, "logits", rtol=1e-4, atol=1e-4)
    _close(tpu_loss, cpu_loss, "loss", rtol=1e-5, atol=1e-5)

    cpu_params = dict(cpu_model.named_parameters())
    n = 0
    for name, p in tpu_model.named_parameters():
        ref = cpu_params[name].grad
        assert ref is not None, name
        assert p.grad is not None, f"no gradient for {name} on tpu"
        assert p.grad.device.type == DEV
        rel = _relative_error(p.grad, ref)
        assert rel < 1e-4, f"gradient of {name}: relative error {rel:.2e}"
        _close(p.grad, ref, f"grad {name}", rtol=1e-3, atol=1e-5)
        n += 1
    assert n == len(cpu_params)


def test_llama3_debugmodel_training_steps():
    """A few AdamW steps with torchtitan's model: losses follow the CPU run."""
    args = _debugmodel_args(n_layers=2)
    cpu_model = _build(args)
    tpu_model = copy.deepcopy(cpu_model).to(DEV)
    tokens = _tokens(args.vocab_size)
    losses = {}
    for dev, model in (("cpu", cpu_model), (DEV, tpu_model)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
        losses[dev] = []
        for _ in range(3):
            opt.zero_grad()
            _, loss = _run(model, tokens, dev)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses[dev].append(float(loss.detach().cpu()))
    for i, (a, b) in enumerate(zip(losses[DEV], losses["cpu"])):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {i}: {losses[DEV]} vs {losses['cpu']}"
