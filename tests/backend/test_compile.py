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
    assert base < param_bytes * 4 * 1.1 + 1_000_000


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
