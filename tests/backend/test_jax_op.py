"""torchtpu.jax_op: a user's Pallas kernel and a plain JAX function with jax.custom_vjp as torch ops.

PyTorch on CPU is the oracle: the ops' forward values and gradients equal PyTorch's softmax and
PyTorch's formula for the JAX function, in strict eager, in torchtpu.compile, in
torch.compile(backend="tpu"), under activation checkpointing, and per shard over 8 devices."""

import functools

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.utils.checkpoint
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import torchtpu
from tests.conftest import assert_close_to_cpu

pytestmark = pytest.mark.usefixtures("keep_current_mesh")
close = functools.partial(assert_close_to_cpu, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the user's code


def _softmax_kernel(x_ref, o_ref):
    x = x_ref[...].astype(jnp.float32)
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    o_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(o_ref.dtype)


def pallas_softmax(x):
    """A fused row softmax as a Pallas kernel over blocks of 8 rows (no gradient of its own)."""
    rows, cols = x.shape
    block = pl.BlockSpec((8, cols), lambda i: (i, 0))
    return pl.pallas_call(
        _softmax_kernel,
        grid=(rows // 8,),
        in_specs=[block],
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(x)


@jax.custom_vjp
def fused_softmax(x):
    return pallas_softmax(x)


def _softmax_fwd(x):
    y = pallas_softmax(x)
    return y, y


def _softmax_bwd(y, g):
    return ((g - jnp.sum(g * y, axis=-1, keepdims=True)) * y,)


fused_softmax.defvjp(_softmax_fwd, _softmax_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def scaled_tanh(x, w, scale):
    """tanh(x * w) * scale, with a hand-written gradient (w: one weight per column)."""
    return jnp.tanh(x * w) * scale


def _tanh_fwd(x, w, scale):
    t = jnp.tanh(x * w)
    return t * scale, (x, w, t)


def _tanh_bwd(scale, res, g):
    x, w, t = res
    d = g * scale * (1 - t * t)
    return d * w, jnp.sum(d * x, axis=0)


scaled_tanh.defvjp(_tanh_fwd, _tanh_bwd)


def torch_scaled_tanh(x, w, scale=2.0):
    return torch.tanh(x * w) * scale


# ----------------------------------------------------------------------------- setup


@pytest.fixture(scope="module")
def ops():
    """The ops, registered once (a torch.library name is defined once per process)."""
    return {
        "softmax": torchtpu.jax_op("jaxop_test::fused_softmax", fused_softmax),
        "tanh": torchtpu.jax_op("jaxop_test::scaled_tanh", lambda x, w, scale=2.0: scaled_tanh(x, w, scale)),
        "softmax_rows": torchtpu.jax_op("jaxop_test::softmax_rows", fused_softmax, out_specs=P("dp")),
        "softmax_fsdp": torchtpu.jax_op(
            "jaxop_test::softmax_fsdp", fused_softmax, in_specs=(P("dp_shard"),), out_specs=P("dp_shard")
        ),
        "softmax_given": torchtpu.jax_op(
            "jaxop_test::softmax_given", fused_softmax, in_specs=(P("dp"),), out_specs=P("dp")
        ),
        "tanh_rows": torchtpu.jax_op(
            "jaxop_test::tanh_rows",
            lambda x, w, scale=2.0: scaled_tanh(x, w, scale),
            in_specs=(P("dp"), P()),
            out_specs=P("dp"),
        ),
    }


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 32, generator=g), torch.randn(32, generator=g), torch.randn(64, 32, generator=g)


def _reference(name, x, w, grad):
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch.softmax(xc, -1) if name == "softmax" else torch_scaled_tanh(xc, wc, 3.0)
    y.backward(grad)
    return y.detach(), xc.grad, (wc.grad if name == "tanh" else None)


def _call(ops, name, x, w):
    return ops[name](x) if name.startswith("softmax") else ops[name](x, w, 3.0)


def _step(ops, name, mode):
    """fn(x, w, grad) -> (output, x's gradient, w's gradient) on tpu, in `mode`."""

    def step(x, w, grad):
        if mode == "checkpoint":
            y = torch.utils.checkpoint.checkpoint(lambda x, w: _call(ops, name, x, w) * 1.0, x, w, use_reentrant=False)
        else:
            y = _call(ops, name, x, w)
        gx, gw = torch.autograd.grad(y, (x, w), grad, allow_unused=True)
        return y.detach(), gx, gw

    if mode == "torchtpu.compile":
        return torchtpu.compile(step)
    if mode == "torch.compile":
        return torch.compile(step, backend="tpu")
    return step


@pytest.mark.parametrize("mode", ["eager", "torchtpu.compile", "torch.compile", "checkpoint"])
@pytest.mark.parametrize("name", ["softmax", "tanh"])
def test_forward_and_gradients_equal_pytorch(ops, name, mode):
    x, w, grad = _data()
    want = _reference(name, x, w, grad)
    step = _step(ops, name, mode)
    xt, wt, gt = x.to("tpu").requires_grad_(), w.to("tpu").requires_grad_(), grad.to("tpu")
    for _ in range(2 if mode == "torchtpu.compile" else 1):  # the first call of torchtpu.compile runs eagerly
        got = step(xt, wt, gt)
    close(got[0], want[0], "output")
    close(got[1], want[1], "x's gradient")
    if name == "tanh":
        close(got[2], want[2], "w's gradient")
    else:
        assert got[2] is None


def test_sharded_over_8_devices_equals_unsharded(ops):
    """Per shard (shard_map, rows over "dp"): in eager with in_specs from the placements, and in a
    torchtpu.compile program with given in_specs (w replicated: its gradient sums the shards')."""
    from torchtpu.distributed import Replicate, Shard, distribute_tensor, init_device_mesh

    x, w, grad = _data()
    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp",))
    xs = distribute_tensor(x, mesh, (Shard(0),)).requires_grad_()
    ws = distribute_tensor(w, mesh, (Replicate(),)).requires_grad_()
    gs = distribute_tensor(grad, mesh, (Shard(0),))
    for name in ("softmax_rows", "tanh_rows"):
        want = _reference(name.split("_")[0], x, w, grad)
        step = _step(ops, name, "torchtpu.compile" if name == "tanh_rows" else "eager")
        for _ in range(2):
            got = step(xs, ws, gs)
        assert torchtpu.to_jax(got[0]).sharding.spec[0] == "dp", f"{name}: the output is not laid out per shard"
        close(got[0], want[0], f"{name} output")
        close(got[1], want[1], f"{name} x's gradient")
        if name == "tanh_rows":
            close(got[2], want[2], f"{name} w's gradient")
    # inside a compiled program a value's placement is known where torchtpu.distributed laid it out
    # (the step's state: sharded parameters, tensors it reads) ...
    state = distribute_tensor(x, mesh, (Shard(0),))
    step = torchtpu.compile(lambda: ops["softmax_rows"](state))
    for _ in range(2):
        got = step()
    close(got, torch.softmax(x, -1), "per shard over a sharded state tensor, traced")
    # ... and not for a value computed in it, or a step's positional input: then in_specs are needed
    step = torchtpu.compile(lambda x: ops["softmax_rows"](x * 2))
    step(xs)  # eager warm-up: placements are the arrays' shardings
    with pytest.raises(RuntimeError, match="jaxop_test::softmax_rows: the placement of input 'x' is not known"):
        step(xs)


class _Mixer(torch.nn.Module):
    """Linear, a row softmax (the user's op on tpu, PyTorch's as the reference), Linear."""

    def __init__(self, softmax):
        super().__init__()
        self.up, self.down, self.softmax = torch.nn.Linear(32, 32), torch.nn.Linear(32, 8), softmax

    def forward(self, x):
        return self.down(self.softmax(self.up(x)))


def test_fsdp_training_on_8_devices_equals_the_reference_ops_losses(ops):
    """FSDP over 8 devices, SGD steps compiled with torchtpu.compile, the kernel per shard of the
    batch: the losses equal those of the same model with torch.softmax, trained on CPU."""
    from torchtpu.distributed import Shard, distribute_tensor, fully_shard, init_device_mesh

    torch.manual_seed(0)
    ref = _Mixer(lambda h: torch.softmax(h, -1))
    model = _Mixer(ops["softmax_fsdp"])
    model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g)

    def train(model, x, target, compile):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

        def step(x, target):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            return loss.detach()

        step = compile(step)
        return torch.stack([step(x, target).cpu() for _ in range(3)]), step

    want, _ = train(ref, x, target, lambda f: f)
    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp_shard",))
    fully_shard(model.to("tpu"), mesh=mesh)
    xs, ts = (distribute_tensor(t, mesh, (Shard(0),)) for t in (x, target))
    got, step = train(model, xs, ts, torchtpu.compile)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert "manual_computation" in step.as_text(optimized=False)  # shard_map: the kernel runs per shard
    assert want[2] < want[0]  # it trains


def test_ahead_of_time_for_v5p_the_kernel_is_a_custom_call_with_a_cost(ops):
    """A training step with the user's kernel, compiled ahead of time for v5p:2x2x1 (rows over 4
    chips), runs it as a Mosaic custom call per shard (16 of 64 rows); XLA's cost analysis counts
    the step."""
    from tests.backend.test_pallas_attention import _topology_devices
    from torchtpu.distributed import Shard, empty, init_device_mesh

    mesh = init_device_mesh("tpu", (4,), mesh_dim_names=("dp",), devices=_topology_devices())

    def step(x):
        (g,) = torch.autograd.grad(ops["softmax_given"](x).square().sum(), (x,))
        return g

    x = empty((64, 256), torch.float32, mesh=mesh, placements=(Shard(0),)).requires_grad_()
    compiled = torchtpu.compile(step).compile_for(x)
    calls = [line for line in compiled.as_text().splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    # one kernel call: the forward the backward runs again inside jax.vjp is the same computation
    assert len(calls) == 1 and "f32[16,256]" in calls[0].split(" custom-call(")[0], calls
    cost = compiled.cost_analysis()
    assert cost["flops"] > 0 and cost["optimal_seconds"] > 0, cost


def test_two_outputs_a_given_backward_and_a_given_schema(ops):
    """outputs=2 with backward= (its gradients, no jax.vjp), and schema= for a float argument."""
    sin_cos = torchtpu.jax_op(
        "jaxop_test::sin_cos",
        lambda x, w: (jnp.sin(x) * w, jnp.cos(x)),
        outputs=2,
        backward=lambda x, w, g1, g2: (g1 * jnp.cos(x) * w - g2 * jnp.sin(x), jnp.sum(g1 * jnp.sin(x), axis=0)),
    )
    x, w, g1 = _data()
    g2 = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.autograd.backward((torch.sin(xc) * wc, torch.cos(xc)), (g1, g2))
    xt, wt = x.to("tpu").requires_grad_(), w.to("tpu").requires_grad_()
    a, b = sin_cos(xt, wt)
    torch.autograd.backward((a, b), (g1.to("tpu"), g2.to("tpu")))
    close(a, torch.sin(x) * w, "first output")
    close(b, torch.cos(x), "second output")
    close(xt.grad, xc.grad, "x's gradient")
    close(wt.grad, wc.grad, "w's gradient")

    # an integer output (argsort's) has no gradient; the float one's flows through jax.vjp
    sort = torchtpu.jax_op("jaxop_test::sort", lambda x: (jnp.sort(x, axis=-1), jnp.argsort(x, axis=-1)), outputs=2)
    xt = x.to("tpu").requires_grad_()
    values, order = sort(xt)
    values.backward(g1.to("tpu"))
    xc = x.clone().requires_grad_()
    want_values, want_order = torch.sort(xc, -1)
    want_values.backward(g1)
    assert order.dtype == torch.int64 and torch.equal(order.cpu(), want_order)
    close(values, want_values, "sorted values")
    close(xt.grad, xc.grad, "sort's gradient")

    shrink = torchtpu.jax_op(
        "jaxop_test::shrink", lambda x, eps: x / (jnp.abs(x) + eps), schema="(Tensor x, float eps) -> Tensor"
    )
    close(shrink(x.to("tpu"), 0.5), x / (x.abs() + 0.5), "schema= op")


# ----------------------------------------------------------------------------- the errors


def test_mistakes_are_one_clear_error_naming_the_op(ops):
    x = torch.randn(16, 32).to("tpu")
    raw = torchtpu.jax_op("jaxop_test::raw_softmax", pallas_softmax)  # no gradient: no custom_vjp
    torch.testing.assert_close(raw(x).cpu(), torch.softmax(x.cpu(), -1), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="jaxop_test::raw_softmax: a gradient was asked for.*jax.custom_vjp"):
        raw(x.clone().requires_grad_()).sum().backward()

    xg = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(ops["softmax"](xg).square().sum(), (xg,), create_graph=True)
    with pytest.raises(RuntimeError, match="jaxop_test::fused_softmax: its backward is not differentiable again"):
        gx.sum().backward()

    wrong_fake = torchtpu.jax_op("jaxop_test::wrong_fake", lambda x: x * 2, fake=lambda x: x.new_empty((x.shape[0],)))
    with pytest.raises(RuntimeError, match=r"jaxop_test::wrong_fake: output 0 is float32\[16, 32\], the op's fake"):
        wrong_fake(x)

    not_jax = torchtpu.jax_op("jaxop_test::not_jax", lambda x: "done")
    with pytest.raises(RuntimeError, match="jaxop_test::not_jax: fn's output 0 is a str, not a JAX array"):
        not_jax(x)

    with pytest.raises(ValueError, match="'namespace::name'"):
        torchtpu.jax_op("no_namespace", lambda x: x)
    with pytest.raises(RuntimeError, match="jaxop_test::fused_softmax is already defined"):
        torchtpu.jax_op("jaxop_test::fused_softmax", fused_softmax)
    with pytest.raises(RuntimeError, match="jaxop_test::two_specs: 2 out_specs for 1 outputs"):
        torchtpu.jax_op("jaxop_test::two_specs", lambda x: x, out_specs=(P("dp"), P()))

    from torchtpu.distributed import Replicate, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp",))
    odd, w = (distribute_tensor(t, mesh, (Replicate(),)) for t in (torch.randn(12, 32), torch.randn(32)))
    with pytest.raises(RuntimeError, match=r"jaxop_test::tanh_rows: input 'x'.s dim 0 of size 12 does not split into"):
        ops["tanh_rows"](odd, w)  # in_specs (P("dp"), P()): 12 rows over 8 devices


def test_module_parameters_as_a_jax_pytree_and_back():
    """A module's parameters go to JAX as the arrays they hold, a JAX update (an SGD step written with
    jax.tree.map) comes back into the same Parameter objects, and the values equal PyTorch's update."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    want = {name: p.detach() - 0.1 * p.detach() ** 2 for name, p in model.named_parameters()}
    model.to("tpu")
    params = list(model.parameters())
    tree = torchtpu.module_to_jax(model)
    assert all(tree[name] is torchtpu.to_jax(p) for name, p in model.named_parameters())  # no copy
    new = jax.tree.map(lambda p: p - 0.1 * p**2, tree)
    torchtpu.module_from_jax(model, new)
    assert list(model.parameters()) == params
    for name, p in model.named_parameters():
        assert torchtpu.to_jax(p) is new[name]  # no copy back either
        close(p, want[name], name)
    with pytest.raises(KeyError, match=r"not in the module \['bias'\], missing from the tree \['0.bias'\]"):
        torchtpu.module_from_jax(model, {**{k: v for k, v in new.items() if k != "0.bias"}, "bias": new["0.bias"]})
