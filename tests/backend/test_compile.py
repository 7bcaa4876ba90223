"""torchtpu.compile: whole training steps as one XLA program."""

import gc

import jax
import pytest
import torch

import torchtpu


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def _make_step(model, opt):
    def step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        return loss.detach()

    return step


def _run(compiled: bool, n=10):
    model = _mlp().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, capturable=True)
    step = _make_step(model, opt)
    if compiled:
        step = torchtpu.compile(step)
    losses = [step(x.to("tpu"), y.to("tpu")).item() for x, y in _batches(n)]
    return losses, [p.detach().cpu() for p in model.parameters()], step


def test_ten_adamw_steps_match_eager():
    eager_losses, eager_params, _ = _run(False)
    comp_losses, comp_params, step = _run(True)
    torch.testing.assert_close(torch.tensor(comp_losses), torch.tensor(eager_losses), rtol=1e-5, atol=0)
    for c, e in zip(comp_params, eager_params):
        # relative to the tensor's norm: XLA fuses the whole step, so single near-zero
        # elements differ in the last bits
        assert ((c - e).norm() / e.norm()).item() < 1e-5
    assert step.stats.traces == 1 and step.stats.executions == 9  # 1 eager warm-up, 9 compiled


def test_matches_cpu_too():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = _make_step(model, opt)
    cpu_losses = [step(x, y).item() for x, y in _batches(10)]
    comp_losses, _, _ = _run(True)
    torch.testing.assert_close(torch.tensor(comp_losses), torch.tensor(cpu_losses), rtol=1e-5, atol=0)


def test_one_executable_per_call_and_no_recompile():
    model = _mlp().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    step = torchtpu.compile(_make_step(model, opt))
    data = [(x.to("tpu"), y.to("tpu")) for x, y in _batches(6)]
    step(*data[0])
    step(*data[1])  # traces and compiles
    before = step.stats.snapshot()
    torchtpu.reset_cache_stats()
    compiles = torchtpu.cache_stats()["xla_compiles"]
    for x, y in data[2:]:
        step(x, y)
    after = step.stats.snapshot()
    assert after["traces"] == before["traces"], "a steady-state call recompiled"
    assert after["executions"] - before["executions"] == 4  # exactly one executable per call
    assert torchtpu.cache_stats()["calls"] == 0, "op-by-op dispatch ran inside a compiled call"
    assert torchtpu.cache_stats()["xla_compiles"] == compiles, "XLA compiled again in steady state"


def _live_bytes():
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def test_donation_keeps_memory_flat():
    before = _live_bytes()  # what other tests in this process left alive
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    step = torchtpu.compile(_make_step(model, opt))
    x, y = torch.randn(4, 256).to("tpu"), torch.randn(4, 256).to("tpu")
    for _ in range(3):
        step(x, y).item()
    old = torchtpu.to_jax(model[0].weight)
    step(x, y).item()
    assert old.is_deleted(), "the parameter's input buffer was not donated"
    base = _live_bytes()
    for _ in range(15):
        step(x, y).item()
    assert _live_bytes() <= base * 1.01
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    # params + grads + two Adam moments, each held once (plus small step counters and inputs)
    assert base - before < param_bytes * 4 * 1.1 + 1_000_000


def test_random_ops_reproducible_and_advance():
    def make():
        torch.manual_seed(0)
        lin = torch.nn.Linear(16, 16).to("tpu")

        def f(x):
            return torch.nn.functional.dropout(lin(x), p=0.5, training=True)

        return torchtpu.compile(f)

    x = torch.ones(4, 16).to("tpu")
    torch.manual_seed(7)
    f = make()
    torch.manual_seed(7)
    a = [f(x).cpu() for _ in range(4)]
    g = make()
    torch.manual_seed(7)
    b = [g(x).cpu() for _ in range(4)]
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert not torch.equal(a[2], a[3]), "the generator did not advance between compiled calls"
    zeros = (a[3] == 0).float().mean().item()
    assert 0.3 < zeros < 0.7


def test_stray_tensor_read_is_an_error():
    w = torch.ones(3).to("tpu")
    other = torch.full((3,), 2.0).to("tpu")
    calls = {"n": 0}

    def f(x):
        calls["n"] += 1
        return x * (w if calls["n"] == 1 else other)

    cf = torchtpu.compile(f)
    x = torch.ones(3).to("tpu")
    cf(x)
    with pytest.raises(RuntimeError, match="did not read during its first"):
        cf(x)


def test_new_shape_recompiles_visibly():
    lin = torch.nn.Linear(4, 4).to("tpu")
    f = torchtpu.compile(lambda x: lin(x).sum())
    for n in (2, 2, 2, 3, 3):
        f(torch.ones(n, 4).to("tpu"))
    assert f.stats.traces == 2


def test_copies_taken_before_training_survive_donation():
    model = _mlp().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    step = torchtpu.compile(_make_step(model, opt))
    w = model[0].weight
    snapshots = [w.detach().clone(), w.detach().to("tpu", copy=True), w.detach().cpu()]
    for x, y in _batches(4):
        step(x.to("tpu"), y.to("tpu"))
    for s in snapshots:
        torch.testing.assert_close(s.cpu(), snapshots[2])  # readable and unchanged
    assert not torch.equal(w.detach().cpu(), snapshots[2])  # the parameter itself trained


def _step_setting_grads_to_none(model, opt):
    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def test_abstract_warmup_runs_the_program_from_the_first_call_and_matches_cpu():
    """warmup="abstract" with Adam's state created up front (what its first step would create:
    step 0, zero moments): every call, the first included, runs the one compiled program, and
    the losses and weights are PyTorch's on CPU."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = _step_setting_grads_to_none(model, opt)
    cpu_losses = [step(x, y).item() for x, y in _batches(4)]

    model = _mlp().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, capturable=True)
    for p in model.parameters():
        opt.state[p] = {
            "step": torch.tensor(0.0, device="tpu"),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    step = torchtpu.compile(_step_setting_grads_to_none(model, opt), warmup="abstract")
    losses = [step(x.to("tpu"), y.to("tpu")).item() for x, y in _batches(4)]
    assert step.stats.traces == 1 and step.stats.executions == 4
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-5, atol=1e-7)
    cpu_params = [p.detach() for p in _cpu_after(4)]
    for c, e in zip([p.detach().cpu() for p in model.parameters()], cpu_params):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-6)
    assert opt.state[next(iter(model.parameters()))]["step"].item() == 4


def _cpu_after(n):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = _step_setting_grads_to_none(model, opt)
    for x, y in _batches(n):
        step(x, y)
    return list(model.parameters())


def test_abstract_warmup_refuses_state_the_first_call_creates():
    """Adam's moments made lazily in the first call have no value to start a program from
    (zeros would be wrong for other optimizers): refused, naming the fix; nothing ran."""
    model = _mlp().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    before = [p.detach().cpu().clone() for p in model.parameters()]
    step = torchtpu.compile(_step_setting_grads_to_none(model, opt), warmup="abstract")
    x, y = _batches(1)[0]
    with pytest.raises(RuntimeError, match=r"creates \d+ tensor\(s\) on its first call.*warmup='eager'"):
        step(x.to("tpu"), y.to("tpu"))
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, p.detach().cpu())
    assert not opt.state and all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="choose 'eager' or 'abstract'"):
        torchtpu.compile(lambda: None, warmup="lazy")
