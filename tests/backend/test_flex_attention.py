"""`torch.nn.attention.flex_attention` and `create_block_mask` on tpu (torchtpu/backend/flex_attention.py).

The oracles are PyTorch on CPU: `flex_attention` itself for forward values (on CPU PyTorch runs
it without gradients), and for gradients a plain masked softmax written with PyTorch ops, whose
score_mod and mask_mod are evaluated by broadcasting over (batch, head, query, key) index grids
(the code under test vectorises them with jax.vmap instead). The mask patterns are the ones
torchtitan builds (torchtitan.models.attention): causal, sliding window, documents split at EOS
tokens; the sinks are gpt-oss's (`return_lse=True`, then the output scaled by
sigmoid(lse - sink)).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
from torch.nn.attention import flex_attention as flex_api
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask, flex_attention
from torchtitan.models.attention import (
    FlexAttentionWrapper,
    get_causal_mask_mod,
    get_document_mask_mod,
    get_sliding_window_mask_mod,
)

import torchtpu
from tests.conftest import assert_close_to_cpu
from tests.processes import cpu_flags
from torchtpu.backend.ops import flex_attention as flex_ops

close = partial(assert_close_to_cpu, rtol=1e-4, atol=2e-5)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

B, H, HKV, S, D = 2, 4, 2, 128, 16
EOS = 0


def _tokens(seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 6, (B, S), generator=g)  # EOS every ~6 tokens: several documents per row


def _qkv(heads=H, kv_heads=HKV, seq=S, dim=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, seq, dim, generator=g)
    k = torch.randn(B, kv_heads, seq, dim, generator=g)
    v = torch.randn(B, kv_heads, seq, dim, generator=g)
    return q, k, v


def _grid(q, k):
    b = torch.arange(q.shape[0]).view(-1, 1, 1, 1)
    h = torch.arange(q.shape[1]).view(1, -1, 1, 1)
    m = torch.arange(q.shape[2]).view(1, 1, -1, 1)
    n = torch.arange(k.shape[2]).view(1, 1, 1, -1)
    return b, h, m, n


def reference(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """Masked-softmax attention in PyTorch (CPU, autograd): (out, natural-log lse)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale
    b, h, m, n = _grid(q, k)
    if score_mod is not None:
        s = score_mod(s, b, h, m, n)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, m, n).expand(s.shape), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row with no key: zeros, as flex_attention gives
    return p @ v, lse


def _sinks_out(out, lse, sinks):
    """gpt-oss's attention sinks (torchtitan.models.gpt_oss.model.model.Attention.forward)."""
    return out * torch.sigmoid(lse - sinks.view(1, -1, 1)).unsqueeze(-1).to(out.dtype)


def _softcap(score, b, h, q_idx, kv_idx):
    return 4.0 * torch.tanh(score / 4.0)


def _patterns(tokens):
    return {
        "causal": get_causal_mask_mod(),
        "sliding_window": get_sliding_window_mask_mod(24),
        "document": get_document_mask_mod(tokens, EOS),
    }


def _grads(out, extra, inputs):
    loss = (out * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum() + extra
    return torch.autograd.grad(loss, inputs)


# ----------------------------------------------------------------------------- eager


@pytest.mark.parametrize("pattern", list(_patterns(_tokens())))
def test_eager_patterns_match_cpu(pattern):
    tokens = _tokens()
    mask_cpu = _patterns(tokens)[pattern]
    mask_tpu = _patterns(tokens.to("tpu"))[pattern]
    q, k, v = _qkv()

    block_cpu = create_block_mask(mask_cpu, B, None, S, S, device="cpu")
    expected = flex_attention(q, k, v, block_mask=block_cpu, enable_gqa=True)

    inputs = [x.to("tpu").requires_grad_() for x in (q, k, v)]
    block = create_block_mask(mask_tpu, B, None, S, S, device="tpu")
    assert block.kv_num_blocks.device.type == "tpu"
    assert torch.equal(block.to_dense().cpu(), block_cpu.to_dense())
    out, lse = flex_attention(*inputs, block_mask=block, enable_gqa=True, return_lse=True)
    close(out, expected, "forward against PyTorch's flex_attention on CPU")

    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference(*ref_inputs, None, mask_cpu)
    close(lse, ref_lse.detach(), "lse")
    for got, want, name in zip(_grads(out, 0, inputs), _grads(ref_out, 0, ref_inputs), "qkv"):
        close(got, want, f"d{name}")


def test_bfloat16_matches_cpu():
    """bfloat16 inputs: float32 scores and softmax, probabilities rounded to bfloat16 before the
    product with v, as PyTorch's CPU flex_attention computes them."""
    q, k, v = (x.bfloat16() for x in _qkv(seq=64))
    mask = get_causal_mask_mod()
    expected = flex_attention(
        q, k, v, block_mask=create_block_mask(mask, None, None, 64, 64, device="cpu"), enable_gqa=True
    )
    block = create_block_mask(mask, None, None, 64, 64, device="tpu")
    out = flex_attention(*(x.to("tpu") for x in (q, k, v)), block_mask=block, enable_gqa=True)
    assert out.dtype == torch.bfloat16
    close(out, expected, "bfloat16 forward", rtol=1e-2, atol=1e-2)


def test_gpt_oss_sinks_eager_match_cpu():
    """torchtitan's gpt-oss attention: return_lse, then sigmoid(lse - sink) scaling; the lse's
    gradient reaches q and k through the backward operator."""
    tokens = _tokens()
    mask_cpu = and_masks(get_document_mask_mod(tokens, EOS), get_sliding_window_mask_mod(16))
    mask_tpu = and_masks(get_document_mask_mod(tokens.to("tpu"), EOS), get_sliding_window_mask_mod(16))
    q, k, v = _qkv()
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(5))

    inputs = [x.to("tpu").requires_grad_() for x in (q, k, v, sinks)]
    block = create_block_mask(mask_tpu, B, None, S, S, device="tpu")
    out, lse = flex_attention(*inputs[:3], block_mask=block, scale=0.3, enable_gqa=True, return_lse=True)
    out = _sinks_out(out, lse, inputs[3])

    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    ref_out, ref_lse = reference(*ref_inputs[:3], None, mask_cpu, scale=0.3)
    ref_out = _sinks_out(ref_out, ref_lse, ref_inputs[3])
    close(out, ref_out.detach(), "out")
    for got, want, name in zip(_grads(out, 0, inputs), _grads(ref_out, 0, ref_inputs), ("q", "k", "v", "sinks")):
        close(got, want, f"d{name}")


def test_captured_tensors_are_read_each_call_and_get_gradients():
    """A score_mod's captured tensor is an input of its program (Dynamo lifts it), not a constant:
    a new document split and a new bias give new values, and the bias gets its gradient."""
    q, k, v = _qkv(heads=2, kv_heads=2, seq=64)
    for seed in (3, 4):
        tokens = _tokens(seed)[:, :64]
        bias = torch.randn(2, 64, generator=torch.Generator().manual_seed(seed))

        def mods(tokens, bias):
            doc = get_document_mask_mod(tokens, EOS)

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + bias[h, kv_idx]

            return doc, score_mod

        mask_tpu, score_tpu = mods(tokens.to("tpu"), bias_tpu := bias.to("tpu").requires_grad_())
        inputs = [x.to("tpu").requires_grad_() for x in (q, k, v)]
        block = create_block_mask(mask_tpu, B, None, 64, 64, device="tpu")
        out = flex_attention(*inputs, score_mod=score_tpu, block_mask=block)

        ref_bias = bias.clone().requires_grad_()
        mask_cpu, score_cpu = mods(tokens, ref_bias)
        ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        ref_out, _ = reference(*ref_inputs, score_cpu, mask_cpu)
        close(out, ref_out.detach(), f"out (seed {seed})")
        got = _grads(out, 0, inputs + [bias_tpu])
        want = _grads(ref_out, 0, ref_inputs + [ref_bias])
        for g, w, name in zip(got, want, ("q", "k", "v", "bias")):
            close(g, w, f"d{name} (seed {seed})")


def test_block_lists_decide_and_rows_with_no_key():
    """A BlockMask built from block lists alone: positions outside the listed blocks are masked
    whatever mask_mod says (full blocks skip it), a query block with no listed block gives zeros,
    lse -inf and no gradient; non-square blocks (16 query rows, 32 keys)."""
    q, k, v = _qkv(heads=2, kv_heads=1, seq=64)
    nq, nk = 4, 2
    # query block 0: nothing; 1: key block 0 partial; 2: key block 1 full; 3: both, 0 partial 1 full
    kv_num = torch.tensor([0, 1, 0, 1], dtype=torch.int32).view(1, 1, nq).expand(B, 1, nq).contiguous()
    kv_idx = torch.tensor([[0, 0], [0, 0], [0, 0], [0, 0]], dtype=torch.int32).view(1, 1, nq, nk)
    full_num = torch.tensor([0, 0, 1, 1], dtype=torch.int32).view(1, 1, nq)
    full_idx = torch.tensor([[0, 0], [0, 0], [1, 0], [1, 0]], dtype=torch.int32).view(1, 1, nq, nk)
    kv_idx, full_num, full_idx = (x.expand(B, *x.shape[1:]).contiguous() for x in (kv_idx, full_num, full_idx))

    def odd_keys(b, h, q_idx, kv_idx):
        return kv_idx % 2 == 1

    def dense_mask(b, h, m, n):
        qb, kb = m // 16, n // 32
        partial = ((qb == 1) | (qb == 3)) & (kb == 0)
        full = (qb >= 2) & (kb == 1)
        return full | (partial & odd_keys(b, h, m, n))

    def block_mask(device):
        t = [x.to(device) for x in (kv_num, kv_idx, full_num, full_idx)]
        return BlockMask.from_kv_blocks(*t, BLOCK_SIZE=(16, 32), mask_mod=odd_keys, seq_lengths=(64, 64))

    inputs = [x.to("tpu").requires_grad_() for x in (q, k, v)]
    out, lse = flex_attention(*inputs, block_mask=block_mask("tpu"), enable_gqa=True, return_lse=True)
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference(*ref_inputs, None, dense_mask)
    close(out, ref_out.detach(), "out")
    assert torch.all(out[:, :, :16].cpu() == 0) and torch.all(lse[:, :, :16].cpu() == -math.inf)
    close(lse[:, :, 16:], ref_lse[:, :, 16:].detach(), "lse")
    for got, want, name in zip(_grads(out, 0, inputs), _grads(ref_out, 0, ref_inputs), "qkv"):
        close(got, want, f"d{name}")


def test_query_blocks_match_cpu(monkeypatch):
    """Long query sequences run in blocks of Q_BLOCK rows (lax.map forward, lax.scan backward):
    here 4 blocks of 32, with a score_mod (tanh soft-capping)."""
    monkeypatch.setattr(flex_ops, "Q_BLOCK", 32)
    q, k, v = _qkv(heads=2, kv_heads=1)
    mask = get_sliding_window_mask_mod(40)
    inputs = [x.to("tpu").requires_grad_() for x in (q, k, v)]
    block = create_block_mask(mask, None, None, S, S, device="tpu")
    out = flex_attention(*inputs, score_mod=_softcap, block_mask=block, enable_gqa=True)
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, _ = reference(*ref_inputs, _softcap, mask)
    close(out, ref_out.detach(), "out")
    for got, want, name in zip(_grads(out, 0, inputs), _grads(ref_out, 0, ref_inputs), "qkv"):
        close(got, want, f"d{name}")


def _shifted(score, b, h, q_idx, kv_idx, shift):
    return score + shift[kv_idx]


def test_plain_python_mods_without_dynamo(monkeypatch):
    """With PyTorch's debug switch the operator gets the Python functions themselves (no FX
    graphs): they run op by op on every call, so a captured tensor changed in place is read anew."""
    monkeypatch.setattr(flex_api, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    q, k, v = _qkv(heads=2, kv_heads=2, seq=64)
    shift = torch.zeros(64).to("tpu")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + shift[kv_idx]

    block = create_block_mask(get_causal_mask_mod(), None, None, 64, 64, device="tpu")
    inputs = [x.to("tpu") for x in (q, k, v)]
    for value in (0.0, 1.5):
        shift[32:] = value
        out = flex_attention(*inputs, score_mod=score_mod, block_mask=block)
        cpu_shift = shift.cpu()
        ref_out, _ = reference(q, k, v, partial(_shifted, shift=cpu_shift), get_causal_mask_mod())
        close(out, ref_out, f"shift {value}")


# ----------------------------------------------------------------------------- compiled


class _Attention(torch.nn.Module):
    """A gpt-oss-style attention block: projections, GQA flex attention with a block mask, sinks."""

    def __init__(self, attend):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.wq = torch.nn.Parameter(torch.randn(D * H, D * H, generator=g) / D)
        self.wkv = torch.nn.Parameter(torch.randn(2 * D * HKV, D * H, generator=g) / D)
        self.sinks = torch.nn.Parameter(torch.randn(H, generator=g))
        self.attend = attend

    def forward(self, x, block_mask):
        b, s, _ = x.shape
        q = (x @ self.wq.T).view(b, s, H, D).transpose(1, 2)
        k, v = (x @ self.wkv.T).view(b, s, 2, HKV, D).permute(2, 0, 3, 1, 4)
        out, lse = self.attend(q, k, v, block_mask)
        out = _sinks_out(out, lse, self.sinks)
        return out.transpose(1, 2).reshape(b, s, -1)


def _flex(q, k, v, block_mask):
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)


def _reference_attend(mask_mod):
    return lambda q, k, v, block_mask: reference(q, k, v, None, mask_mod)


def _inputs():
    x = torch.randn(B, S, D * H, generator=torch.Generator().manual_seed(11))
    tokens = _tokens()
    cpu_mask = and_masks(get_document_mask_mod(tokens, EOS), get_causal_mask_mod())
    return x, tokens, cpu_mask


def _cpu_step_losses(steps):
    x, _, cpu_mask = _inputs()
    model = _Attention(_reference_attend(cpu_mask))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x, None).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach() for p in model.parameters()]


def _expected_model_grads(x, cpu_mask):
    model = _Attention(_reference_attend(cpu_mask))
    ref = model(x, None)
    return ref.detach(), torch.autograd.grad(ref.square().mean(), list(model.parameters()))


def _check_model(tpu_model, out, ref, ref_grads):
    close(out, ref, "out")
    grads = torch.autograd.grad(out.square().mean(), list(tpu_model.parameters()))
    for got, want, name in zip(grads, ref_grads, ("wq", "wkv", "sinks")):
        close(got, want, f"d{name}")


def test_torch_compile_tpu_backend_matches_cpu():
    """The whole block in one graph (fullgraph: flex_attention's device check does not break
    it), both operators inside AOTAutograd's forward and backward graphs."""
    x, tokens, cpu_mask = _inputs()
    ref, ref_grads = _expected_model_grads(x, cpu_mask)
    tpu_model = _Attention(_flex).to("tpu")
    mask = and_masks(get_document_mask_mod(tokens.to("tpu"), EOS), get_causal_mask_mod())
    block = create_block_mask(mask, B, None, S, S, device="tpu")
    out = torch.compile(tpu_model, backend="tpu", fullgraph=True)(x.to("tpu"), block)
    _check_model(tpu_model, out, ref, ref_grads)


def test_torchtpu_compile_train_step_matches_cpu():
    """A whole SGD step (block mask, forward, backward, update) as one XLA program."""
    x, tokens, _ = _inputs()
    model = _Attention(_flex).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def step(x, tokens):
        mask = and_masks(get_document_mask_mod(tokens, EOS), get_causal_mask_mod())
        block = create_block_mask(mask, B, None, S, S, device="tpu")
        opt.zero_grad()
        loss = model(x, block).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    compiled = torchtpu.compile(step)
    losses = torch.stack([compiled(x.to("tpu"), tokens.to("tpu")).cpu() for _ in range(2)])
    assert compiled.stats.traces == 1  # the first call runs eagerly, the second is the program
    want_losses, want_params = _cpu_step_losses(2)
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(model.parameters(), want_params):
        close(got, want, "parameters after two steps")


def test_torchtitan_flex_wrapper_runs_without_inductor():
    """torchtitan's FlexAttentionWrapper compiles flex_attention with torch.compile's default
    backend, Inductor: on tpu its graph goes to the tpu backend, in one piece. gpt-oss's call
    (GQA, return_lse, then the sinks)."""
    x, tokens, cpu_mask = _inputs()
    ref, ref_grads = _expected_model_grads(x, cpu_mask)

    def attend(q, k, v, block_mask):
        return FlexAttentionWrapper()(q, k, v, block_mask=block_mask, return_lse=True, enable_gqa=True)

    tpu_model = _Attention(attend).to("tpu")
    mask = and_masks(get_document_mask_mod(tokens.to("tpu"), EOS), get_causal_mask_mod())
    block = create_block_mask(mask, B, None, S, S, device="tpu")
    torch._dynamo.reset()  # FlexAttentionWrapper's compiled function is shared: count this test's graph
    before = torchtpu.cache_stats()["dynamo_compiles"]
    out = tpu_model(x.to("tpu"), block)
    assert torchtpu.cache_stats()["dynamo_compiles"] == before + 1
    _check_model(tpu_model, out, ref, ref_grads)


_IMPORT_AFTER_TORCHTPU = """
import sys, torch, torchtpu
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torchtitan.models.attention import FlexAttentionWrapper, get_causal_mask_mod
print("inductor imported", "torch._inductor.compile_fx" in sys.modules)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 128, 16, generator=g) for _ in range(3))
want = flex_attention(q, k, v, block_mask=create_block_mask(get_causal_mask_mod(), 1, None, 128, 128, device="cpu"))
mask = create_block_mask(get_causal_mask_mod(), 1, None, 128, 128, device="tpu")
attend = lambda q, k, v: FlexAttentionWrapper()(q, k, v, block_mask=mask)
t = [x.to("tpu") for x in (q, k, v)]
traced = torch.compile(attend, backend="tpu", fullgraph=True)(*t)  # dynamo first: nothing compiled it yet
print("traced", (traced.cpu() - want).abs().max().item() < 1e-5, torchtpu.cache_stats()["dynamo_compiles"])
print("eager", (attend(*t).cpu() - want).abs().max().item() < 1e-5)
"""


def test_torchtitan_attention_imported_after_torchtpu_compiles_its_wrappers_at_their_first_call():
    """torchtitan.models.attention builds inductor-backed compiled functions in its class bodies
    (1.4 s of importing inductor's compiler in every torchtpu-train process). Imported after
    torchtpu, they are compiled at their first call: the import leaves inductor out, and the wrapper
    still works under dynamo (fullgraph, before any eager call compiled it) and eagerly."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags(1))
    p = subprocess.run([sys.executable, "-c", _IMPORT_AFTER_TORCHTPU], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "inductor imported False" in p.stdout and "traced True 1" in p.stdout and "eager True" in p.stdout, (
        p.stdout + p.stderr[-3000:]
    )
