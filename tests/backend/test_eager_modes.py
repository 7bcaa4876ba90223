"""The eager modes (strict, fused, debug) and fused eager's semantics, against PyTorch on CPU.

Fused mode records ops and runs them as one XLA program when a value is needed; these tests
hold its results to the CPU's (and to strict mode's where random numbers are involved),
check what makes it run (flush) and that a repeating training step compiles nothing once it
has settled. The training loops are bench/eager_modes.py's, at small shapes.
"""

from __future__ import annotations

import io

import pytest
import torch

import torchtpu
from bench.eager_modes import make_loop, on_device, train_step
from torchtpu._platform import XLA_COMPILES
from torchtpu.backend import fused
from torchtpu.backend.state import CONFIG


def flushes() -> int:
    return torchtpu.cache_stats()["fused_flushes"]


def runs() -> int:
    return torchtpu.cache_stats()["fused_runs"]


@pytest.fixture
def asynchronous(monkeypatch):
    """Programs not waited for, as on a TPU and on the CPU platform until a device mesh exists
    (a test before this one in the same process may have made one: backend.state.note_mesh).
    A flush waits for its programs one by one with a mesh there, so it runs one."""
    monkeypatch.setattr(CONFIG, "sync_dispatch", False)


# ----------------------------------------------------------------------------- the switch


def test_mode_switch_and_context_manager():
    with torchtpu.eager_mode("strict"):
        assert torchtpu.get_eager_mode() == "strict"
        with torchtpu.eager_mode("fused"):
            assert torchtpu.get_eager_mode() == "fused"
            with torchtpu.eager_mode("debug"):
                assert torchtpu.get_eager_mode() == "debug"
            assert torchtpu.get_eager_mode() == "fused"
        assert torchtpu.get_eager_mode() == "strict"
        with pytest.raises(ValueError, match="unknown torchtpu eager mode 'lazy'"):
            torchtpu.set_eager_mode("lazy")
        assert torchtpu.get_eager_mode() == "strict"


def test_debug_mode_names_the_op_that_made_a_nan():
    x = torch.tensor([-1.0, 4.0]).to("tpu")
    with torchtpu.eager_mode("debug"), pytest.raises(FloatingPointError, match="sqrt"):
        torch.sqrt(x)
    with torchtpu.eager_mode("strict"):
        torch.sqrt(x)  # no check


def test_environment_chooses_the_mode(monkeypatch):
    from torchtpu.backend.state import _mode_from_environment

    monkeypatch.delenv("TORCHTPU_EAGER_MODE", raising=False)
    monkeypatch.delenv("TORCHTPU_DEBUG", raising=False)
    assert _mode_from_environment() == "strict"
    monkeypatch.setenv("TORCHTPU_DEBUG", "1")  # today's switch for debug mode
    assert _mode_from_environment() == "debug"
    monkeypatch.setenv("TORCHTPU_EAGER_MODE", "fused")
    assert _mode_from_environment() == "fused"
    monkeypatch.setenv("TORCHTPU_EAGER_MODE", "eager")
    with pytest.raises(ValueError, match="TORCHTPU_EAGER_MODE='eager'"):
        _mode_from_environment()


# ----------------------------------------------------------------------------- flush triggers


@pytest.fixture
def recorded():
    """In fused mode: a CPU tensor and its tpu twin after a few recorded ops (nothing run yet)."""
    with torchtpu.eager_mode("fused"):
        cpu = torch.arange(12.0).reshape(3, 4)
        t = cpu.to("tpu")
        before = flushes()
        cpu, t = (cpu * 2 - 1).T.exp(), (t * 2 - 1).T.exp()
        assert flushes() == before
        yield cpu, t, before


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.cpu(),
        lambda t: t.sum().item(),
        lambda t: t.tolist(),
        lambda t: repr(t).removesuffix(")").removesuffix(", device='tpu:0'"),
        lambda t: bool((t > 0).all()),
        lambda t: torch.load(io.BytesIO(_saved(t)), map_location="cpu"),
    ],
    ids=["cpu", "item", "tolist", "print", "bool", "torch.save"],
)
def test_reading_a_value_runs_the_graph(recorded, read):
    cpu, t, before = recorded
    got = read(t)
    assert flushes() == before + 1
    want = read(cpu)
    if isinstance(want, str):
        assert got == want
    else:
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want))


def _saved(t):
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_synchronize_runs_the_graph(recorded):
    cpu, t, before = recorded
    torch.tpu.synchronize()
    assert flushes() == before + 1
    torch.testing.assert_close(t.cpu(), cpu)


def test_a_long_graph_runs_at_the_bound(monkeypatch):
    monkeypatch.setattr(fused, "MAX_OPS", 5)
    with torchtpu.eager_mode("fused"):
        t = torch.ones(3).to("tpu")
        before = flushes()
        for _ in range(12):
            t = t * 2
        assert flushes() == before + 2  # at 5 and 10 ops, nothing read
        assert t.tolist() == [4096.0] * 3


@pytest.mark.usefixtures("asynchronous")
def test_a_read_runs_the_ops_it_needs_first():
    """Reading a value runs the ops it needs as a program of their own and the other recorded ops
    (at least fused.SPLIT_MIN_REST of them) as a second program, which the read does not wait for;
    the overwritten buffer goes to the program that reads it last. A read that needs (nearly)
    every op runs one program."""

    def ops(x, w):
        loss = (x * 3).sum()
        for i in range(fused.SPLIT_MIN_REST):
            w.mul_(0.5).add_(x * i)  # x is read by both programs
        x.add_(1)  # x's old buffer is dead from here on
        return loss

    x0, w0 = torch.arange(6.0), torch.ones(6)
    x_cpu, w_cpu = x0.clone(), w0.clone()
    loss_cpu = ops(x_cpu, w_cpu)
    with torchtpu.eager_mode("fused"):
        x, w = x0.to("tpu"), w0.to("tpu")
        loss = ops(x, w)
        r, f = runs(), flushes()
        assert loss.item() == loss_cpu.item()
        assert (runs() - r, flushes() - f) == (2, 1)
        torch.testing.assert_close(w.cpu(), w_cpu)
        torch.testing.assert_close(x.cpu(), x_cpu)
        assert runs() - r == 2  # w and x came from the second program

        for _ in range(fused.SPLIT_MIN_REST):
            w.mul_(0.5)
        r = runs()
        assert w.sum().item() == pytest.approx((w_cpu * 0.5**fused.SPLIT_MIN_REST).sum().item())
        assert runs() - r == 1


# ----------------------------------------------------------------------------- semantics


def test_overwritten_buffers_are_donated_and_held_ones_kept():
    """A buffer an in-place op overwrote goes to the program (donated) when nothing else holds it;
    one that Python still holds (here through to_jax) stays readable."""
    with torchtpu.eager_mode("fused"):
        w, held = torch.ones(4).to("tpu"), torch.ones(4).to("tpu")
        kept = torchtpu.to_jax(held)
        before = torchtpu.cache_stats()["fused_donated"]
        w.mul_(2)
        held.mul_(3)
        assert w.tolist() == [2.0] * 4 and held.tolist() == [3.0] * 4
        assert torchtpu.cache_stats()["fused_donated"] == before + 1  # w's old buffer
        assert kept.tolist() == [1.0] * 4


def test_views_and_in_place_ops_match_cpu():
    def program(x):
        base = x.clone()
        row = base[1]
        row.add_(10)  # a write through a view
        base.T.mul_(2)  # through another
        col = base[:, 2]
        base.sub_(1)  # the views see it
        y = col * 3 + row.sum()
        z = base.view(-1)[::5]
        z.fill_(-7)
        return base, row, col, y

    x = torch.arange(12.0).reshape(3, 4)
    want = program(x)
    with torchtpu.eager_mode("fused"):
        before = flushes()
        got = program(x.to("tpu"))
        assert flushes() == before  # all recorded
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w)
        assert flushes() == before + 1


def test_dtype_promotion_and_cast_errors_match_cpu():
    i = torch.arange(6, dtype=torch.int32)
    with torchtpu.eager_mode("fused"):
        t = i.to("tpu")
        mixed = t * 1.5 + torch.ones(6, dtype=torch.float16).to("tpu")
        assert mixed.dtype == (i * 1.5 + torch.ones(6, dtype=torch.float16)).dtype
        torch.testing.assert_close(mixed.cpu(), i * 1.5 + torch.ones(6, dtype=torch.float16))
        with pytest.raises(RuntimeError, match="can't be cast"):
            t.add_(1.5)


def test_an_op_on_a_mesh_fails_where_it_is_recorded():
    """A recorded op's output shapes, and its errors, are worked out with the layouts its inputs
    have on the mesh: a jax_op whose input does not split into its in_specs' shards raises at the
    call, and the graph it would have joined runs on."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from torchtpu.distributed import Replicate, distribute_tensor, init_device_mesh

    op = torchtpu.jax_op("fusedtest::rows_tanh", jnp.tanh, in_specs=(P("dp"),), out_specs=P("dp"))
    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp",))
    odd, even = torch.randn(12, 4), torch.randn(16, 4)
    with torchtpu.eager_mode("fused"):
        kept = distribute_tensor(even, mesh, (Replicate(),)) * 2
        with pytest.raises(RuntimeError, match="fusedtest::rows_tanh: input 'x'.s dim 0 of size 12 does not split"):
            op(distribute_tensor(odd, mesh, (Replicate(),)))
        torch.testing.assert_close(op(kept).full_tensor().cpu(), torch.tanh(even * 2))


def test_memory_statistics_count_what_was_recorded():
    """torch.tpu.memory_allocated() counts the outputs of the ops recorded so far (they run first),
    as CUDA's counts a launched kernel's outputs before it finishes."""
    with torchtpu.eager_mode("fused"):
        x = torch.ones(1024, 1024, device="tpu")  # 4 MiB
        torch.tpu.synchronize()
        torch.tpu.reset_peak_memory_stats()
        base = torch.tpu.memory_allocated()
        y = x * 2  # recorded
        assert torch.tpu.memory_allocated() >= base + 4 * 2**20
        assert torch.tpu.max_memory_allocated() >= base + 4 * 2**20
        del x, y


def test_compiled_step_with_abstract_warmup_over_recorded_state():
    """Optimizer state made in fused mode (recorded, not yet run) is read by torchtpu.compile's
    warm-up on shapes: the recorded ops run on their arrays, not into the traced function, and
    the compiled steps equal PyTorch's on the CPU."""

    def make(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=device == "tpu")
        for p in model.parameters():
            opt.state[p] = {"step": torch.tensor(0.0, device=device)}
            opt.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)  # no gradient kept between calls
            return loss

        return step

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)]
    cpu_step = make("cpu")
    want = [cpu_step(x, y).item() for x, y in batches]
    with torchtpu.eager_mode("fused"):
        step = torchtpu.compile(make("tpu"), warmup="abstract")
        got = [step(x.to("tpu"), y.to("tpu")).item() for x, y in batches]
    assert got == pytest.approx(want, rel=1e-5)


def test_random_streams_equal_strict():
    def draws():
        torch.manual_seed(7)
        x = torch.randn(4, 8, device="tpu")
        d = torch.nn.functional.dropout(x, 0.5)
        return [x.cpu(), d.cpu(), torch.rand(3, device="tpu").cpu()]

    strict = draws()
    with torchtpu.eager_mode("fused"):
        fused_draws = draws()
    for a, b in zip(strict, fused_draws):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- the tutorial loops

SMALL = {
    "quickstart": dict(batch=4),
    "cifar": dict(batch=2),
    "encoder": dict(batch=2, seq=8),
    "llama": dict(batch=2, seq=8),
}


@pytest.mark.usefixtures("asynchronous")
@pytest.mark.parametrize("name", ["quickstart", "cifar", "encoder", "llama"])
def test_fused_loop_equals_cpu_and_settles(name, monkeypatch):
    """Four steps reading loss.item(): losses equal PyTorch's on the CPU, each step runs one
    graph as two programs (the loss's ops first, then the rest: the backward and the optimizer
    step, which the read does not wait for), and the steps after the optimizer's state exists
    compile nothing. The bound on dropped inputs a graph holds (1 KiB here) does not split a
    step: the old parameters and optimizer state it drops are reused by their new values."""
    monkeypatch.setattr(fused, "MAX_HELD_BYTES", 1024)
    model, make_opt, loss_fn, batches = make_loop(name, **SMALL[name])
    cpu_step = train_step(model, make_opt(model.parameters()), loss_fn)
    want = [cpu_step(*batches[i]).item() for i in range(4)]
    with torchtpu.eager_mode("fused"):
        step, tpu_batches = on_device(name, "tpu", **SMALL[name])
        got, compiled, ran, programs, donated = [], [], [], [], []
        for i in range(4):
            c, f, r, d = XLA_COMPILES[0], flushes(), runs(), torchtpu.cache_stats()["fused_donated"]
            got.append(step(*tpu_batches[i]).item())
            compiled.append(XLA_COMPILES[0] - c)
            ran.append(flushes() - f)
            programs.append(runs() - r)
            donated.append(torchtpu.cache_stats()["fused_donated"] - d)
    assert got == pytest.approx(want, rel=1e-4)
    assert ran == [1, 1, 1, 1]
    assert programs == [2, 2, 2, 2]
    assert compiled[2:] == [0, 0]
    assert donated[-1] > 0  # the old parameters and optimizer state


def test_dropout_training_equals_strict():
    """Training with dropout: fused and strict draw the same masks, so the losses agree."""

    def losses():
        torch.manual_seed(3)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.ReLU(), torch.nn.Linear(16, 2)
        )
        model = model.to("tpu")
        step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy)
        x, y = (
            torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).to("tpu"),
            torch.tensor([0, 1, 1, 0]).to("tpu"),
        )
        return [step(x, y).item() for _ in range(3)]

    strict = losses()
    with torchtpu.eager_mode("fused"):
        assert losses() == pytest.approx(strict, rel=1e-5)


# ----------------------------------------------------------------------------- device meshes


def test_tensor_parallel_training_on_a_mesh_equals_strict():
    """A 2 x 4 mesh (data x tensor parallel): an MLP's up and down projections split column- and
    row-wise, the batch split over the data axis, AdamW. Fused steps run one program each, give
    strict's losses and weights, and leave parameters and optimizer state in strict's layouts."""
    from torchtpu.distributed import (
        ColwiseParallel,
        Replicate,
        RowwiseParallel,
        Shard,
        distribute_tensor,
        init_device_mesh,
        parallelize_module,
    )

    mesh = init_device_mesh("tpu", (2, 4), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 16, generator=g) for _ in range(3)]

    def train():
        torch.manual_seed(0)
        m = torch.nn.Sequential(
            torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)
        )
        m = parallelize_module(m.to("tpu"), mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        step = train_step(m, opt, lambda out, _: out.square().mean())
        losses, ran = [], []
        for x in xs:
            f = flushes()
            losses.append(step(distribute_tensor(x, mesh, (Shard(0), Replicate())), None).item())
            ran.append(flushes() - f)
        state = [p for p in m.parameters()] + [v for s in opt.state.values() for v in s.values() if v.dim()]
        return losses, ran, [(t.detach().cpu(), torchtpu.to_jax(t).sharding) for t in state]

    strict_losses, _, strict_state = train()
    with torchtpu.eager_mode("fused"):
        losses, ran, state = train()
    assert ran == [1, 1, 1]
    assert losses == pytest.approx(strict_losses, rel=1e-6)
    assert len(state) == len(strict_state) == 18
    for (got, layout), (want, strict_layout) in zip(state, strict_state):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # XLA rounds a fused program differently
        assert layout.is_equivalent_to(strict_layout, got.dim()), (layout, strict_layout)


def test_a_value_on_one_device_written_into_a_mesh_layout():
    """A value committed to one device, written into a tensor laid out over the mesh: strict eager
    moves it (device_put); fused mode cannot put both in one program, so it runs the graph first and
    moves it as strict does. An op that mixes the two raises at the call, with strict's error
    (PyTorch's for tensors on two devices)."""
    import jax
    import numpy as np

    from torchtpu.distributed import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp",))
    got = {}
    for mode in ("strict", "fused"):
        with torchtpu.eager_mode(mode):
            one = torchtpu.from_jax(jax.device_put(np.arange(16, dtype=np.float32), jax.devices()[0]))
            w = distribute_tensor(torch.zeros(16), mesh, (Shard(0),))
            twice = w * 3 + 1  # recorded on the mesh before the write
            part = one[4:8] - 1  # a view of the one-device value, read while the graph is on the mesh
            w.copy_(one * 2)
            with pytest.raises(RuntimeError, match="same device.*laid out over 8 devices"):
                twice + one
            got[mode] = (w.full_tensor().cpu(), twice.full_tensor().cpu(), part.cpu(), torchtpu.to_jax(w).sharding)
    torch.testing.assert_close(got["fused"][0], torch.arange(16.0) * 2)
    torch.testing.assert_close(got["fused"][1], torch.ones(16))
    torch.testing.assert_close(got["fused"][2], torch.arange(3.0, 7.0))
    assert got["fused"][3] == got["strict"][3] and not got["fused"][3].is_fully_replicated
    with torchtpu.eager_mode("fused"):
        torch.tpu.synchronize()
        with pytest.raises(RuntimeError, match="same device.*laid out over 8 devices"):
            one + w  # the first op of a graph, its inputs on different devices
        torch.testing.assert_close((w * 2 + 1).full_tensor().cpu(), torch.arange(16.0) * 4 + 1)


@pytest.mark.usefixtures("asynchronous")
def test_a_loop_that_never_reads_runs_one_graph_at_a_time(monkeypatch):
    """A loop that reads nothing records batches faster than the device computes them. The flush
    of a graph past its bound waits for the programs of every earlier flush, so the device never
    has more than one graph's programs queued (each holding its batches until it runs): whenever a
    new flush has run, every prediction the flushes before it computed is ready."""
    import jax

    monkeypatch.setattr(fused, "MAX_HELD_BYTES", 2**20)
    g = torch.Generator().manual_seed(0)
    cpu_model = torch.nn.Conv2d(3, 32, 5)
    batches = [torch.randn(16, 3, 64, 64, generator=g) for _ in range(30)]  # 768 KiB each

    def array(t):
        a = t._st.pending_array()
        assert isinstance(a, jax.Array), "a prediction of a flushed graph holds its array"
        return a

    with torchtpu.eager_mode("fused"):
        model = torch.nn.Conv2d(3, 32, 5).to("tpu")
        model.load_state_dict(cpu_model.state_dict())
        torch.tpu.synchronize()
        f = flushes()
        preds, start, checked = [], 0, 0
        with torch.no_grad():
            for x in batches:
                n = len(preds)
                preds.append(model(x.to("tpu")).mean((1, 2, 3)))
                if flushes() > f:  # a flush ran while this batch was recorded
                    f = flushes()
                    assert all(array(p).is_ready() for p in preds[:start])
                    checked += start
                    start = n
        got = torch.stack(preds).cpu()
    assert checked > 40
    with torch.no_grad():
        want = torch.stack([cpu_model(x).mean((1, 2, 3)) for x in batches])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_loop_that_never_reads_does_not_hold_its_batches(monkeypatch):
    """Batches moved to the device and dropped, with nothing read: strict eager frees each batch
    after its ops; fused mode runs the graph once the dropped inputs it holds, which no output
    reuses, pass the bound (TORCHTPU_FUSED_MAX_HELD_MB; 1 MiB here), rather than at MAX_OPS."""
    monkeypatch.setattr(fused, "MAX_HELD_BYTES", 2**20)
    g = torch.Generator().manual_seed(0)
    cpu_model = torch.nn.Linear(256, 4)
    batches = [torch.randn(256, 256, generator=g) for _ in range(24)]  # 256 KiB each
    with torchtpu.eager_mode("fused"):
        model = torch.nn.Linear(256, 4).to("tpu")
        model.load_state_dict(cpu_model.state_dict())
        torch.tpu.synchronize()  # a new graph, under the bound set here
        f = flushes()
        sums, held = [], []
        with torch.no_grad():  # inference: nothing saved for a backward keeps a batch alive
            for x in batches:
                sums.append(model(x.to("tpu")).sum(0))
                graph = fused._GRAPH
                held.append(sum(graph.inputs[i].nbytes for i in fused._dead_inputs(graph.inputs)))
        ran = flushes() - f
        got = torch.stack(sums).cpu()
    assert max(held) <= 1.25 * 2**20 + 256 * 1024
    assert ran >= 4
    with torch.no_grad():
        torch.testing.assert_close(got, torch.stack([cpu_model(x).sum(0) for x in batches]), rtol=1e-4, atol=1e-4)
