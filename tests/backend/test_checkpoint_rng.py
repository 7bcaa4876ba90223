"""Recomputation replays the forward's random draws: a checkpointed block with dropout gets the
gradients of the same block run without checkpointing (same seed, so the same masks), and those
equal PyTorch on CPU given the same masks. Reentrant and non-reentrant `torch.utils.checkpoint`
and `torchtpu.apply_activation_checkpointing`, eager and inside `torchtpu.compile`, and a
`transformers` model with `gradient_checkpointing_enable()`.
"""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import torchtpu

P = 0.1
BATCH, WIDTH = 8, 32


class Net(torch.nn.Module):
    """A linear layer, then a block with dropout that `how` checkpoints (or not)."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        block = torch.nn.Sequential(
            torch.nn.Linear(16, WIDTH), torch.nn.Dropout(P), torch.nn.GELU(), torch.nn.Linear(WIDTH, 16)
        )
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 16), block)
        self.how = how
        if how == "apply":
            torchtpu.apply_activation_checkpointing(self.layers)

    def forward(self, x):
        if self.how in ("none", "apply"):
            return self.layers(x)
        h = self.layers[0](x)
        return torch.utils.checkpoint.checkpoint(self.layers[1], h, use_reentrant=self.how == "reentrant")


def _grads(model, x):
    for p in model.parameters():
        p.grad = None
    model(x).square().mean().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _cpu_with_mask(x, mask):
    """PyTorch on CPU, the dropout layer's mask set to `mask` (drawn on tpu)."""
    model = Net("reentrant")
    model.layers[1][1].register_forward_hook(lambda mod, inp, out: inp[0] * mask)
    return _grads(model, x)


def _close(got, want, rtol, atol):
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w.cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("how", ["reentrant", "non_reentrant", "apply"])
def test_checkpointed_dropout_gradients_eager(how):
    x = torch.randn(BATCH, 8)
    torch.manual_seed(7)
    mask = F.dropout(torch.ones(BATCH, WIDTH, device="tpu"), P).cpu()  # the block's first draw
    assert 0 < (mask == 0).sum() < mask.numel()
    plain, ckpt = Net("none").to("tpu"), Net(how).to("tpu")
    torch.manual_seed(7)
    want = _grads(plain, x.to("tpu"))
    torch.manual_seed(7)
    got = _grads(ckpt, x.to("tpu"))
    _close(got, want, rtol=1e-6, atol=1e-7)
    _close(want, _cpu_with_mask(x, mask), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["reentrant", "non_reentrant", "apply"])
def test_checkpointed_dropout_gradients_compiled(how):
    x = torch.randn(BATCH, 8).to("tpu")
    results = {}
    for name in ("none", how):
        model = Net(name).to("tpu")
        step = torchtpu.compile(lambda x, model=model: _grads(model, x))
        torch.manual_seed(7)
        results[name] = [step(x) for _ in range(3)]
    for want, got in zip(results["none"], results[how]):
        _close(got, want, rtol=1e-6, atol=1e-7)
    # the steps drew new masks each time: the gradients change from step to step
    assert not torch.equal(results[how][1][1].cpu(), results[how][2][1].cpu())


def test_transformers_gradient_checkpointing_with_dropout():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=8, attn_implementation="sdpa"
    )
    assert cfg.resid_pdrop == cfg.attn_pdrop == cfg.embd_pdrop == 0.1
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 4), device="tpu")
    grads = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg).to("tpu").train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        torch.manual_seed(3)
        model(input_ids=ids, labels=ids).loss.backward()
        grads[checkpointing] = [p.grad for p in model.parameters()]
    _close(grads[True], grads[False], rtol=1e-5, atol=1e-6)


def test_selective_checkpointing_under_torch_compile_replays_the_forward_s_masks():
    """torchtitan's selective AC with a compiled model: AOTAutograd saves each recomputed random op's
    state with `run_and_save_rng_state` and replays it in the backward with `run_with_rng_state`.
    With w's gradient being dropout(x) itself, a replay that drew another mask shows."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def recompute_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    def block(x, w):
        return F.dropout(x, p=0.5, training=True) * w

    def step(x, w):
        y = torch.utils.checkpoint.checkpoint(
            block, x, w, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, recompute_all)
        )
        return y * 1.0

    x = torch.rand(64, 32, device="tpu") + 0.5
    w = torch.ones(64, 32, device="tpu", requires_grad=True)
    compiled = torch.compile(step, backend="tpu")
    for _ in range(2):  # the second call draws from another base key: its replay must follow it
        w.grad = None
        y = compiled(x, w)
        y.sum().backward()
        kept = y.detach().cpu() != 0
        assert 0.3 < kept.float().mean() < 0.7
        torch.testing.assert_close(w.grad.cpu(), y.detach().cpu())
