"""FSDP's split embedding lookup (torchtpu/distributed/embedding.py): a table whose rows FSDP
splits is looked up by moving the token ids, not the table, and its gradient is added into each
chip's own rows. PyTorch on CPU is the oracle for the output and every gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.distributed.tensor.placement_types import Replicate
from torch.utils._python_dispatch import TorchDispatchMode

from torchtpu.distributed import MixedPrecisionPolicy, fully_shard, init_device_mesh, parallelize_module

pytestmark = pytest.mark.usefixtures("keep_current_mesh")

VOCAB, DIM, PAD = 64, 16, 3


class _Ops(TorchDispatchMode):
    """Records the ops that run (the subject runs unchanged)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _model(embedding_cls=nn.Embedding, vocab=VOCAB):
    torch.manual_seed(0)
    return nn.Sequential(embedding_cls(vocab, DIM, padding_idx=PAD), nn.Linear(DIM, 8))


def _ids(rows=8, cols=5, vocab=VOCAB):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, cols), generator=g)
    ids[0, 0] = ids[5, 1] = PAD
    ids[1, :] = vocab - 1  # the last row, from several tokens
    return ids


# Gradients are float32 sums over every token; a sharded run adds them in another order (seen: 2.3e-5
# apart on one element of 128). A wrong lookup or a missing reduce-scatter is off by O(1).
GRAD_TOL = 1e-4


def _run(model, ids, device):
    g = torch.Generator().manual_seed(2)
    target = torch.randn(*ids.shape, 8, generator=g)
    out = model(ids.to(device))
    loss = ((out.float() - target.to(device)) ** 2).sum()
    loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def _sharded(model, layout, mp=None):
    m = copy.deepcopy(model).to("tpu")
    kw = {"mp_policy": mp} if mp else {}
    if layout == "fsdp8":
        mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp_shard",))
        dp = mesh
    elif layout == "hsdp2x4":
        mesh = init_device_mesh("tpu", (2, 4), mesh_dim_names=("dp_replicate", "dp_shard"))
        dp = mesh
    elif layout == "tp2_fsdp4":  # tensor parallelism splits the vocabulary (rowwise), FSDP splits it further
        mesh = init_device_mesh("tpu", (4, 2), mesh_dim_names=("dp_shard", "tp"))
        parallelize_module(m, mesh["tp"], {"0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())})
        dp = mesh["dp_shard"]
    else:  # "hsdp2x2_tp2": replicas, FSDP and TP, every kind of axis at once
        mesh = init_device_mesh("tpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        parallelize_module(m, mesh["tp"], {"0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())})
        dp = mesh["dp_replicate", "dp_shard"]
    fully_shard(m[0], mesh=dp, **kw)
    fully_shard(m, mesh=dp, **kw)
    return m


@pytest.mark.parametrize("layout", ["fsdp8", "hsdp2x4", "tp2_fsdp4", "hsdp2x2_tp2"])
def test_split_lookup_matches_cpu(layout):
    ref, ids = _model(), _ids()
    out_cpu, grads_cpu = _run(ref, ids, "cpu")
    m = _sharded(ref, layout)
    with _Ops() as ops:
        out, grads = _run(m, ids, "tpu")
    assert "torchtpu.split_embedding.default" in ops.names, "the split lookup did not run"
    assert "torchtpu.split_embedding_backward.default" in ops.names
    assert "aten.embedding.default" not in ops.names
    torch.testing.assert_close(out.cpu(), out_cpu, rtol=1e-5, atol=1e-5)
    for name, g in grads_cpu.items():
        torch.testing.assert_close(
            grads[name].cpu(), g, rtol=GRAD_TOL, atol=GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert grads["0.weight"][PAD].abs().max().item() == 0  # padding_idx gets no gradient


def test_split_lookup_in_bf16_matches_cpu():
    ref, ids = _model(), _ids()
    out_cpu, grads_cpu = _run(ref, ids, "cpu")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    m = _sharded(ref, "tp2_fsdp4", mp)
    with _Ops() as ops:
        out, grads = _run(m, ids, "tpu")
    assert "torchtpu.split_embedding_backward.default" in ops.names
    assert out.dtype == torch.bfloat16 and grads["0.weight"].dtype == torch.float32
    torch.testing.assert_close(out.float().cpu(), out_cpu, rtol=1e-2, atol=1e-2)
    for name, g in grads_cpu.items():  # bf16 compute: errors relative to the gradient's scale
        err = (grads[name].cpu() - g).abs().max().item()
        assert err <= 1e-2 * g.abs().max().item(), f"{name}: max error {err} vs max |grad| {g.abs().max().item()}"


def test_more_tokens_than_rows_gathers_the_table_instead():
    """When a gather group's tokens outnumber the table's rows, moving the ids is the larger
    transfer: nn.Embedding's own lookup runs (XLA gathers the table), with the same results."""
    ref, ids = _model(), _ids(rows=16, cols=40)  # 16 x 40 tokens, 64 rows
    out_cpu, grads_cpu = _run(ref, ids, "cpu")
    m = _sharded(ref, "fsdp8")
    with _Ops() as ops:
        out, grads = _run(m, ids, "tpu")
    assert "torchtpu.split_embedding.default" not in ops.names
    assert "aten.embedding.default" in ops.names
    torch.testing.assert_close(out.cpu(), out_cpu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads["0.weight"].cpu(), grads_cpu["0.weight"], rtol=GRAD_TOL, atol=GRAD_TOL)


@pytest.mark.parametrize("layout", ["tp2_fsdp4", "hsdp2x2_tp2"])
def test_more_tokens_than_rows_with_tp_gathers_the_table_over_the_batch_axes_only(layout):
    """With more tokens than rows and a rowwise TP split, the table is gathered over the axes that
    split the batch only (each TP rank keeps its rows, the lookups are summed over TP) and each
    chip's gradient is reduce-scattered back: the split op runs in its table mode, same results."""
    ref, ids = _model(), _ids(rows=16, cols=40)  # 16 x 40 tokens, 64 rows
    out_cpu, grads_cpu = _run(ref, ids, "cpu")
    m = _sharded(ref, layout)
    with _Ops() as ops:
        out, grads = _run(m, ids, "tpu")
    assert "torchtpu.split_embedding.default" in ops.names
    assert "torchtpu.split_embedding_backward.default" in ops.names
    assert "aten.embedding.default" not in ops.names
    torch.testing.assert_close(out.cpu(), out_cpu, rtol=1e-5, atol=1e-5)
    for name, g in grads_cpu.items():
        torch.testing.assert_close(
            grads[name].cpu(), g, rtol=GRAD_TOL, atol=GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert grads["0.weight"][PAD].abs().max().item() == 0


@pytest.mark.parametrize("cols", [5, 40])
def test_tp_rows_with_fsdp_columns_gathers_the_columns(cols):
    """66 rows: TP 2 leaves 33 per rank, which FSDP 4 cannot split, so FSDP splits the columns
    (as for Llama 3.1 405B's table under TP 8 x FSDP 64). Then the batch axis splits the columns:
    the table mode gathers the columns over it, each TP rank looks up its own rows, and the
    gradient is reduce-scattered back to the column split."""
    ref, ids = _model(vocab=66), _ids(cols=cols, vocab=66)
    out_cpu, grads_cpu = _run(ref, ids, "cpu")
    m = _sharded(ref, "tp2_fsdp4")
    from torchtpu.distributed.params import get_layout

    assert [list(d) for d in get_layout(m[0], "weight").dims] == [["tp"], ["dp_shard"]]
    with _Ops() as ops:
        out, grads = _run(m, ids, "tpu")
    assert "torchtpu.split_embedding.default" in ops.names
    assert "torchtpu.split_embedding_backward.default" in ops.names
    torch.testing.assert_close(out.cpu(), out_cpu, rtol=1e-5, atol=1e-5)
    for name, g in grads_cpu.items():
        torch.testing.assert_close(
            grads[name].cpu(), g, rtol=GRAD_TOL, atol=GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert grads["0.weight"][PAD].abs().max().item() == 0


class _ScaledEmbedding(nn.Embedding):
    """An embedding with a forward of its own (as some transformers models have)."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


def test_subclass_with_its_own_forward_keeps_it():
    ref, ids = _model(_ScaledEmbedding), _ids()
    out_cpu, grads_cpu = _run(ref, ids, "cpu")
    m = _sharded(ref, "fsdp8")
    assert "forward" not in m[0].__dict__
    out, grads = _run(m, ids, "tpu")
    torch.testing.assert_close(out.cpu(), out_cpu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads["0.weight"].cpu(), grads_cpu["0.weight"], rtol=GRAD_TOL, atol=GRAD_TOL)


def test_deepcopy_looks_up_in_its_own_table():
    ids = _ids()
    m = _sharded(_model(), "fsdp8")
    c = copy.deepcopy(m)
    with torch.no_grad():
        c[0].weight.mul_(2.0)
        expected = c[1](c[0].weight.cpu()[ids].to("tpu"))
        torch.testing.assert_close(c(ids.to("tpu")).cpu(), expected.cpu(), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(m(ids.to("tpu")).cpu(), expected.cpu())


def test_transformers_gpt2_with_tied_embeddings_under_fsdp_matches_cpu():
    """transformers' GPT-2 (the token table tied to the LM head) under FSDP 8: the token lookup
    moves the ids (96 tokens, 128 rows); the position lookup ([1, seq] ids: a batch of 1, not
    split) looks up each chip's own rows and sums them (the table mode with nothing to gather);
    the loss and every gradient match PyTorch on CPU."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    ref = GPT2LMHeadModel(cfg)
    assert ref.lm_head.weight is ref.transformer.wte.weight
    ids = torch.randint(0, 128, (8, 12), generator=torch.Generator().manual_seed(3))

    def run(model, device):
        out = model(input_ids=ids.to(device), labels=ids.to(device))
        out.loss.backward()
        return out.loss, {n: p.grad for n, p in model.named_parameters()}

    loss_cpu, grads_cpu = run(ref, "cpu")
    m = copy.deepcopy(ref).to("tpu")
    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp_shard",))
    for block in m.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    with _Ops() as ops:
        loss, grads = run(m, "tpu")
    assert ops.names.count("torchtpu.split_embedding.default") == 2  # the tokens and the positions
    assert ops.names.count("aten.embedding.default") == 0
    torch.testing.assert_close(loss.cpu(), loss_cpu, rtol=1e-5, atol=1e-6)
    for name, g in grads_cpu.items():
        torch.testing.assert_close(grads[name].cpu(), g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
