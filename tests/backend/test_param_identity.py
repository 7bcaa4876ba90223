"""Module moves keep Parameter objects, as on CUDA (PyTorch on CPU is the numerical oracle).

Tolerances: float32 training, rtol 1e-5 / atol 1e-6 on weights after a few optimizer steps
(the same ops in the same order on XLA:CPU and PyTorch CPU differ in the last bits only).
"""

import copy
from functools import partial

import pytest
import torch
import torch.nn as nn

import torchtpu  # noqa: F401
from tests.conftest import assert_close_to_cpu
from torchtpu.backend.tensor import TpuTensor, storage_of

RTOL, ATOL = 1e-5, 1e-6


class TiedLM(nn.Module):
    def __init__(self, vocab=16, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied input/output embeddings

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def _loss(model, ids):
    return model(ids).float().logsumexp(-1).mean()


def _train(model, opt, ids, steps=5):
    for _ in range(steps):
        opt.zero_grad()
        _loss(model, ids).backward()
        opt.step()


def _pair(seed=0):
    torch.manual_seed(seed)
    cpu = TiedLM()
    tpu = copy.deepcopy(cpu)  # deepcopy keeps the tie
    assert tpu.head.weight is tpu.embed.weight
    return cpu, tpu


_assert_close = partial(assert_close_to_cpu, rtol=RTOL, atol=ATOL)


def test_tied_weights_keep_identity_and_train_like_cpu():
    cpu, model = _pair()
    shared = model.embed.weight
    model.to("tpu")
    assert model.embed.weight is shared and model.head.weight is shared
    assert type(shared) is TpuTensor and isinstance(shared, nn.Parameter)
    assert len(list(model.parameters())) == 3  # embed (shared), mid.weight, mid.bias
    ids = torch.randint(0, 16, (4, 6))
    _train(cpu, torch.optim.AdamW(cpu.parameters(), lr=0.05), ids)
    _train(model, torch.optim.AdamW(model.parameters(), lr=0.05), ids.to("tpu"))
    assert model.head.weight is model.embed.weight
    for p, q in zip(model.parameters(), cpu.parameters()):
        _assert_close(p, q)
    # one tensor on tpu: the two module attributes share one storage
    assert storage_of(model.head.weight) is storage_of(model.embed.weight)


def test_optimizer_built_before_the_move_trains_the_model():
    cpu, model = _pair(1)
    before = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)  # holds the CPU-era objects
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to("tpu")
    for n, p in model.named_parameters():
        assert p is before[n]
    ids = torch.randint(0, 16, (4, 6))
    _train(cpu, torch.optim.AdamW(cpu.parameters(), lr=0.05), ids)
    _train(model, opt, ids.to("tpu"))
    for (n, p), (_, q) in zip(model.named_parameters(), cpu.named_parameters()):
        assert not torch.equal(p.detach().cpu(), start[n]), f"{n} did not change"
        _assert_close(p, q)


def test_sgd_state_and_grad_move_with_the_parameter():
    torch.manual_seed(2)
    lin = nn.Linear(4, 3)
    ref = copy.deepcopy(lin)
    x = torch.randn(5, 4)
    lin(x).sum().backward()
    ref(x).sum().backward()
    w = lin.weight
    lin.to("tpu")
    assert lin.weight is w and w.grad is not None and w.grad.device.type == "tpu"
    _assert_close(w.grad, ref.weight.grad)


def test_hooks_survive_the_move():
    torch.manual_seed(3)
    lin = nn.Linear(4, 3)
    seen, accumulated = [], []
    lin.weight.register_hook(lambda g: seen.append(g.device.type))
    lin.weight.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.device.type))
    lin.to("tpu")
    lin(torch.randn(2, 4, device="tpu")).sum().backward()
    assert seen == ["tpu"] and accumulated == ["tpu"]


def test_hook_can_change_the_gradient_after_the_move():
    torch.manual_seed(4)
    lin = nn.Linear(4, 3)
    ref = copy.deepcopy(lin)
    for m in (lin, ref):
        m.weight.register_hook(lambda g: g * 3)
    lin.to("tpu")
    x = torch.randn(2, 4)
    lin(x.to("tpu")).sum().backward()
    ref(x).sum().backward()
    _assert_close(lin.weight.grad, ref.weight.grad)


def test_parameter_registered_in_two_modules():
    torch.manual_seed(5)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    model = nn.Sequential(a, nn.ReLU(), b)
    ref = copy.deepcopy(model)
    w = a.weight
    model.to("tpu")
    assert model[0].weight is w and model[2].weight is w
    x = torch.randn(3, 4)
    model(x.to("tpu")).square().sum().backward()
    ref(x).square().sum().backward()
    _assert_close(w.grad, ref[0].weight.grad)  # the sum of both uses' gradients


def test_parameter_that_is_a_view():
    torch.manual_seed(6)
    base = torch.randn(6, 4)
    m = nn.Module()
    m.p = nn.Parameter(base[2:5].t())  # a strided view of another tensor
    p = m.p
    ref = p.detach().clone()
    m.to("tpu")
    assert m.p is p and p.device.type == "tpu"
    assert p.shape == ref.shape and p.stride() == ref.stride()
    _assert_close(p, ref)
    (p * torch.arange(3.0, device="tpu")).sum().backward()
    _assert_close(p.grad, torch.arange(3.0).expand(4, 3))


def test_user_attributes_survive_the_move():
    lin = nn.Linear(2, 2)
    lin.weight._is_hf_initialized = True
    w = lin.weight
    lin.to("tpu")
    assert lin.weight is w and w._is_hf_initialized is True
    lin.cpu()
    assert lin.weight is w and w._is_hf_initialized is True


def test_to_tpu_with_dtype_then_cpu_back():
    torch.manual_seed(7)
    lin = nn.Linear(4, 3)
    ref = copy.deepcopy(lin)
    w = lin.weight
    lin.to("tpu", torch.bfloat16)
    assert lin.weight is w and w.dtype == torch.bfloat16 and w.device.type == "tpu"
    torch.testing.assert_close(w.detach().cpu(), ref.weight.detach().to(torch.bfloat16), rtol=0, atol=0)
    lin.float()  # a dtype change within tpu keeps the object and converts the values
    assert lin.weight is w and w.dtype == torch.float32 and w.device.type == "tpu"
    _assert_close(w, ref.weight.to(torch.bfloat16).float())
    lin.cpu()
    assert lin.weight is w and type(w) is nn.Parameter and w.device.type == "cpu"
    torch.testing.assert_close(w.detach(), ref.weight.detach().to(torch.bfloat16).float(), rtol=0, atol=0)


def test_double_after_tpu_changes_values_not_only_metadata():
    torch.manual_seed(8)
    lin = nn.Linear(3, 2).to("tpu")
    lin.double()
    assert lin.weight.dtype == torch.float64
    out = lin(torch.ones(1, 3, dtype=torch.float64, device="tpu"))
    assert out.dtype == torch.float64 and out.cpu().dtype == torch.float64


def test_to_empty_on_tpu_keeps_meta_parameters():
    with torch.device("meta"):
        lin = nn.Linear(3, 2)
    w = lin.weight
    lin.to_empty(device="tpu")
    assert lin.weight is w and w.device.type == "tpu"
    with torch.no_grad():
        w.fill_(2.0)
    assert torch.equal(lin.weight.cpu(), torch.full((2, 3), 2.0))


def test_data_assignment_on_a_tpu_parameter():
    lin = nn.Linear(3, 2).to("tpu")
    w = lin.weight
    w.data = torch.ones(2, 3, device="tpu", dtype=torch.float64)
    assert lin.weight is w and w.dtype == torch.float64
    assert torch.equal(w.detach().cpu(), torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        w.data = torch.zeros(2, 3)


def test_load_state_dict_keeps_objects_and_assign_takes_the_given_tensors():
    torch.manual_seed(9)
    src = nn.Linear(4, 3)
    model = nn.Linear(4, 3).to("tpu")
    w = model.weight
    model.load_state_dict(src.state_dict())  # copy_ into the tpu parameters
    assert model.weight is w and w.device.type == "tpu"
    _assert_close(w, src.weight)
    tpu_sd = {k: v.to("tpu") for k, v in src.state_dict().items()}
    model.load_state_dict(tpu_sd, assign=True)  # as on CUDA: the module now holds these values
    assert isinstance(model.weight, nn.Parameter) and model.weight.device.type == "tpu"
    assert storage_of(model.weight) is storage_of(tpu_sd["weight"])
    _assert_close(model.weight, src.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = copy.deepcopy(src)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    for m, o, xx in ((model, opt, x.to("tpu")), (ref, ropt, x)):
        o.zero_grad()
        m(xx).square().sum().backward()
        o.step()
    _assert_close(model.weight, ref.weight)


def test_cpu_module_moves_are_untouched():
    # a move that involves no tpu tensor follows PyTorch's own rules (here: set_data)
    lin = nn.Linear(2, 2)
    w = lin.weight
    lin.double()
    assert lin.weight is w and w.dtype == torch.float64
    assert not torch.__future__.get_swap_module_params_on_conversion()


def test_a_move_refused_while_a_graph_holds_a_parameter_moves_nothing():
    """PyTorch swaps a module's parameters one by one and raises at the first one an autograd graph
    still holds (LayerNorm saves its weight), leaving the ones before it moved; the move is refused
    before it starts, and goes through once the graph is gone."""
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).to("tpu")
    params = list(m.parameters())
    out = m(torch.randn(2, 4, device="tpu")).sum()  # a graph that saved the LayerNorm's weight
    with pytest.raises(RuntimeError, match=r"cannot move parameter 1\.weight .*del loss.*nothing has been moved"):
        m.to("cpu")
    assert all(type(p) is TpuTensor for p in m.parameters())
    out.backward()
    m.to("cpu")
    assert [p.device.type for p in m.parameters()] == ["cpu"] * 4
    assert all(a is b for a, b in zip(m.parameters(), params))
    assert params[2].grad is not None and params[2].grad.device.type == "cpu"
