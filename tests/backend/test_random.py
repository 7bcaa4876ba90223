"""Random ops on tpu: reproducibility under manual_seed, statistics, integer ranges, RNG state."""

import pytest
import torch

import torchtpu  # noqa: F401

D = "tpu"
N = 200_000


def cpu(t):
    return t.cpu()


def test_manual_seed_reproducible():
    torch.manual_seed(123)
    a = cpu(torch.randn(64, device=D))
    b = cpu(torch.rand(64, device=D))
    torch.manual_seed(123)
    a2 = cpu(torch.randn(64, device=D))
    b2 = cpu(torch.rand(64, device=D))
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert not torch.equal(a, cpu(torch.randn(64, device=D)))  # the stream advances


def test_different_seeds_differ():
    torch.manual_seed(1)
    a = cpu(torch.rand(32, device=D))
    torch.manual_seed(2)
    b = cpu(torch.rand(32, device=D))
    assert not torch.equal(a, b)


def test_tpu_manual_seed_module():
    torch.tpu.manual_seed(7)
    a = cpu(torch.randint(0, 1000, (32,), device=D))
    torch.tpu.manual_seed_all(7)
    b = cpu(torch.randint(0, 1000, (32,), device=D))
    assert torch.equal(a, b)
    assert torch.tpu.initial_seed() == 7


def test_rng_state_round_trip():
    torch.manual_seed(5)
    torch.rand(3, device=D)
    state = torch.tpu.get_rng_state()
    assert state.dtype == torch.uint8
    a = cpu(torch.randn(16, device=D))
    torch.rand(100, device=D)
    torch.tpu.set_rng_state(state)
    b = cpu(torch.randn(16, device=D))
    assert torch.equal(a, b)


def test_fork_rng():
    torch.manual_seed(9)
    with torch.random.fork_rng(devices=[0], device_type="tpu"):
        a = cpu(torch.rand(8, device=D))
    b = cpu(torch.rand(8, device=D))
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_uniform_stats(dtype):
    x = cpu(torch.rand(N, device=D, dtype=dtype)).double()
    assert x.min() >= 0 and x.max() < 1
    assert abs(x.mean() - 0.5) < 0.01
    assert abs(x.var() - 1 / 12) < 0.005


def test_uniform_range():
    x = cpu(torch.empty(N, device=D).uniform_(-2, 3))
    assert x.min() >= -2 and x.max() < 3
    assert abs(x.mean() - 0.5) < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normal_stats(dtype):
    x = cpu(torch.randn(N, device=D, dtype=dtype))
    assert abs(x.mean()) < 0.01
    assert abs(x.std() - 1) < 0.01


def test_normal_overloads():
    x = cpu(torch.empty(N, device=D).normal_(3.0, 2.0))
    assert abs(x.mean() - 3) < 0.03 and abs(x.std() - 2) < 0.03
    mean = torch.full((N,), -1.0, device=D)
    std = torch.full((N,), 0.5, device=D)
    for y in (torch.normal(mean, std), torch.normal(mean, 0.5), torch.normal(-1.0, std)):
        y = cpu(y)
        assert y.shape == (N,)
        assert abs(y.mean() + 1) < 0.01 and abs(y.std() - 0.5) < 0.01
    z = torch.normal(2.0, 3.0, (1000,), device=D)
    assert z.device.type == "tpu" and z.shape == (1000,)


def test_randn_complex():
    x = cpu(torch.randn(N, device=D, dtype=torch.complex64))
    assert abs(x.real.var() - 0.5) < 0.01 and abs(x.imag.var() - 0.5) < 0.01


def test_bernoulli_rate():
    p = torch.full((N,), 0.3, device=D)
    x = cpu(torch.bernoulli(p))
    assert set(x.unique().tolist()) <= {0.0, 1.0}
    assert abs(x.mean() - 0.3) < 0.01
    y = cpu(torch.empty(N, device=D).bernoulli_(0.8))
    assert abs(y.mean() - 0.8) < 0.01
    z = cpu(torch.empty(N, device=D).bernoulli_(torch.full((N,), 0.1, device=D)))
    assert abs(z.mean() - 0.1) < 0.01


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.float32])
def test_randint_range(dtype):
    x = cpu(torch.randint(-3 if dtype != torch.uint8 else 0, 5, (N,), device=D, dtype=dtype))
    lo = -3 if dtype != torch.uint8 else 0
    assert x.dtype == dtype
    assert x.min() == lo and x.max() == 4  # low inclusive, high exclusive
    counts = torch.bincount((x - lo).long())
    assert counts.shape[0] == 5 - lo
    assert (counts.double() / N - 1 / (5 - lo)).abs().max() < 0.01


def test_random_inplace_ranges():
    x = cpu(torch.empty(N, device=D, dtype=torch.int64).random_(10))
    assert x.min() == 0 and x.max() == 9
    y = cpu(torch.empty(N, device=D, dtype=torch.int64).random_(-5, 5))
    assert y.min() == -5 and y.max() == 4
    z = cpu(torch.empty(N, device=D, dtype=torch.uint8).random_())
    assert z.min() == 0 and z.max() == 255
    f = cpu(torch.empty(N, device=D).random_())
    assert f.min() >= 0 and f.max() <= 2**24 and f.max() > 2**23
    b = cpu(torch.empty(N, device=D, dtype=torch.bool).random_())
    assert abs(b.float().mean() - 0.5) < 0.01


def test_randint_like_and_rand_like():
    base = torch.empty(1000, 3, device=D)
    r = torch.rand_like(base)
    n = torch.randn_like(base)
    i = torch.randint_like(base, 7)
    for t in (r, n, i):
        assert t.device.type == "tpu" and t.shape == (1000, 3) and t.dtype == torch.float32
    i = cpu(i)
    assert i.min() == 0 and i.max() == 6 and torch.equal(i, i.round())


def test_other_distributions():
    e = cpu(torch.empty(N, device=D).exponential_(2.0))
    assert e.min() >= 0 and abs(e.mean() - 0.5) < 0.01
    g = cpu(torch.empty(N, device=D).geometric_(0.25))
    assert g.min() >= 1 and abs(g.mean() - 4) < 0.1
    ln = cpu(torch.empty(N, device=D).log_normal_(0.0, 0.5))
    assert abs(ln.log().mean()) < 0.01 and abs(ln.log().std() - 0.5) < 0.01
    c = cpu(torch.empty(N, device=D).cauchy_(1.0, 2.0))
    assert abs(c.median() - 1) < 0.05


def test_multinomial_with_replacement_frequencies():
    p = torch.tensor([0.1, 0.2, 0.0, 0.7], device=D)
    s = cpu(torch.multinomial(p, N, replacement=True))
    assert s.dtype == torch.int64 and s.shape == (N,)
    freq = torch.bincount(s, minlength=4).double() / N
    assert freq[2] == 0
    assert (freq - torch.tensor([0.1, 0.2, 0.0, 0.7], dtype=torch.float64)).abs().max() < 0.01


def test_multinomial_without_replacement():
    w = torch.ones(3, 10, device=D)
    s = cpu(torch.multinomial(w, 10))
    for row in s:
        assert sorted(row.tolist()) == list(range(10))
    p = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0], device=D)
    s = cpu(torch.multinomial(p, 3))
    assert sorted(s.tolist()) == [1, 2, 4]
    # first draw frequencies follow the weights
    p = torch.tensor([1.0, 3.0], device=D).expand(20000, 2).contiguous()
    first = cpu(torch.multinomial(p, 1))[:, 0].double()
    assert abs(first.mean() - 0.75) < 0.02


def test_randperm_is_permutation():
    for n in (0, 1, 10, 1000):
        p = torch.randperm(n, device=D)
        assert p.device.type == "tpu" and p.dtype == torch.int64
        assert sorted(cpu(p).tolist()) == list(range(n))
    torch.manual_seed(3)
    a = cpu(torch.randperm(50, device=D))
    torch.manual_seed(3)
    assert torch.equal(a, cpu(torch.randperm(50, device=D)))


def test_dropout_scaling_and_rate():
    x = torch.ones(N, device=D)
    y = cpu(torch.nn.functional.dropout(x, p=0.25, training=True))
    kept = y != 0
    assert abs(kept.double().mean() - 0.75) < 0.01
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.75))
    assert torch.equal(cpu(torch.nn.functional.dropout(x, p=0.25, training=False)), torch.ones(N))
    m = torch.nn.Dropout(0.5).to(D)
    m.eval()
    assert torch.equal(cpu(m(x)), torch.ones(N))


def test_random_ops_do_not_recompile():
    torchtpu.reset_cache_stats()
    torch.rand(16, device=D)
    before = torchtpu.cache_stats()["misses"]
    for _ in range(5):
        torch.rand(16, device=D)
    assert torchtpu.cache_stats()["misses"] == before
