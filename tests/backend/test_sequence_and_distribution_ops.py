"""Ops that user code reaches through PyTorch's own modules: torch.distributions' argument
validation (`_is_all_true`), `bincount`, `pack_padded_sequence` through a bidirectional LSTM
(its `batch_sizes` stay on the CPU, as on CUDA), and integer division of operands of different
ranks. Each against PyTorch on CPU."""

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import torchtpu  # noqa: F401  (registers the tpu device)


def _both(fn):
    """fn(device) on CPU and on tpu, the tpu results moved to the CPU."""
    cpu, tpu = fn("cpu"), fn("tpu")
    return cpu, [t.cpu() if isinstance(t, torch.Tensor) else t for t in tpu]


def test_distributions_with_default_argument_validation(monkeypatch):
    # PyTorch's default (validation on); PyTorch's own test utilities, imported by other tests, turn it off
    monkeypatch.setattr(torch.distributions.Distribution, "_validate_args", True)
    torch.manual_seed(0)
    loc, scale, logits = torch.randn(3), torch.rand(3) + 0.5, torch.randn(2, 5)
    a = torch.randn(3, 3)
    cov = a @ a.T + torch.eye(3)
    value, index = torch.randn(3), torch.tensor([4, 1])

    def run(device):
        normal = torch.distributions.Normal(loc.to(device), scale.to(device))
        categorical = torch.distributions.Categorical(logits=logits.to(device))
        mvn = torch.distributions.MultivariateNormal(loc.to(device), covariance_matrix=cov.to(device))
        return [
            normal.log_prob(value.to(device)),
            normal.entropy(),
            categorical.log_prob(index.to(device)),
            categorical.entropy(),
            mvn.log_prob(value.to(device)),
            mvn.entropy(),
        ]

    cpu, tpu = _both(run)
    for c, t in zip(cpu, tpu):
        torch.testing.assert_close(t, c, rtol=1e-5, atol=1e-5)
    # validation still rejects what CPU rejects
    try:
        torch.distributions.Normal(torch.zeros(2, device="tpu"), -torch.ones(2, device="tpu"))
    except ValueError as e:
        assert "scale" in str(e)
    else:
        raise AssertionError("a negative scale was accepted")


def test_bincount():
    x, w = torch.tensor([0, 3, 3, 1, 7]), torch.tensor([0.5, 1.0, 2.0, -1.0, 3.0])
    cpu, tpu = _both(
        lambda d: [
            torch.bincount(x.to(d)),
            torch.bincount(x.to(d), minlength=12),
            torch.bincount(x.to(d), weights=w.to(d)),
            torch.bincount(x.to(d), weights=w.double().to(d)),
            torch.bincount(x[:0].to(d)),
        ]
    )
    for c, t in zip(cpu, tpu):
        assert t.dtype == c.dtype
        torch.testing.assert_close(t, c)


def test_pack_padded_sequence_through_bidirectional_lstm():
    torch.manual_seed(0)
    lstm = nn.LSTM(2, 3, bidirectional=True, batch_first=True)
    x, lengths = torch.randn(3, 3, 2), torch.tensor([1, 3, 2])

    def run(device):
        model = nn.LSTM(2, 3, bidirectional=True, batch_first=True)
        model.load_state_dict(lstm.state_dict())
        model.to(device)
        inp = x.clone().to(device).requires_grad_()
        packed = pack_padded_sequence(inp, lengths, batch_first=True, enforce_sorted=False)
        out, (h, _) = model(packed)
        padded, out_lengths = pad_packed_sequence(out, batch_first=True)
        (padded.square().sum() + h.sum()).backward()
        assert packed.batch_sizes.device.type == "cpu"
        return [padded.detach(), h.detach(), inp.grad, out_lengths, packed.batch_sizes, model.weight_hh_l0.grad]

    cpu, tpu = _both(run)
    for c, t in zip(cpu, tpu):
        torch.testing.assert_close(t, c, rtol=1e-5, atol=1e-5)


def test_integer_division_and_remainder_broadcast():
    """Integer floor/trunc division and remainder of operands of different ranks (the bytes of
    packed int32 words, as a quantized checkpoint's loader unpacks them), negative values included."""
    words = torch.tensor([[-1, 0x7F00FF01, -2147483648], [123456789, -98765, 256]], dtype=torch.int32)
    places = torch.tensor([1, 1 << 8, 1 << 16, 1 << 24], dtype=torch.int32)

    def fn(device):
        w, p = words.to(device), places.to(device)
        return [
            torch.remainder(torch.div(w.unsqueeze(-1), p, rounding_mode="floor"), 256),
            torch.div(w.unsqueeze(-1), p, rounding_mode="trunc"),
        ]

    cpu, tpu = _both(fn)
    for want, got in zip(cpu, tpu):
        assert torch.equal(got, want)
