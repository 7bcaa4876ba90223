"""torchtpu.compile on the plain PyTorch training loop: optimizers as users build them (no
extra flags), an LR scheduler stepped outside the compiled step every iteration. Nothing the
step reads may be frozen at trace time: the weights must follow eager tpu and CPU."""

import math
import warnings

import pytest
import torch

import torchtpu

STEPS = 10

# (optimizer, constructor keywords); each runs non-capturable and capturable where the class
# has that option, foreach and single-tensor.
OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5)),
    "adagrad": (torch.optim.Adagrad, dict(lr=5e-2, lr_decay=0.01)),
}
SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-4),
}


def _cases():
    for name, (cls, _) in OPTIMIZERS.items():
        has_capturable = "capturable" in cls.__init__.__code__.co_varnames
        for capturable in (False, True) if has_capturable else (False,):
            for foreach in (False, True):
                # every optimizer meets both schedulers, without running the full product
                sched = "lambda" if (capturable + foreach + len(name)) % 2 else "cosine"
                yield pytest.param(
                    name,
                    capturable,
                    foreach,
                    sched,
                    id=f"{name}-{'capturable' if capturable else 'plain'}-{'foreach' if foreach else 'single'}-{sched}",
                )


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batches(n=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(n)]


def _train(device, name, capturable, foreach, sched, compiled):
    cls, kw = OPTIMIZERS[name]
    model = _mlp().to(device)
    kw = dict(kw, foreach=foreach)
    if capturable:
        kw["capturable"] = True
    opt = cls(model.parameters(), **kw)
    scheduler = SCHEDULERS[sched](opt)

    def train_step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step = torchtpu.compile(train_step) if compiled else train_step
    losses = []
    for x, y in _batches():
        losses.append(step(x.to(device), y.to(device)).item())
        scheduler.step()
    return losses, [p.detach().cpu() for p in model.parameters()], step


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name,capturable,foreach,sched", list(_cases()))
def test_compiled_loop_matches_eager_and_cpu(name, capturable, foreach, sched):
    cpu_losses, cpu_params, _ = _train("cpu", name, False, foreach, sched, False)
    eager_losses, eager_params, _ = _train("tpu", name, capturable, foreach, sched, False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time note about moving CPU step counts
        comp_losses, comp_params, step = _train("tpu", name, capturable, foreach, sched, True)
    assert step.stats.traces == 1, "a changing learning rate recompiled the step"
    assert step.stats.executions == STEPS - 1
    for ref in (eager_losses, cpu_losses):
        torch.testing.assert_close(torch.tensor(comp_losses), torch.tensor(ref), rtol=1e-5, atol=1e-7)
    for c, e, p in zip(comp_params, eager_params, cpu_params):
        assert _rel(c, e) < 1e-5, f"compiled vs eager tpu: {_rel(c, e)}"
        assert _rel(c, p) < 1e-5, f"compiled vs CPU: {_rel(c, p)}"
    assert not torch.equal(comp_params[0], _mlp()[0].weight.detach()), "the weights did not train"


def _adamw_loop(**kw):
    model = _mlp().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kw)

    def train_step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return model, opt, torchtpu.compile(train_step)


def test_changing_lr_never_recompiles():
    model, opt, step = _adamw_loop(capturable=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 2, cycle_momentum=False)
    data = [(x.to("tpu"), y.to("tpu")) for x, y in _batches()]
    step(*data[0])
    sched.step()
    step(*data[1])  # traces
    sched.step()
    torchtpu.reset_cache_stats()
    lrs = set()
    for x, y in data[2:]:
        lrs.add(opt.param_groups[0]["lr"])
        step(x, y)
        sched.step()
    assert len(lrs) == len(data) - 2, "the schedule did not change the learning rate"
    stats = torchtpu.cache_stats()
    assert step.stats.traces == 1
    assert stats["compiled_step_traces"] == 0 and stats["compiled_step_retraces"] == 0
    assert isinstance(opt.param_groups[0]["lr"], float), "the user's param_groups were left changed"


def test_changed_hyperparameter_recompiles_once_visibly(capfd, monkeypatch):
    monkeypatch.setenv("TORCHTPU_LOG_RECOMPILES", "1")
    model, opt, step = _adamw_loop(capturable=True)
    data = [(x.to("tpu"), y.to("tpu")) for x, y in _batches()]
    step(*data[0])
    step(*data[1])
    torchtpu.reset_cache_stats()
    step(*data[2])
    assert step.stats.traces == 1
    opt.param_groups[0]["weight_decay"] = 0.5
    for x, y in data[3:]:
        step(x, y)
    assert step.stats.traces == 2, "a changed weight_decay must be traced again, exactly once"
    assert torchtpu.cache_stats()["compiled_step_retraces"] == 1
    assert "param_groups[0]['weight_decay'] changed: 0.01 -> 0.5" in capfd.readouterr().err

    # the new value is used: continue on CPU from the same point, with the same change
    cpu = _mlp()
    copt = torch.optim.AdamW(cpu.parameters(), lr=1e-2, weight_decay=0.01)
    for i, (x, y) in enumerate(_batches()):
        if i == 3:
            copt.param_groups[0]["weight_decay"] = 0.5
        copt.zero_grad()
        torch.nn.functional.mse_loss(cpu(x), y).backward()
        copt.step()
    for c, t in zip(cpu.parameters(), model.parameters()):
        assert _rel(t.detach().cpu(), c.detach()) < 1e-5


def test_non_capturable_step_count_advances_with_a_note():
    model, opt, step = _adamw_loop()  # the tutorial default: capturable=False
    data = [(x.to("tpu"), y.to("tpu")) for x, y in _batches()]
    with pytest.warns(UserWarning, match=r"AdamW state\['step'\]"):
        step(*data[0])
    for x, y in data[1:]:
        step(x, y)
    counts = {float(s["step"].cpu()) for s in opt.state.values()}
    assert counts == {float(STEPS)}, f"step counts {counts}: frozen at trace time"


def test_cpu_scalar_read_in_step_is_not_frozen():
    lin = torch.nn.Linear(4, 2).to("tpu")
    scale = torch.tensor(2.0)  # a CPU scalar the user keeps and changes between calls

    def f(x):
        return lin(x) * scale

    cf = torchtpu.compile(f)
    x = torch.ones(3, 4).to("tpu")
    for value in (2.0, 3.0, -1.5, 0.25):
        scale.fill_(value)
        torch.testing.assert_close(cf(x).cpu(), (lin(x) * value).cpu())
    assert cf.stats.traces == 1


def test_cpu_tensor_modified_in_step_is_an_error():
    lin = torch.nn.Linear(4, 2).to("tpu")
    counter = torch.zeros(())

    def f(x):
        counter.add_(1)
        return lin(x) * counter

    cf = torchtpu.compile(f)
    x = torch.ones(3, 4).to("tpu")
    cf(x)
    with pytest.raises(RuntimeError, match=r"modifies CPU tensors in place: cpu tensor \(\) torch.float32"):
        cf(x)


def test_cpu_scalar_first_read_after_warmup_is_an_error():
    lin = torch.nn.Linear(4, 2).to("tpu")
    scale = torch.tensor(2.0)
    calls = {"n": 0}

    def f(x):
        calls["n"] += 1
        return lin(x) * (scale if calls["n"] > 1 else 1.0)

    cf = torchtpu.compile(f)
    x = torch.ones(3, 4).to("tpu")
    cf(x)
    with pytest.raises(RuntimeError, match="read CPU tensors it did not read during its first"):
        cf(x)


def test_lr_as_tpu_tensor_still_works():
    # the trainer's form: lr is already a device scalar, i.e. program state
    model = _mlp().to("tpu")
    lr = torch.tensor(1e-2).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=True, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)

    def train_step(x, y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step = torchtpu.compile(train_step)
    cpu = _mlp()
    copt = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    csched = torch.optim.lr_scheduler.LambdaLR(copt, lambda s: 0.5**s)
    for x, y in _batches(6):
        step(x.to("tpu"), y.to("tpu"))
        sched.step()
        copt.zero_grad()
        torch.nn.functional.mse_loss(cpu(x), y).backward()
        copt.step()
        csched.step()
    assert step.stats.traces == 1
    assert math.isclose(float(opt.param_groups[0]["lr"].cpu()), copt.param_groups[0]["lr"], rel_tol=1e-6)
    for c, t in zip(cpu.parameters(), model.parameters()):
        assert _rel(t.detach().cpu(), c.detach()) < 1e-5


def test_closure_number_change_recompiles_once_visibly(capfd, monkeypatch):
    monkeypatch.setenv("TORCHTPU_LOG_RECOMPILES", "1")
    lin = torch.nn.Linear(4, 2).to("tpu")
    scale = 2.0

    def f(x):
        return lin(x) * scale

    cf = torchtpu.compile(f)
    x = torch.ones(3, 4).to("tpu")
    for value in (2.0, 2.0, 2.0, 3.0, 3.0):
        scale = value
        torch.testing.assert_close(cf(x).cpu(), (lin(x) * value).cpu())
    assert cf.stats.traces == 2
    assert "'scale' changed: 2.0 -> 3.0" in capfd.readouterr().err


def test_optimizer_first_stepped_after_warmup_is_adopted():
    # gradient accumulation: the optimizer steps every other call, not in the eager warm-up
    model = _mlp().to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    cpu = _mlp()
    copt = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    csched = torch.optim.lr_scheduler.LambdaLR(copt, lambda s: 1.0 / (1 + s))
    update = False

    def accumulate(x, y):
        torch.nn.functional.mse_loss(model(x), y).backward()
        if update:
            opt.step()
            # in place: with set_to_none the .grad objects would differ between the traces
            # (a limitation: the programs assume the same tensor objects in the same roles)
            opt.zero_grad(set_to_none=False)

    step = torchtpu.compile(accumulate)
    for i, (x, y) in enumerate(_batches(12)):
        update = i % 2 == 1
        step(x.to("tpu"), y.to("tpu"))
        torch.nn.functional.mse_loss(cpu(x), y).backward()
        if update:
            copt.step()
            copt.zero_grad(set_to_none=False)
            sched.step()
            csched.step()
    assert step.stats.traces <= 3  # accumulate-only, and the update (one retry to adopt the optimizer)
    for c, t in zip(cpu.parameters(), model.parameters()):
        assert _rel(t.detach().cpu(), c.detach()) < 1e-5
