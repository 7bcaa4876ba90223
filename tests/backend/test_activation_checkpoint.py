"""Activation checkpointing inside compiled steps: same numbers, recomputation in the program."""

import pytest
import torch

import torchtpu


def _step_for(mode, every=1):
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)) for _ in range(4)]
    )
    torchtpu.apply_activation_checkpointing(blocks, mode, every=every)
    blocks.to("tpu")
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        loss = blocks(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return torchtpu.compile(step), blocks


def test_checkpointing_changes_program_not_numbers():
    x = torch.randn(16, 32).to("tpu")
    results = {}
    for mode, every in (("none", 1), ("selective", 2), ("full", 1)):
        step, blocks = _step_for(mode, every)
        losses = [step(x).item() for _ in range(4)]
        text = step.as_text(optimized=False)
        results[mode] = (
            losses,
            text.count("stablehlo.dot_general"),
            text.count("optimization_barrier"),
            [p.detach().cpu() for p in blocks.parameters()],
        )
    base_losses, base_dots, base_barriers, base_params = results["none"]
    assert base_barriers == 0
    for mode in ("selective", "full"):
        losses, dots, _, params = results[mode]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(base_losses), rtol=1e-6, atol=0)
        for a, b in zip(params, base_params):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert dots > base_dots, f"{mode}: no recomputed matmuls in the program"
    # one barrier per recomputed block whose input needs a gradient: the first block's input (the
    # batch) needs none, so full recomputation of 4 blocks has 3 (selective, every 2nd: blocks 1 and 3)
    assert results["selective"][2] == 2 and results["full"][2] == 3
    assert results["selective"][1] < results["full"][1]


def test_bad_checkpointing_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="'none', 'full', 'selective'"):
        torchtpu.apply_activation_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2)), "sometimes")
    with pytest.raises(ValueError, match="every >= 1"):
        torchtpu.apply_activation_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2)), "selective", every=0)


class _PickedCrossEntropy(torch.overrides.TorchFunctionMode):
    """Computes F.cross_entropy another way (log-sum-exp minus the picked logit), as loss_parallel
    does for vocabulary-sharded logits; counts the calls it takes over."""

    calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.cross_entropy:
            type(self).calls += 1
            x, t = args[0], args[1]
            hit = t.unsqueeze(-1) == torch.arange(x.shape[-1])
            return (torch.logsumexp(x, -1) - (x * hit).sum(-1)).sum()
        return func(*args, **kwargs)


class _Loss(torch.nn.Module):
    def forward(self, h, w, t):
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w), t, reduction="sum")


@pytest.mark.parametrize("backward_in_mode", [False, True])
def test_recomputation_runs_under_the_forwards_function_modes(backward_in_mode):
    """A torch function mode entered around the forward only (loss_parallel around the loss) is
    active again when backward recomputes: the recomputation computes what the forward did (without
    it, torch.utils.checkpoint finds other saved tensors and raises; on tpu the process aborted)."""
    from torchtpu.backend.activation_checkpoint import checkpoint_module

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(6, 8, generator=g), torch.randn(10, 8, generator=g)
    t = torch.randint(0, 10, (6,), generator=g)
    grads = {}
    for name, module in (("plain", _Loss()), ("checkpointed", checkpoint_module(_Loss()))):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        _PickedCrossEntropy.calls = 0
        mode = _PickedCrossEntropy()
        with mode:
            loss = module(hh, ww, t)
            if backward_in_mode:
                loss.backward()
        if not backward_in_mode:
            loss.backward()
        grads[name] = (loss.detach(), hh.grad, ww.grad, _PickedCrossEntropy.calls)
    plain, ckpt = grads["plain"], grads["checkpointed"]
    for a, b in zip(ckpt[:3], plain[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # forward once, recomputation once, each through the mode (entered once: not stacked twice)
    assert (plain[3], ckpt[3]) == (1, 2)
