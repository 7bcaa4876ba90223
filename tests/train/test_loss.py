"""The chunked cross entropy (torchtpu.train.loss) equals the plain loss: against PyTorch on the
CPU (the oracle: F.cross_entropy on the whole logits), in value and in every parameter's
gradient, on the CPU itself, eagerly on tpu, under torchtpu.compile, and in the trainer sharded
over the 8 virtual devices (FSDP 8, and TP 2 x FSDP 4 with loss_parallel: the chunk's recomputation
in backward once ran without loss_parallel and aborted the process, "terminate called without an
active exception")."""

from __future__ import annotations

import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.train.loss import IGNORE_INDEX, chunked_cross_entropy_loss, cross_entropy_loss

SEQ, BATCH, VOCAB = 24, 2, 96


def _model():
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    torch.manual_seed(0)
    args = TransformerModelArgs(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ, rope_theta=10000
    )
    m = Transformer(args)
    with torch.no_grad():
        m.init_weights()
    return m


def _batch(batch=BATCH):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (batch, SEQ), generator=g, dtype=torch.int32)
    y = torch.randint(0, VOCAB, (batch, SEQ), generator=g, dtype=torch.int32)
    y[0, 3] = y[1, 20] = IGNORE_INDEX  # ignored positions are left out of the mean, as F.cross_entropy does
    return x, y


def _oracle(batch=BATCH):
    model = _model()
    x, y = _batch(batch)
    loss = cross_entropy_loss(model(x), y)
    loss.backward()
    return model.state_dict(), loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(loss, grads, ref_loss, ref_grads, rtol=1e-5, atol=1e-6):
    assert float(loss.detach()) == pytest.approx(ref_loss, rel=rtol)
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g.cpu(), ref_grads[n], rtol=rtol, atol=atol, msg=n)


@pytest.mark.parametrize("chunk", [1, 5, 8, 24, 100])
def test_chunked_equals_plain_on_cpu(chunk):
    """Every chunk size (one position, uneven, even, whole, larger than the sequence)."""
    state, ref_loss, ref_grads = _oracle()
    model = _model()
    model.load_state_dict(state)
    x, y = _batch()
    loss = chunked_cross_entropy_loss(model, x, y, chunk)
    loss.backward()
    _check(loss, {n: p.grad for n, p in model.named_parameters()}, ref_loss, ref_grads)
    # the model is left as it was: its output projection's forward is its own again
    assert "forward" not in model.output.__dict__
    assert model(x).shape == (BATCH, SEQ, VOCAB)


class _Head(torch.nn.Module):
    """Embedding, norm and an output projection with or without a bias: the smallest model the
    chunked loss takes (its forward ends with `model.output`)."""

    def __init__(self, bias):
        super().__init__()
        torch.manual_seed(2)
        self.tok = torch.nn.Embedding(VOCAB, 16)
        self.norm = torch.nn.RMSNorm(16)
        self.output = torch.nn.Linear(16, VOCAB, bias=bias)

    def forward(self, x):
        return self.output(self.norm(self.tok(x)))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [5, 24])
def test_fused_with_and_without_bias_on_cpu(bias, chunk):
    """The gradients computed in the forward (softmax - onehot, zero rows for the ignored labels)
    against autograd through the whole logits: the bias's too, chunks of 5 leaving 4 at the end."""
    ref = _Head(bias)
    x, y = _batch()
    ref_loss = cross_entropy_loss(ref(x), y)
    ref_loss.backward()
    model = _Head(bias)
    loss = chunked_cross_entropy_loss(model, x, y, chunk)
    loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    _check(loss, {n: p.grad for n, p in model.named_parameters()}, ref_loss.item(), ref_grads)
    # under no_grad only the value is computed
    with torch.no_grad():
        assert chunked_cross_entropy_loss(model, x, y, chunk).item() == pytest.approx(ref_loss.item(), rel=1e-5)


def test_fused_costs_the_plain_loss_flops():
    """Nothing is recomputed: forward and backward of the chunked loss count the FLOPs of the plain
    loss (6 N D V for the projection), where recomputing each chunk's logits cost 2 N D V more."""
    from torch.utils.flop_counter import FlopCounterMode

    x, y = _batch()
    counts = []
    for chunked in (False, True):
        model = _model()
        with FlopCounterMode(display=False) as counter:
            loss = chunked_cross_entropy_loss(model, x, y, 5) if chunked else cross_entropy_loss(model(x), y)
            loss.backward()
        counts.append(counter.get_total_flops())
    assert counts[1] == counts[0] > 6 * BATCH * SEQ * 32 * VOCAB


def test_fused_bfloat16_on_tpu_matches_cpu():
    """A bfloat16 model (the trainer's mixed precision computes the projection so): the logits and
    softmax in float32, d/dW summed over the chunks in float32 (on tpu a bf16 x bf16 matmul with a
    float32 result) and returned once in bfloat16, against the plain loss on the CPU at bfloat16's
    precision; the gradients keep their parameters' dtype."""
    ref = _Head(True).to(torch.bfloat16)
    x, y = _batch()
    ref_loss = cross_entropy_loss(ref(x), y)
    ref_loss.backward()
    model = _Head(True).to(torch.bfloat16).to("tpu")
    loss = chunked_cross_entropy_loss(model, x.to("tpu"), y.to("tpu"), 5)
    loss.backward()
    assert loss.dtype == torch.float32
    assert float(loss.detach().cpu()) == pytest.approx(ref_loss.item(), rel=1e-3)
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.bfloat16, n
        torch.testing.assert_close(p.grad.cpu(), r.grad, rtol=2e-2, atol=2e-3, msg=n)


def test_chunked_on_tpu_eager_and_compiled():
    state, ref_loss, ref_grads = _oracle()
    model = _model().to("tpu")
    model.load_state_dict(state)
    x, y = (t.to("tpu") for t in _batch())

    loss = chunked_cross_entropy_loss(model, x, y, 7)
    loss.backward()
    _check(loss.cpu(), {n: p.grad for n, p in model.named_parameters()}, ref_loss, ref_grads)
    model.zero_grad(set_to_none=True)

    names = [n for n, _ in model.named_parameters()]

    def step(x, y):
        loss = chunked_cross_entropy_loss(model, x, y, 7)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    f = torchtpu.compile(step)
    f(x, y)
    loss, grads = f(x, y)
    _check(loss.cpu(), dict(zip(names, grads)), ref_loss, ref_grads)


def test_chunked_under_tensor_parallel_matches_cpu(_keep_current_mesh):
    """TP 2 x FSDP 4 with sequence parallelism, as the trainer lays the model out: the output
    projection is split over the vocabulary and each chunk's cross entropy runs under loss_parallel,
    which is entered around the forward only (backward's recomputation must still use it: without
    that the process aborted). Eager and compiled, against PyTorch on the CPU; in the compiled step
    no chunk's logits are gathered over the batch or the vocabulary."""
    import re

    from torchtpu.distributed import init_device_mesh, loss_parallel
    from torchtpu.models.llama3 import parallelize_llama

    batch, chunk = 4, 7  # chunks of 7, 7, 7, 3 positions; the batch splits over dp_shard
    state, ref_loss, ref_grads = _oracle(batch)
    model = _model().to("tpu")
    model.load_state_dict(state)
    mesh = init_device_mesh("tpu", (4, 2), mesh_dim_names=("dp_shard", "tp"))
    parallelize_llama(model, mesh, sequence_parallel=True, loss_parallel=True)
    x, y = (t.to("tpu") for t in _batch(batch))
    names = [n for n, _ in model.named_parameters()]

    def step(x, y):
        with loss_parallel(mesh["tp"]):
            loss = chunked_cross_entropy_loss(model, x, y, chunk)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    loss, grads = step(x, y)
    _check(loss.cpu(), dict(zip(names, grads)), ref_loss, ref_grads)
    f = torchtpu.compile(step)
    f(x, y)
    loss, grads = f(x, y)
    _check(loss.cpu(), dict(zip(names, grads)), ref_loss, ref_grads)
    # No all-gather of a chunk's logits (per device [tokens/4, VOCAB/2], over the whole batch they
    # would be [4 * 7 or 4 * 3, ...], whole over the vocabulary [..., VOCAB]) or of its hidden states.
    shapes = [
        tuple(int(d) for d in m.split(",")) for m in re.findall(r"= f32\[([\d,]+)\]\S* all-gather\(", f.as_text())
    ]
    assert shapes  # (the FSDP weights are gathered)
    gathered = [s for s in shapes if s[0] in (batch * chunk, batch * (SEQ % chunk)) or s[-1] == VOCAB]
    assert not gathered, (gathered, shapes)


def test_chunked_loss_refuses_bad_input():
    model = _model()
    x, y = _batch()
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        chunked_cross_entropy_loss(model, x, y, 0)
    with pytest.raises(ValueError, match=r"labels of shape \(2, 23\)"):
        chunked_cross_entropy_loss(model, x, y[:, 1:], 4)


@pytest.fixture
def _keep_current_mesh():
    from torchtpu.distributed import mesh

    before = mesh._CURRENT
    yield
    mesh._CURRENT = before


@pytest.mark.parametrize("tp", [1, 2])
def test_trainer_chunked_loss_matches_plain_loss_sharded(tmp_path, _keep_current_mesh, tp):
    """The trainer (the debug model with 2 blocks) over 8 devices (FSDP 8; TP 2 x FSDP 4 with sequence and loss parallelism), [tpu]
    loss_chunk_size = 8 on 32-token sequences (4 chunks) against loss_chunk_size = 0: the same losses
    step after step (training on, so gradients are compared through the updates)."""
    import os

    from torchtpu.train.config.manager import load_config
    from torchtpu.train.trainer import Trainer

    toml = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "train_configs",
        "debug_model.toml",
    )
    losses = {}
    for chunk in (0, 8):
        argv = [
            "--config",
            toml,
            "--job.dump_folder",
            str(tmp_path / f"c{chunk}"),
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "1",
            "--training.steps",
            "3",
            "--metrics.log_freq",
            "1",
            "--parallelism.tensor_parallel_degree",
            str(tp),
            "--tpu.loss_chunk_size",
            str(chunk),
            "--validation.no-enable",  # the losses compared are the training steps'
        ]
        t = Trainer(load_config(argv), n_layers=2)  # 2 blocks: the loss is the output projection's
        losses[chunk] = [h["loss"] for h in t.train()]
        del t
    print(losses)
    assert len(losses[0]) == 3
    for a, b in zip(losses[0], losses[8]):
        assert b == pytest.approx(a, rel=1e-5)


def test_fused_chunks_run_one_at_a_time_on_tpu(monkeypatch):
    """The chunks are independent, so XLA's scheduler may start every chunk's logits before any
    chunk's gradients are done and hold them all. The loss orders them (`_after`). Compiled ahead
    of time for v5p:2x2x1 (FSDP 4, bf16 parameters; 8 chunks of 512 positions, each chunk's logits
    f32 [2048, 2048] per chip, 16 MiB): the program needs at least two chunks' logits less memory
    than the same loss without the ordering (measured: 27 against 78 MiB of temporaries; at 4x the
    sizes, 133 against 359 MiB, for twice the compile time)."""
    import torchtpu.train.loss as loss_module
    from torchtpu.distributed import empty, fully_shard, init_device_mesh, materialize, topology
    from torchtpu.models.llama3.parallelize import batch_placements

    if not topology.libtpu_available():
        pytest.skip("libtpu is not installed (pip install 'torchtpu[tpu]')")
    mesh = init_device_mesh("tpu", (4,), mesh_dim_names=("dp_shard",), devices=topology.topology_devices("v5p:2x2x1"))
    vocab, dim, seq, chunk = 8192, 256, 4096, 512

    def temporaries():
        with torch.device("meta"):
            model = torch.nn.ModuleDict(
                {"tok": torch.nn.Embedding(vocab, dim), "output": torch.nn.Linear(dim, vocab, bias=False)}
            )
        model.forward = lambda x: model.output(model.tok(x))
        model.to(torch.bfloat16)
        fully_shard(model, mesh=mesh)
        materialize(model)

        def step(x, y):
            loss = chunked_cross_entropy_loss(model, x, y, chunk)
            loss.backward()
            return loss.detach(), [p.grad for p in model.parameters()]

        batch = [empty((4, seq), torch.int32, mesh=mesh, placements=batch_placements(mesh)) for _ in range(2)]
        compiled = torchtpu.compile(step).compile_for(*batch)
        return compiled.memory_analysis().temp_size_in_bytes

    ordered = temporaries()
    monkeypatch.setattr(loss_module, "_after", lambda x, done: (x, done))
    unordered = temporaries()
    chunk_logits = 4 * chunk * (vocab // 4) * 4  # f32 logits of 4 x `chunk` tokens, a quarter of the vocabulary
    assert ordered <= unordered - 2 * chunk_logits, (ordered / 2**20, unordered / 2**20)
