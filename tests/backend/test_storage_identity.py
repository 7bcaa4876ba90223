"""Which tpu tensors share storage, told the way PyTorch tells it for CPU tensors:
`untyped_storage()` (one object for a base and its views, its `data_ptr()` and `nbytes()`),
`tensor.data_ptr()` (the storage's address plus `storage_offset()` elements), and what code built on
them does: safetensors' and transformers' shared-tensor grouping, torch.save writing a shared storage
once, and deepcopy keeping shared tensors shared. Each check runs the same code on CPU tensors and
compares."""

from __future__ import annotations

import copy
import io
import zipfile

import pytest
import safetensors.torch as st
import torch

DEV = "tpu"


def _tensors(device):
    """A base, views of it (a slice, a transpose, a select, a reshape), a detached alias and a
    tensor of another storage."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 4, generator=g).to(device)
    other = torch.randn(6, 4, generator=g).to(device)
    return {
        "base": base,
        "rows": base[2:5],
        "t": base.t(),
        "row": base[3],
        "flat": base.view(-1)[5:],
        "alias": base.detach(),
        "other": other,
    }


def _layout(ts):
    """Per tensor: its storage's index among the distinct storages, its byte offset into the
    storage (data_ptr() - storage data_ptr()), the storage's byte size and storage_offset()."""
    ptrs = []
    out = {}
    for k, t in ts.items():
        s = t.untyped_storage()
        if s.data_ptr() not in ptrs:
            ptrs.append(s.data_ptr())
        out[k] = (ptrs.index(s.data_ptr()), t.data_ptr() - s.data_ptr(), s.nbytes(), t.storage_offset())
    return out


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_views_share_one_storage_as_on_cpu():
    tpu, cpu = _tensors(DEV), _tensors("cpu")
    assert _layout(tpu) == _layout(cpu)
    s = tpu["base"].untyped_storage()
    assert isinstance(s, torch.UntypedStorage) and s.device == torch.device(DEV, 0)
    assert tpu["rows"].untyped_storage() is s
    assert tpu["rows"].storage().data_ptr() == s.data_ptr()  # the TypedStorage over it
    # distinct storages: distinct, non-overlapping byte ranges
    o = tpu["other"].untyped_storage()
    lo, hi = sorted([(s.data_ptr(), s.nbytes()), (o.data_ptr(), o.nbytes())])
    assert lo[0] + lo[1] <= hi[0]


def test_identity_is_stable_while_the_storage_lives():
    x = torch.zeros(3, 5, device=DEV)
    p = x.data_ptr()
    x.add_(1)
    x[1].mul_(3)
    assert x.data_ptr() == p and x[1:].data_ptr() == p + 5 * 4
    y = torch.ones(3, 5, device=DEV)
    x.data = y  # the tensor now reads y's storage
    assert x.data_ptr() == y.data_ptr() != p
    z = torch.empty(0, device=DEV)
    z.set_(y[1:])
    assert z.untyped_storage().data_ptr() == y.data_ptr() and z.data_ptr() == y.data_ptr() + 5 * 4
    assert z.shape == (2, 5) and torch.equal(z.cpu(), y[1:].cpu())


def test_shared_tensor_grouping_of_safetensors_and_transformers():
    from transformers.pytorch_utils import id_tensor_storage

    # safetensors flattens each tensor with view(-1): contiguous ones only
    tpu, cpu = ({k: v for k, v in _tensors(d).items() if v.is_contiguous()} for d in (DEV, "cpu"))
    assert len(tpu) == 6
    assert st._find_shared_tensors(tpu) == st._find_shared_tensors(cpu)
    names = list(tpu)
    ids = {d: [id_tensor_storage(ts[k])[1:] for k in names] for d, ts in (("tpu", tpu), ("cpu", cpu))}
    groups = {d: [ids[d].index(i) for i in ids[d]] for d in ids}
    assert groups["tpu"] == groups["cpu"]


def _stored(buf: bytes) -> int:
    """How many storages a torch.save file holds."""
    with zipfile.ZipFile(io.BytesIO(buf)) as z:
        return sum(1 for n in z.namelist() if "/data/" in n and not n.endswith("/"))


def test_torch_save_writes_a_shared_storage_once():
    tpu, cpu = _tensors(DEV), _tensors("cpu")
    files = {}
    for d, ts in (("tpu", tpu), ("cpu", cpu)):
        b = io.BytesIO()
        torch.save(ts, b)
        files[d] = b.getvalue()
    assert _stored(files["tpu"]) == _stored(files["cpu"]) == 2
    on_cpu = torch.load(io.BytesIO(files["tpu"]), map_location="cpu")
    assert _layout(on_cpu) == _layout(cpu)
    for k in cpu:
        assert torch.equal(on_cpu[k], cpu[k]), k
    back = torch.load(io.BytesIO(files["tpu"]))
    for k in cpu:
        assert back[k].device.type == DEV and torch.equal(back[k].cpu(), cpu[k]), k


def test_deepcopy_keeps_shared_tensors_shared():
    tpu = _tensors(DEV)
    c = copy.deepcopy(tpu)
    assert _layout(c) == _layout(tpu)
    assert c["base"].data_ptr() != tpu["base"].data_ptr()
    c["base"].add_(1)
    for k in tpu:
        if k != "other":
            assert torch.equal(c[k].cpu(), tpu[k].cpu() + 1), k
    assert torch.equal(c["other"].cpu(), tpu["other"].cpu())

    # a module with a tied weight: the copy's two names hold one parameter, like the original's
    emb = torch.nn.Embedding(8, 4)
    head = torch.nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    m = torch.nn.ModuleDict({"emb": emb, "head": head}).to(DEV)
    mc = copy.deepcopy(m)
    assert mc["head"].weight is mc["emb"].weight and isinstance(mc["emb"].weight, torch.nn.Parameter)
    assert torch.equal(mc["emb"].weight.cpu(), m["emb"].weight.cpu())
