"""PyTorch's fused optimizer kernels on tpu (`fused=True`: `_fused_adam_`, `_fused_adamw_`,
`_fused_sgd_`, `_fused_adagrad_`). The oracle is PyTorch's own fused CPU kernel on the same
values: parameters, gradients (unscaled in place under AMP) and optimizer state after each call.
"""

import pytest
import torch

import torchtpu

aten = torch.ops.aten

SHAPES = [(3, 4), (), (5,)]  # mixed shapes, a 0-dim one among them
STEPS = 10


def _close(got, want, msg, rtol=2e-6, atol=1e-7):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g.cpu(), w, rtol=rtol, atol=atol, msg=lambda m, i=i: f"{msg}[{i}]: {m}")


# ----------------------------------------------------------------------------- torch.optim(fused=True)

CASES = {
    "adam-amsgrad-wd": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    "adamw-maximize-small-beta1": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.3, 0.99), maximize=True)),
    "adamw-tensor-lr": (torch.optim.AdamW, dict(lr=torch.tensor(2e-2), weight_decay=0.1)),
    "sgd-nesterov-wd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd-dampening-maximize": (torch.optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.3, maximize=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1)),
}


def _train(device, cls, kw, dtype=torch.float32):
    torch.manual_seed(0)
    params = [torch.randn(s).to(dtype).to(device).requires_grad_() for s in SHAPES]
    opt = cls(params, fused=True, **kw)
    # a scheduler changes the float lr every step (the tensor lr is left as it is)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if not torch.is_tensor(kw["lr"]) else None
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(dtype).to(device)
        opt.step()
        if sched is not None:
            sched.step()
    state = [t for p in params for t in opt.state[p].values() if torch.is_tensor(t)]
    return [p.detach() for p in params], state


@pytest.mark.parametrize("case", CASES)
def test_optimizer_matches_cpu_fused_kernel(case):
    cls, kw = CASES[case]
    before = torchtpu.cache_stats()
    got, got_state = _train("tpu", cls, kw)
    programs = torchtpu.cache_stats()["misses"] - before["misses"]
    want, want_state = _train("cpu", cls, kw)
    _close(got, want, f"{case} parameters")
    _close(got_state, want_state, f"{case} state")
    # the scheduler's new lr every step is a program input: fewer programs compiled than steps taken
    assert programs < STEPS, programs


def test_bfloat16_adamw_matches_cpu_fused_kernel():
    # float32 arithmetic, bfloat16 storage, as the CPU kernel (its SGD and Adagrad bfloat16 paths
    # round lr and eps to bfloat16 in their vectorized loop only, so they are not an oracle here)
    kw = dict(lr=1e-2, weight_decay=0.1)
    got, got_state = _train("tpu", torch.optim.AdamW, kw, torch.bfloat16)
    want, want_state = _train("cpu", torch.optim.AdamW, kw, torch.bfloat16)
    _close(got, want, "bfloat16 parameters", rtol=0, atol=0)
    _close(got_state, want_state, "bfloat16 state", rtol=0, atol=0)


# ----------------------------------------------------------------------------- AMP: grad_scale, found_inf


def _lists(device, n):
    g = torch.Generator().manual_seed(3)
    return [[torch.randn(s, generator=g).abs().to(device) for s in SHAPES] for _ in range(n)]


def _call(family, device, lists, steps, step, lr, found_inf):
    scale = torch.tensor(512.0, device=device)
    inf = torch.tensor(found_inf, device=device)
    if step % 2:
        lr = torch.tensor(lr, device=device)
    if family == "adam":
        params, grads, m, v, vmax = lists
        aten._fused_adam_(
            params, grads, m, v, vmax, steps, lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8,
            amsgrad=True, maximize=False, grad_scale=scale, found_inf=inf,
        )  # fmt: skip
    elif family == "adamw":
        params, grads, m, v = lists
        aten._fused_adamw_(
            params, grads, m, v, [], steps, lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8,
            amsgrad=False, maximize=True, grad_scale=scale, found_inf=inf,
        )  # fmt: skip
    elif family == "sgd":
        params, grads, bufs = lists
        aten._fused_sgd_(
            params, grads, bufs, weight_decay=0.01, momentum=0.9, lr=lr, dampening=0.1, nesterov=False,
            maximize=False, is_first_step=step == 0, grad_scale=scale, found_inf=inf,
        )  # fmt: skip
    else:
        params, grads, sums = lists
        aten._fused_adagrad_(
            params, grads, sums, steps, lr=lr, lr_decay=0.05, weight_decay=0.1, eps=1e-10, maximize=False,
            grad_scale=scale, found_inf=inf,
        )  # fmt: skip


@pytest.mark.parametrize("family,n", [("adam", 5), ("adamw", 4), ("sgd", 3), ("adagrad", 3)])
def test_grad_scale_unscales_and_found_inf_skips(family, n):
    """The ops called directly, a float lr and a tpu-tensor lr on alternate calls: grads divided by
    grad_scale (and written back), and the call with found_inf == 1 changes nothing."""
    tpu, cpu = _lists("tpu", n), _lists("cpu", n)
    for step, found_inf in enumerate([0.0, 1.0, 0.0]):
        for device, lists in (("tpu", tpu), ("cpu", cpu)):
            for i, t in enumerate(lists[1]):  # fresh scaled gradients each call
                t.copy_(torch.full_like(t, 512.0 * (step + 1)) * (i + 1) - 300.0)
            if device == "tpu":
                before = [[t.cpu() for t in lst] for lst in lists]
            steps = [torch.tensor(float(step + 1), device=device) for _ in SHAPES]
            _call(family, device, lists, steps, step, 0.05, found_inf)
        _close([t for lst in tpu for t in lst], [t for lst in cpu for t in lst], f"{family} call {step}")
        if found_inf:
            for lst, old in zip(tpu, before, strict=True):
                _close(lst, old, "a skipped call's lists", rtol=0, atol=0)
        else:
            _close(tpu[1], [t / 512.0 for t in before[1]], "unscaled grads")


def test_grad_scaler_with_fused_adamw_matches_cpu():
    """GradScaler hands the fused optimizer its scale and found_inf; an inf gradient skips the step."""

    def train(device):
        torch.manual_seed(0)
        params = [torch.randn(s).to(device).requires_grad_() for s in SHAPES]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
        scaler = torch.amp.GradScaler(device, init_scale=256.0)
        for step in range(4):
            opt.zero_grad()
            loss = sum((p * (k + 1)).sin().sum() for k, p in enumerate(params))
            if step == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        steps = [opt.state[p]["step"] for p in params]
        return [p.detach() for p in params], steps, scaler.get_scale()

    got, got_steps, got_scale = train("tpu")
    want, want_steps, want_scale = train("cpu")
    _close(got, want, "parameters")
    _close(got_steps, want_steps, "state steps", rtol=0, atol=0)
    assert got_scale == want_scale == 128.0  # backed off once, after the overflow
    assert [float(s) for s in got_steps] == [3.0] * len(SHAPES)  # the overflowing step was taken back


# ----------------------------------------------------------------------------- one program, compiled steps


def test_eager_fused_adamw_is_one_program_per_call():
    n = 8
    params, grads, m, v = ([torch.randn(k + 1, 3).to("tpu") for k in range(n)] for _ in range(4))
    steps = [torch.tensor(1.0).to("tpu") for _ in range(n)]

    def call(lr):
        aten._fused_adamw_(
            params, grads, m, v, [], steps, lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8,
            amsgrad=False, maximize=False,
        )  # fmt: skip

    call(1e-3)  # compiles
    before = torchtpu.cache_stats()
    for lr in (2e-3, 3e-3, 4e-3):
        call(lr)
    after = torchtpu.cache_stats()
    assert after["calls"] - before["calls"] == 3  # one XLA program per call over all 8 parameters
    assert after["misses"] == before["misses"]  # and a new lr is an input, not a recompile
    assert after["xla_compiles"] == before["xla_compiles"]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _train_mlp(device, compiled):
    model = _mlp().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    def train_step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    step = torchtpu.compile(train_step) if compiled else train_step
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(6):
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        losses.append(step(x.to(device), y.to(device)).item())
        sched.step()
    return losses, [p.detach().cpu() for p in model.parameters()]


def test_fused_adamw_inside_torchtpu_compile_matches_eager():
    before = torchtpu.cache_stats()
    compiled_losses, compiled_params = _train_mlp("tpu", compiled=True)
    d = {k: torchtpu.cache_stats()[k] - before[k] for k in before}
    eager_losses, eager_params = _train_mlp("tpu", compiled=False)
    cpu_losses, _ = _train_mlp("cpu", compiled=False)
    assert d["compiled_step_traces"] == 1 and d["compiled_step_retraces"] == 0  # lr lifted, not guarded
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-6, atol=1e-7)
    _close(compiled_params, eager_params, "compiled parameters", rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled_losses, cpu_losses, rtol=1e-5, atol=1e-6)


def test_functional_variant_inside_torch_compile_graph():
    """A graph that calls the kernel itself (torch.optim's fused path is never traced by Dynamo)
    reaches the functional `_fused_adam` through AOTAutograd's functionalization."""

    def update(params, grads, m, v, vmax, steps):
        torch._fused_adam_(
            params, grads, m, v, vmax, steps, lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
            amsgrad=True, maximize=False,
        )  # fmt: skip

    tpu, cpu = _lists("tpu", 5), _lists("cpu", 5)
    before = torchtpu.cache_stats()
    torch.compile(update, backend="tpu")(*tpu, [torch.tensor(2.0).to("tpu") for _ in SHAPES])
    update(*cpu, [torch.tensor(2.0) for _ in SHAPES])
    assert torchtpu.cache_stats()["dynamo_graph_traces"] - before["dynamo_graph_traces"] == 1
    _close([t for lst in tpu for t in lst], [t for lst in cpu for t in lst], "after the compiled graph")


# ----------------------------------------------------------------------------- variants and errors


def test_functional_and_out_variants_match_cpu():
    def run(device):
        params, grads, sums = _lists(device, 3)
        steps = [torch.tensor(2.0, device=device) for _ in SHAPES]
        kw = dict(lr=0.1, lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=True)
        fresh = aten._fused_adagrad(params, grads, sums, steps, **kw)
        out = [torch.empty(0, device=device) for _ in SHAPES]
        aten._fused_sgd.out(
            params, grads, [], weight_decay=0.0, momentum=0.0, lr=0.5, dampening=0.0, nesterov=False, maximize=False,
            is_first_step=False, out=out,
        )  # fmt: skip
        return [t for lst in fresh for t in lst] + out + params + sums

    _close(run("tpu"), run("cpu"), "functional and out= results")


def test_mismatched_lists_and_amsgrad_state_are_errors():
    params, grads, m, v = _lists("tpu", 4)
    steps = [torch.tensor(1.0).to("tpu") for _ in SHAPES]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, maximize=False)
    with pytest.raises(RuntimeError, match=r"aten\._fused_adamw: `grads` has 2 tensors, `self` has 3"):
        aten._fused_adamw_(params, grads[:2], m, v, [], steps, amsgrad=False, **kw)
    with pytest.raises(RuntimeError, match=r"aten\._fused_adam: `max_exp_avg_sqs` must be empty when amsgrad"):
        aten._fused_adam_(params, grads, m, v, v, steps, amsgrad=False, **kw)
    ints = [torch.ones(s, dtype=torch.int32).to("tpu") for s in SHAPES]
    with pytest.raises(RuntimeError, match=r"aten\._fused_adamw: fused optimizers update floating-point"):
        aten._fused_adamw_(ints, grads, m, v, [], steps, amsgrad=False, **kw)


FOREACH = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam-amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "sgd-nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "rmsprop-centered": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01)),
}


@pytest.mark.parametrize("case", FOREACH)
def test_foreach_optimizers_match_cpu_and_compile_nothing_after_their_first_steps(case):
    """torch.optim's foreach implementations (foreach=True) on tpu equal the CPU's. AdamW passes its
    per-step bias corrections as Scalar lists (`_foreach_div.ScalarList`, `_foreach_addcdiv.ScalarList`):
    their values are program inputs, so steps after the first two run the programs already compiled."""
    cls, kw = FOREACH[case]

    def train(device):
        torch.manual_seed(0)
        params = [torch.randn(s).to(device).requires_grad_() for s in SHAPES]
        opt = cls(params, foreach=True, **kw)
        g = torch.Generator().manual_seed(1)
        compiles = []
        for _ in range(6):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(device)
            before = torchtpu.cache_stats()["xla_compiles"]
            opt.step()
            compiles.append(torchtpu.cache_stats()["xla_compiles"] - before)
        return [p.detach().cpu() for p in params], compiles

    want, _ = train("cpu")
    got, compiles = train("tpu")
    _close(got, want, "foreach AdamW weights", rtol=1e-5, atol=1e-6)
    assert compiles[2:] == [0, 0, 0, 0], compiles


def test_optimizers_default_to_foreach_on_tpu_as_on_cuda():
    """torch.optim picks its foreach implementation for parameters on tpu, as it does on CUDA (and
    keeps the for-loop one on the CPU)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    on_tpu = [torch.nn.Parameter(torch.ones(2).to("tpu")), torch.nn.Linear(2, 2).to("tpu").weight]
    assert _default_to_fused_or_foreach(on_tpu, differentiable=False) == (False, True)
    assert _default_to_fused_or_foreach([torch.nn.Parameter(torch.ones(2))], differentiable=False) == (False, False)
