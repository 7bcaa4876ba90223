"""Spectral ops and complex64 on tpu, checked against CPU (the OpInfos cover the rest)."""

from functools import partial

import pytest
import torch

import torchtpu  # noqa: F401
from tests.conftest import assert_close_to_cpu

_close = partial(assert_close_to_cpu, rtol=1e-4, atol=1e-4)


def test_complex64_round_trip_and_view_as_real():
    c = torch.randn(3, 4, dtype=torch.complex64)
    t = c.to("tpu")
    assert t.dtype == torch.complex64
    torch.testing.assert_close(t.cpu(), c, atol=0, rtol=0)
    _close(torch.view_as_real(t), torch.view_as_real(c))
    _close(torch.view_as_complex(torch.view_as_real(t)), c)


def test_conjugate_view_conjugates():
    c = torch.randn(5, dtype=torch.complex64)
    _close(torch.ops.aten._conj(c.to("tpu")), c.conj().resolve_conj())
    _close(c.to("tpu").conj(), c.conj().resolve_conj())


@pytest.mark.parametrize("norm", [None, "ortho", "forward"])
def test_fft_family(norm):
    torch.manual_seed(0)
    x = torch.randn(3, 4, 6)
    c = torch.randn(3, 4, 6, dtype=torch.complex64)
    xt, ct = x.to("tpu"), c.to("tpu")
    _close(torch.fft.fftn(ct, s=(3, 8), dim=(0, 2), norm=norm), torch.fft.fftn(c, s=(3, 8), dim=(0, 2), norm=norm))
    _close(torch.fft.ifft(xt, n=3, norm=norm), torch.fft.ifft(x, n=3, norm=norm))
    _close(torch.fft.rfftn(xt, dim=(0, 2), norm=norm), torch.fft.rfftn(x, dim=(0, 2), norm=norm))
    _close(torch.fft.irfft(ct, n=9, dim=1, norm=norm), torch.fft.irfft(c, n=9, dim=1, norm=norm))
    _close(torch.fft.hfft(ct, n=5, dim=0, norm=norm), torch.fft.hfft(c, n=5, dim=0, norm=norm))
    _close(torch.fft.ihfftn(xt, dim=(2, 1), norm=norm), torch.fft.ihfftn(x, dim=(2, 1), norm=norm))


def test_stft_istft_round_trip():
    torch.manual_seed(0)
    x = torch.randn(2, 400)
    w = torch.hann_window(64)
    spec = torch.stft(x, 64, hop_length=16, window=w, return_complex=True)
    spec_t = torch.stft(x.to("tpu"), 64, hop_length=16, window=w.to("tpu"), return_complex=True)
    _close(spec_t, spec)
    _close(
        torch.istft(spec_t, 64, hop_length=16, window=w.to("tpu"), length=400),
        torch.istft(spec, 64, hop_length=16, window=w, length=400),
    )


def test_rfft_gradient():
    torch.manual_seed(0)
    x = torch.randn(8, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    torch.fft.rfft(x).abs().sum().backward()
    torch.fft.rfft(xt).abs().sum().backward()
    _close(xt.grad, x.grad)
