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
