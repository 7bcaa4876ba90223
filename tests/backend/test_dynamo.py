"""torch.compile(model, backend="tpu"): Dynamo + AOTAutograd graphs lowered through the op table.

PyTorch on CPU (and eager tpu) is the oracle; counters come from torchtpu.cache_stats().
"""

from __future__ import annotations

import copy
import dataclasses
from functools import partial

import pytest
import torch

import torchtpu
from tests.conftest import assert_close_to_cpu

LLAMA_LAYERS = 2


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _delta(before, after):
    return {k: after[k] - before[k] for k in before if isinstance(before[k], int)}


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


_close = partial(assert_close_to_cpu, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- torchtitan Llama 3


def test_llama3_debugmodel_logits_and_grads_match_eager_and_cpu():
    llama3 = pytest.importorskip("torchtitan.models.llama3")
    # The debugmodel flavor, with a short RoPE table (131072 precomputed positions only cost
    # time) and LLAMA_LAYERS of its 6 identical layers: Dynamo/AOTAutograd tracing time grows
    # with the layer count, and every layer is the same code.
    args = dataclasses.replace(copy.deepcopy(llama3.llama3_args["debugmodel"]), max_seq_len=64, n_layers=LLAMA_LAYERS)
    torch.manual_seed(0)
    cpu = llama3.Transformer(args)
    with torch.no_grad():
        cpu.init_weights()
    compiled_model = copy.deepcopy(cpu).to("tpu")
    eager = copy.deepcopy(cpu).to("tpu")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (2, 33), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def loss_of(logits, y):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    before = torchtpu.cache_stats()
    compiled = torch.compile(compiled_model, backend="tpu")
    logits_c = compiled(inputs.to("tpu"))
    loss_of(logits_c, labels.to("tpu")).backward()
    d = _delta(before, torchtpu.cache_stats())
    # one Dynamo graph (no graph breaks), traced once forward and once backward
    assert d["dynamo_compiles"] == 1 and d["dynamo_recompiles"] == 0
    assert d["dynamo_graph_traces"] == 2 and d["dynamo_graph_calls"] == 2

    logits_e = eager(inputs.to("tpu"))
    loss_of(logits_e, labels.to("tpu")).backward()
    logits_cpu = cpu(inputs)
    loss_of(logits_cpu, labels).backward()

    _close(logits_c, logits_cpu, msg="logits vs cpu")
    _close(logits_c, logits_e.cpu(), msg="logits vs eager tpu")
    named_cpu = dict(cpu.named_parameters())
    named_eager = dict(eager.named_parameters())
    n = 0
    for name, p in compiled_model.named_parameters():
        assert p.grad is not None, name
        _close(p.grad, named_cpu[name].grad, msg=f"grad of {name} vs cpu")
        _close(p.grad, named_eager[name].grad.cpu(), msg=f"grad of {name} vs eager tpu")
        n += 1
    assert n == len(named_cpu) > 10


# ----------------------------------------------------------------------------- MLP


def test_mlp_inference_matches_cpu():
    cpu = _mlp()
    model = copy.deepcopy(cpu).to("tpu")
    compiled = torch.compile(model, backend="tpu")
    x = torch.randn(5, 8)
    with torch.no_grad():
        out = compiled(x.to("tpu"))
        ref = cpu(x)
    assert type(out) is torchtpu.TpuTensor
    _close(out, ref, msg="inference")


def test_mlp_training_sgd_steps_match_cpu():
    cpu = _mlp()
    model = copy.deepcopy(cpu).to("tpu")
    compiled = torch.compile(model, backend="tpu")
    opt_cpu = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(4)]
    before = torchtpu.cache_stats()
    losses, losses_cpu = [], []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(compiled(x.to("tpu")), y.to("tpu"))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        opt_cpu.zero_grad()
        loss_cpu = torch.nn.functional.mse_loss(cpu(x), y)
        loss_cpu.backward()
        opt_cpu.step()
        losses_cpu.append(loss_cpu.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_cpu), rtol=1e-4, atol=1e-6)
    for p, q in zip(model.parameters(), cpu.parameters()):
        _close(p, q, msg="parameter after 4 SGD steps")
    d = _delta(before, torchtpu.cache_stats())
    # parameters are graph inputs: updating them in place neither recompiles nor is ignored
    assert d["dynamo_compiles"] == 1 and d["dynamo_graph_traces"] == 2
    assert d["dynamo_graph_calls"] == 8  # forward + backward per step


# ----------------------------------------------------------------------------- graph breaks


def test_graph_break_falls_back_to_eager_and_stays_correct():
    def f(x, w):
        h = torch.tanh(x @ w)
        scale = h.abs().max().item()  # data-dependent Python value: a graph break
        print("scale", scale)  # another one
        return (h / scale).sum(dim=1) + h.mean()

    torch.manual_seed(3)
    x = torch.randn(4, 6)
    w = torch.randn(6, 5, requires_grad=True)
    wt = w.detach().to("tpu").requires_grad_()
    before = torchtpu.cache_stats()
    compiled = torch.compile(f, backend="tpu")
    out = compiled(x.to("tpu"), wt)
    out.sum().backward()
    ref = f(x, w)
    ref.sum().backward()
    _close(out, ref, msg="output across graph breaks")
    _close(wt.grad, w.grad, msg="gradient across graph breaks")
    d = _delta(before, torchtpu.cache_stats())
    assert d["dynamo_compiles"] >= 2  # the code before and after the break are separate graphs


# ----------------------------------------------------------------------------- recompiles


def test_new_shape_recompiles_once_and_is_logged(monkeypatch, capsys):
    monkeypatch.setenv("TORCHTPU_LOG_RECOMPILES", "1")
    model = _mlp()
    tpu = copy.deepcopy(model).to("tpu")
    compiled = torch.compile(tpu, backend="tpu")

    def call(n):
        x = torch.randn(n, 8)
        with torch.no_grad():
            out = compiled(x.to("tpu"))
            _close(out, model(x), msg=f"batch {n}")

    call(4)
    call(4)
    s0 = torchtpu.cache_stats()
    capsys.readouterr()
    call(6)
    s1 = torchtpu.cache_stats()
    err = capsys.readouterr().err
    d = _delta(s0, s1)
    assert d["dynamo_compiles"] == 1 and d["dynamo_recompiles"] == 1, d
    assert d["dynamo_graph_traces"] == 1
    lines = [ln for ln in err.splitlines() if "recompiling" in ln]
    assert len(lines) == 1, err
    assert "shape changed from [4, 8] to [6, 8]" in lines[0] and "L['args'][0]" in lines[0], lines[0]

    call(6)
    call(4)  # both shapes now have a graph: no recompile either way
    s2 = torchtpu.cache_stats()
    d = _delta(s1, s2)
    assert d["dynamo_compiles"] == 0 and d["dynamo_graph_traces"] == 0 and d["xla_compiles"] == 0, d
    assert "recompiling" not in capsys.readouterr().err

    # static shapes by default (no automatic dynamic): a third shape is one more static graph
    call(7)
    d = _delta(s2, torchtpu.cache_stats())
    assert d["dynamo_recompiles"] == 1 and d["dynamo_graph_traces"] == 1


# ----------------------------------------------------------------------------- launches


def test_warm_forward_is_one_xla_launch_per_graph():
    model = copy.deepcopy(_mlp()).to("tpu")
    compiled = torch.compile(model, backend="tpu")
    x = torch.randn(3, 8).to("tpu")
    with torch.no_grad():
        compiled(x)
        compiled(x)
        before = torchtpu.cache_stats()
        out = compiled(x)
        after = torchtpu.cache_stats()
    d = _delta(before, after)
    assert d["dynamo_graph_calls"] == 1  # one captured graph, one executable launch
    assert d["calls"] == 0  # and no eager op executables around it
    assert d["xla_compiles"] == 0 and d["dynamo_compiles"] == 0 and d["dynamo_graph_traces"] == 0
    assert out.shape == (3, 4)

    # training: one forward and one backward launch per step, nothing else from the model
    loss = compiled(x).sum()
    loss.backward()
    before = torchtpu.cache_stats()
    out = compiled(x)
    after_fw = torchtpu.cache_stats()
    out.backward(torch.ones_like(out))
    after_bw = torchtpu.cache_stats()
    d = _delta(before, after_fw)
    assert d["dynamo_graph_calls"] == 1 and d["calls"] == 0, d
    d = _delta(after_fw, after_bw)
    assert d["dynamo_graph_calls"] == 1 and d["dynamo_graph_traces"] == 0, d
