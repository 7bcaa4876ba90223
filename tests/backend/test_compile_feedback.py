"""Compiled steps whose outputs come back as inputs: truncated backpropagation through time as
PyTorch's word-language-model example trains it (the hidden state returned, detached and fed to
the next call), the same tensor passed twice, a parameter passed as an argument.
"""

import pytest
import torch
from torch import nn

import torchtpu

NTOKEN, NINP, BATCH, BPTT, CLIP, LR = 20, 8, 2, 3, 0.25, 20.0


class RNNModel(nn.Module):
    """The example's LSTM language model: encoder, LSTM, decoder tied to the encoder."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Embedding(NTOKEN, NINP)
        self.rnn = nn.LSTM(NINP, NINP, 1)
        self.decoder = nn.Linear(NINP, NTOKEN)
        self.decoder.weight = self.encoder.weight

    def forward(self, data, hidden):
        output, hidden = self.rnn(self.encoder(data), hidden)
        return self.decoder(output).view(-1, NTOKEN), hidden

    def init_hidden(self, device):
        return tuple(torch.zeros(1, BATCH, NINP, device=device) for _ in range(2))


def _train(device, compiled):
    model = RNNModel().to(device)
    torch.manual_seed(1)
    source = torch.randint(0, NTOKEN, (6 * BPTT + 1, BATCH))

    def step(data, targets, hidden):
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = nn.functional.cross_entropy(output, targets)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-LR)
        return loss.detach(), hidden

    if compiled:
        step = torchtpu.compile(step)
    hidden, losses = model.init_hidden(device), []
    for i in range(0, 6 * BPTT, BPTT):
        data, targets = source[i : i + BPTT].to(device), source[i + 1 : i + 1 + BPTT].reshape(-1).to(device)
        hidden = tuple(h.detach() for h in hidden)  # the example's repackage_hidden
        loss, hidden = step(data, targets, hidden)
        losses.append(loss.item())
    return losses, [h.cpu() for h in hidden], [p.detach().cpu() for p in model.parameters()]


def test_word_language_model_loop_compiled_equals_cpu():
    retraces = torchtpu.cache_stats()["compiled_step_retraces"]
    want, got = _train("cpu", False), _train("tpu", True)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-4, atol=1e-5)
    for g, w in zip(got[1] + got[2], want[1] + want[2]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert len(set(want[0])) == 6
    assert torchtpu.cache_stats()["compiled_step_retraces"] == retraces  # one program for the loop


def test_same_tensor_twice_and_parameter_arguments():
    lin = nn.Linear(4, 4).to("tpu")
    step = torchtpu.compile(lambda a, b: torch.tanh(lin(a) + b))
    h = torch.ones(2, 4, device="tpu")
    for _ in range(3):
        h = step(h, h)
    ref = torch.ones(2, 4)
    lin_cpu = nn.Linear(4, 4)
    lin_cpu.load_state_dict({k: v.cpu() for k, v in lin.state_dict().items()})
    for _ in range(3):
        ref = torch.tanh(lin_cpu(ref) + ref)
    torch.testing.assert_close(h.cpu(), ref)

    # a parameter passed after the first call (which recorded it as state): read, it works; updated
    # in place by the step as well, it is a clear error
    reads = torchtpu.compile(lambda w: lin(w).sum())
    for w, w_cpu in ((h, ref), (lin.weight, lin_cpu.weight), (lin.weight, lin_cpu.weight)):
        torch.testing.assert_close(reads(w).cpu(), lin_cpu(w_cpu).sum(), rtol=1e-5, atol=1e-5)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def train(w):
        opt.zero_grad()
        lin(w).sum().backward()
        opt.step()

    step = torchtpu.compile(train)
    step(torch.ones(2, 4, device="tpu"))
    with pytest.raises(RuntimeError, match=r"argument 0 of the step \(a \(4, 4\) torch.float32 tensor\).*clone"):
        step(lin.weight)
