"""Views alias exactly as on CPU: writes through a view reach the base and vice versa."""

import numpy as np
import pytest
import torch

import torchtpu  # noqa: F401


def both(fn):
    """Run fn on a CPU tensor and on the same tensor on tpu; return (cpu_result, tpu_result)."""
    torch.manual_seed(0)
    base = torch.randn(4, 6)
    c = fn(base.clone())
    t = fn(base.clone().to("tpu"))
    return c, t


def check(fn):
    c, t = both(fn)
    cs = c if isinstance(c, (tuple, list)) else [c]
    ts = t if isinstance(t, (tuple, list)) else [t]
    for a, b in zip(cs, ts):
        torch.testing.assert_close(b.cpu(), a)


CASES = {
    "view_write": lambda x: (x.view(24)[3:7].fill_(5.0), x)[1],
    "reshape_write": lambda x: (x.reshape(6, 4).mul_(2), x)[1],
    "transpose_write": lambda x: (x.t()[1].zero_(), x)[1],
    "permute_write": lambda x: (x.view(2, 2, 6).permute(2, 0, 1)[0].add_(1), x)[1],
    "slice_step_write": lambda x: (x[:, ::2].mul_(-1), x)[1],
    "select_write": lambda x: (x.select(1, 2).fill_(3), x)[1],
    "setitem_int": lambda x: (x.__setitem__((slice(None), 1), 7.0), x)[1],
    "diagonal_write": lambda x: (x.diagonal().zero_(), x)[1],
    "unsqueeze_squeeze_write": lambda x: (x.unsqueeze(0).squeeze(0)[2].add_(10), x)[1],
    "unfold_read": lambda x: x.unfold(1, 3, 2),
    "as_strided_read": lambda x: x.as_strided((3, 3), (2, 1), 1),
    "as_strided_write": lambda x: (x.as_strided((2, 2), (6, 1), 2).fill_(9), x)[1],
    "view_of_view_write": lambda x: (x[1:3][:, 2:5].t()[0].fill_(-2), x)[1],
    "base_write_seen_by_view": lambda x: (lambda v: (x.add_(1), v)[1])(x[1]),
    "split_write": lambda x: (x.split(2, dim=1)[1].fill_(4), x)[1],
    "unbind_write": lambda x: (x.unbind(0)[3].fill_(8), x)[1],
    "chunk_read": lambda x: x.chunk(3, dim=1),
    "expand_read": lambda x: x[:1].expand(3, 6),
    "detach_shares": lambda x: (x.detach().mul_(3), x)[1],
    "view_then_out": lambda x: (torch.add(x[0], 1, out=x[1]), x)[1],
    "inplace_transpose_": lambda x: x.transpose_(0, 1).contiguous(),
    "t_then_view_after": lambda x: x.t().contiguous().view(-1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_view_semantics(name):
    check(CASES[name])


def test_metadata_matches_cpu():
    x = torch.randn(4, 6)
    t = x.to("tpu")
    for fn in (
        lambda a: a.t(),
        lambda a: a[1:, ::2],
        lambda a: a.select(0, 1),
        lambda a: a.unsqueeze(1),
        lambda a: a.as_strided((2, 2), (3, 1), 4),
        lambda a: a.diagonal(),
    ):
        c, d = fn(x), fn(t)
        assert c.shape == d.shape and c.stride() == d.stride() and c.storage_offset() == d.storage_offset()


def test_view_is_lazy_and_cached():
    x = torch.randn(64, 64).to("tpu")
    v = x[3]
    assert torch.equal(v.cpu(), x.cpu()[3])
    x[3, 5] = 42.0
    assert v[5].item() == 42.0


def test_inplace_dtype_error_like_cpu():
    with pytest.raises(RuntimeError, match="can't be cast"):
        torch.ones(3, dtype=torch.int64).add_(torch.ones(3) * 0.5)
    with pytest.raises(RuntimeError, match="can't be cast"):
        torch.ones(3, dtype=torch.int64).to("tpu").add_(torch.ones(3).to("tpu") * 0.5)


def test_out_variant_resizes_like_cpu():
    out_c = torch.empty(0)
    out_t = torch.empty(0, device="tpu")
    torch.add(torch.ones(2, 3), 2, out=out_c)
    torch.add(torch.ones(2, 3).to("tpu"), 2, out=out_t)
    assert out_t.shape == (2, 3)
    torch.testing.assert_close(out_t.cpu(), out_c)


def test_metadata_matches_cpu_on_a_strided_base():
    # a base whose layout is not row-major (from .to() of a transposed tensor): view chains
    # report CPU's strides and read CPU's values, including as_strided over memory
    x = torch.randn(5, 6).t()
    t = x.to("tpu")
    assert t.stride() == x.stride()
    for fn in (
        lambda a: a.t(),
        lambda a: a[1:, ::2],
        lambda a: a.select(1, 2),
        lambda a: a.unsqueeze(0),
        lambda a: a.as_strided((2, 3), (1, 6), 2),
        lambda a: a.diagonal(),
        lambda a: a[2:].t()[1],
        lambda a: a.transpose(0, 1).reshape(30),
    ):
        c, d = fn(x), fn(t)
        assert c.shape == d.shape and c.stride() == d.stride() and c.storage_offset() == d.storage_offset()
        assert c.is_contiguous() == d.is_contiguous()
        torch.testing.assert_close(d.cpu(), c)


def test_rows_of_a_stacked_storage_read_and_write_with_one_program_per_shape():
    """A row (select along an unsplit leading dim) of a large storage, as the layer scan's stacked
    parameters are, is read and written by index-taking programs: the values are CPU's, and
    writing every row adds no compiled chain per row (a scatter through the whole storage before)."""
    from torchtpu.backend import views
    from torchtpu.backend.tensor import storage_of

    cpu = torch.randn(6, 5, 4)
    t = cpu.to("tpu")
    storage_of(t).rows = True  # as distributed.params._materialize_stacked marks the stacked storage
    rows = [t.select(0, i) for i in range(6)]
    before = (views._jitted_chain.cache_info().currsize, views._jitted_scatter.cache_info().currsize)
    for i, r in enumerate(rows):
        torch.testing.assert_close(r.cpu(), cpu[i])
    for i in (0, 3, 5, -1):
        new = torch.full((5, 4), float(i))
        with torch.no_grad():
            t.select(0, i).copy_(new.to("tpu"))
        cpu.select(0, i).copy_(new)
    rows[2].mul_(2.0)
    cpu[2].mul_(2.0)
    torch.testing.assert_close(t.cpu(), cpu)
    after = (views._jitted_chain.cache_info().currsize, views._jitted_scatter.cache_info().currsize)
    assert after == before


def test_a_write_through_a_view_updates_a_buffer_nothing_else_reads_in_place():
    """A write through a view (a row of a stacked storage, a column) gives the program the storage's
    array when nothing else holds it, so XLA updates it in place: no copy of the whole storage per
    write (initialising the 8 stacked layers of Qwen3's debugmodel_moe copied 1.2 GB per row
    written). An array something else reads (a clone sharing it, a user's `to_jax`) is copied, and
    keeps its values."""
    from torchtpu.backend.tensor import storage_of

    cpu = torch.randn(4, 3, 5)
    t = cpu.to("tpu")
    storage_of(t).rows = True
    for write in (
        lambda x: x[2].fill_(3.0),  # a row, written by index
        lambda x: x[:, 1].mul_(-2.0),  # a general view, scattered
    ):
        old = torchtpu.to_jax(t)
        old_values = np.asarray(old).copy()
        write(t)
        write(cpu)
        torch.testing.assert_close(t.cpu(), cpu)
        np.testing.assert_array_equal(np.asarray(old), old_values)  # held here: copied, not donated
        assert storage_of(t).array.unsafe_buffer_pointer() != old.unsafe_buffer_pointer()
        del old
        address = storage_of(t).array.unsafe_buffer_pointer()
        write(t)
        write(cpu)
        assert storage_of(t).array.unsafe_buffer_pointer() == address  # held only by the storage: in place
        torch.testing.assert_close(t.cpu(), cpu)
    c = t.clone()
    t[0].zero_()
    cpu_c = cpu.clone()
    cpu[0].zero_()
    torch.testing.assert_close(c.cpu(), cpu_c)
    torch.testing.assert_close(t.cpu(), cpu)
