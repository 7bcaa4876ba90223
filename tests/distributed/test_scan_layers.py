"""The layer scan (torchtpu.distributed.scan): identical blocks traced once and run under
jax.lax.scan inside a compiled step, invisible to the user.

- Sharded Llama 3 training with the scan matches the unsharded, unscanned run (the oracle of
  tests/distributed/test_distributed.py) at the same tolerance.
- The compiled program holds one copy of the block: a while loop, and as many dot ops for 2
  layers as for 4.
- state_dict() names, shapes and values are the same with the scan on and off; a trainer
  checkpoint saved with the scan resumes without it.
- Loops the scan cannot stand for raise errors instead of computing something else.
- Per-op selective checkpointing, scanned and unrolled: the numbers of full recomputation, with the
  kept matmuls and attention not computed again; a recomputation that runs other kept ops than the
  forward raises.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torchtpu  # noqa: F401
from tests.processes import DEFAULT_CPU_PIPELINE
from torchtpu.backend.aot import compiler_options
from torchtpu.distributed import init_device_mesh
from torchtpu.distributed.scan import ScanError, is_scanned, scan_layers

from .test_distributed import CONFIGS, _batches, _llama, _reference_losses, _train

# a sharded run sets the process's current device mesh
pytestmark = pytest.mark.usefixtures("keep_current_mesh")


def _sharded_llama(name, scan, steps=None, mp=False):
    from torchtpu.models.llama3 import parallelize_llama

    shape, names, sp = CONFIGS[name]
    mesh = init_device_mesh("tpu", shape, mesh_dim_names=names)
    model = _llama().to("tpu")
    kw = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else {}
    parallelize_llama(
        model, mesh, sequence_parallel=sp, loss_parallel="tp" in names, ac_mode="full", scan_layers=scan, **kw
    )
    assert is_scanned(model.layers) == scan
    batches = _batches() if steps is None else _batches()[:steps]
    losses, cstep, opt = _train(model, batches, mesh)
    return model, losses, cstep


@pytest.mark.parametrize(
    "name, params_by", [("fsdp8", "select"), ("tp2_fsdp4", "select"), ("fsdp8", "stack"), ("tp2_fsdp4", "stack")]
)
def test_scanned_sharded_llama_matches_one_device(name, params_by, monkeypatch):
    """Both ways the loop body gets block i's weights (scan.PARAMS_BY) give the unsharded losses."""
    from torchtpu.distributed import scan

    monkeypatch.setattr(scan, "PARAMS_BY", params_by)
    with compiler_options(DEFAULT_CPU_PIPELINE):  # the while loop read below is the scan's
        model, losses, cstep = _sharded_llama(name, scan=True)
    np.testing.assert_allclose(losses, _reference_losses(), rtol=1e-5)
    hlo = cstep.as_text()
    assert re.search(r"\bwhile\b", hlo)
    if "tp" in name:
        assert re.search(r"all-reduce|reduce-scatter", hlo)
    assert "all-gather" in hlo


def _scanned_step(n_layers):
    """(losses, compiled step) of 2 steps of a debugmodel Llama with n_layers blocks, scanned, FSDP 8."""
    from torchtitan.models.llama3 import Transformer, llama3_args

    from torchtpu.models.llama3 import parallelize_llama

    torch.manual_seed(0)
    args = dataclasses.replace(llama3_args["debugmodel"], n_layers=n_layers, max_seq_len=32)  # RoPE table: the batches
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    model = model.to("tpu")
    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp_shard",))
    parallelize_llama(model, mesh, ac_mode="full", scan_layers=True)
    with compiler_options(DEFAULT_CPU_PIPELINE):  # the loops and slices counted are the scan's
        losses, cstep, _ = _train(model, _batches()[:2], mesh)
    return losses, cstep


def _dots_of_step(n_layers):
    """The compiled train step of a debugmodel Llama with n_layers blocks, scanned."""
    hlo = _scanned_step(n_layers)[1].as_text()
    return len(re.findall(r"\bdot\(", hlo)), len(re.findall(r"\bwhile\(", hlo))


def test_straight_line_loops_unroll_the_scan_with_its_losses():
    """Under `straight_line_loops` (the dry run's costing copies of a scanned job) the scanned step holds no
    loop, more dot ops than the loop's one block (one set per block), and gives the loop's losses."""
    from torchtpu.distributed.scan import straight_line_loops

    looped, cstep = _scanned_step(2)
    with straight_line_loops():
        straight, sstep = _scanned_step(2)
    hlo, shlo = cstep.as_text(), sstep.as_text()
    assert re.findall(r"\bwhile\(", hlo) and not re.findall(r"\bwhile\(", shlo)
    assert len(re.findall(r"\bdot\(", shlo)) > len(re.findall(r"\bdot\(", hlo))
    np.testing.assert_allclose(straight, looped, rtol=1e-6)


def test_scanned_program_holds_one_block():
    """The scanned program holds one block whatever the depth; under `straight_line_loops(2)` (how
    `bench.step_estimate --loop` costs a loop body) it keeps its loops, two blocks per iteration,
    each slicing its own row of the stacks and writing its own row of the outputs (twice the
    one-block program's dynamic slices and updates, no stack regrouped in pairs as `lax.scan`'s
    unroll=2 does), with the same losses."""
    from torchtpu.distributed.scan import straight_line_loops

    dots2, whiles2 = _dots_of_step(2)
    losses4, cstep4 = _scanned_step(4)
    hlo4 = cstep4.as_text()
    dots4, whiles4 = len(re.findall(r"\bdot\(", hlo4)), len(re.findall(r"\bwhile\(", hlo4))
    print(f"dot ops: 2 layers {dots2}, 4 layers {dots4}; while loops {whiles2}, {whiles4}")
    assert whiles2 >= 2 and whiles4 == whiles2  # forward and backward loops
    assert dots4 == dots2
    with straight_line_loops(2):
        paired, pstep = _scanned_step(4)
    phlo = pstep.as_text()
    assert len(re.findall(r"\bwhile\(", phlo)) == whiles4
    # a second block's dots in each loop body: all the program's but the few outside the loops
    assert 1.5 * dots4 < len(re.findall(r"\bdot\(", phlo)) < 2 * dots4
    for op in ("dynamic-slice", "dynamic-update-slice"):
        assert len(re.findall(rf"\b{op}\(", phlo)) == 2 * len(re.findall(rf"\b{op}\(", hlo4)) > 0, op
    np.testing.assert_allclose(paired, losses4, rtol=1e-6)


def test_state_dict_same_with_scan_on_and_off():
    steps, lr = 3, 8e-4
    off, losses_off, _ = _sharded_llama("fsdp8", scan=False, steps=steps)
    on, losses_on, _ = _sharded_llama("fsdp8", scan=True, steps=steps)
    np.testing.assert_allclose(losses_on, losses_off, rtol=1e-5)
    sd_off, sd_on = off.state_dict(), on.state_dict()
    assert list(sd_on) == list(sd_off)
    assert "layers.0.attention.wq.weight" in sd_on
    for k in sd_off:
        a, b = sd_off[k].cpu(), sd_on[k].cpu()
        assert a.shape == b.shape and a.dtype == b.dtype, k
        d = (b - a).abs()
        # Same values up to float rounding in another program order: AdamW moves a weight by
        # about lr per step at most, so a rounding-level gradient difference can move a few
        # near-zero-gradient weights by up to that; on average the values agree to 1e-6.
        assert d.max().item() <= 2 * lr * steps and d.mean().item() <= 1e-6, (k, d.max().item(), d.mean().item())


# ----------------------------------------------------------------------------- trainer


# the trainer tests' depth: the debug model's blocks cut to 2 (the scan runs over 2 as over 6)
N_LAYERS = 2


def _checkpointing_argv(tmp_path, steps=4):
    """The trainer test job with full recomputation (so the layer scan), a checkpoint every 2 steps."""
    from ..train.test_trainer import small_argv

    return small_argv(
        tmp_path,
        "--activation_checkpoint.mode",
        "full",
        "--training.steps",
        str(steps),
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
        # the evaluation at step 1 runs (the scanned model's forward-only program) on one batch, not the
        # whole held-out split, which every trainer would also count through at start-up
        "--validation.steps",
        "1",
    )


def test_trainer_scan_matches_pytorch_and_checkpoints_move_between_scan_and_no_scan(tmp_path):
    """The trainer with full recomputation and the layer scan (its default) against the plain
    PyTorch loop of tests/train/test_trainer.py. Its step-2 checkpoint resumes with the scan off
    (steps 3-4, per-parameter optimizer state from the stacked one); the step-4 checkpoint that
    unscanned run writes resumes with the scan on again (steps 5-6, stacked state from the
    per-parameter one). Both resumed runs continue
    the scanned run's losses."""
    import shutil

    from torchtpu.train.config.manager import load_config
    from torchtpu.train.trainer import Trainer

    from ..train.test_trainer import cpu_state, reference_losses

    argv = _checkpointing_argv(tmp_path / "a", steps=6)
    cfg = load_config(argv)
    assert cfg.tpu.scan_layers
    a = Trainer(cfg, n_layers=N_LAYERS)
    assert is_scanned(a.model.layers)
    init = cpu_state(a.model)
    hist_a = a.train()
    del a
    ref = reference_losses(cfg, init, 4, {"n_layers": N_LAYERS})
    got = [h["loss"] for h in hist_a[:4]]
    rel = max(abs(g - r) / abs(r) for g, r in zip(got, ref))
    print(f"trainer (scanned) {got}\nCPU               {ref}\nmax relative difference {rel:.2e}")
    assert rel <= 1e-4

    # scanned checkpoint -> unscanned run, steps 3-4 on the 6-step schedule; it saves its full state at 4
    (tmp_path / "b" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step_2", tmp_path / "b" / "checkpoint" / "step_2")
    argv_b = _checkpointing_argv(tmp_path / "b")
    b = Trainer(
        load_config(
            argv_b
            + ["--tpu.scan_layers", "false", "--lr_scheduler.total_steps", "6", "--checkpoint.no-last_save_model_only"]
        ),
        n_layers=N_LAYERS,
    )
    assert not is_scanned(b.model.layers)
    hist_b = b.train()
    del b
    # unscanned checkpoint -> scanned run, steps 5-6
    c = Trainer(load_config(_checkpointing_argv(tmp_path / "b", steps=6)), n_layers=N_LAYERS)
    assert is_scanned(c.model.layers) and c.stacked
    hist_c = c.train()
    assert [h["step"] for h in hist_b] == [3, 4] and [h["step"] for h in hist_c] == [5, 6]
    for h in hist_b + hist_c:
        assert h["loss"] == pytest.approx(hist_a[h["step"] - 1]["loss"], rel=1e-5)


def _trainer_step_hlo(tmp_path, n_layers, *extra):
    """The trainer's compiled step (debugmodel, FSDP over 8 CPU devices) at `n_layers` blocks."""
    from torchtpu.train.config.manager import load_config
    from torchtpu.train.dry_run.estimate import compile_step
    from torchtpu.train.trainer import Trainer

    from ..train.test_trainer import small_argv

    # no evaluation: only the training step is compiled, and the held-out split is not read
    argv = small_argv(tmp_path, "--activation_checkpoint.mode", "full", "--validation.enable", "false", *extra)
    t = Trainer(load_config(argv), n_layers=n_layers)
    return t, compile_step(t.built_step()).as_text()


def test_trainer_updates_each_stacked_slot_as_one_tensor(tmp_path):
    """The scanned blocks' parameters are rows of one stacked storage per slot (invisible in
    state_dict), and the trainer's optimizer updates a slot as one tensor: the compiled step has
    as many Adam updates (one sqrt each) for 2 blocks as for 4, and as many as there are slots
    plus the other parameters."""
    from torchtpu.backend.tensor import storage_of

    t2, hlo2 = _trainer_step_hlo(tmp_path / "a", 2)
    t4, hlo4 = _trainer_step_hlo(tmp_path / "b", 4)
    for t, n in ((t2, 2), (t4, 4)):
        sd = t.model.state_dict()
        assert "layers.1.attention.wq.weight" in sd and tuple(sd["layers.1.attention.wq.weight"].shape) == (256, 256)
        slots = len(list(t.model.layers["0"].parameters()))
        assert len(t.stacked) == slots
        for base, views in t.stacked:
            assert tuple(base.shape) == (n, *views[0].shape)
            assert all(storage_of(v) is storage_of(base) for v in views)
        n_params = len(list(t.model.parameters()))
        assert len(t.optimizer.param_groups[0]["params"]) == n_params - (n - 1) * slots
    sqrt2, sqrt4 = len(re.findall(r"\bsqrt\(", hlo2)), len(re.findall(r"\bsqrt\(", hlo4))
    print(f"sqrt ops in the step: 2 blocks {sqrt2}, 4 blocks {sqrt4}")
    assert sqrt2 == sqrt4
    # without the scan every block's parameters are updated one by one (2 blocks: twice a slot's)
    _, hlo_off = _trainer_step_hlo(tmp_path / "c", 2, "--tpu.scan_layers", "false")
    assert len(re.findall(r"\bsqrt\(", hlo_off)) > sqrt4

    # frozen rows in a slot of trainable ones: refused, not decayed by the slot's one update
    from torchtpu.distributed.scan import optimizer_parameters, stack_gradients

    base, views = t2.stacked[0]
    views[0].requires_grad_(False)
    with pytest.raises(ValueError, match=r"mixes frozen blocks \[0\] with trainable"):
        optimizer_parameters(t2.model)
    for v in views:
        v.requires_grad_(False)
    assert any(p is base for p in optimizer_parameters(t2.model))
    assert not base.requires_grad  # a frozen slot stays frozen: no gradient, skipped by the optimizer
    for v in views:
        v.requires_grad_(True)
    views[1].grad = torch.ones_like(views[1])
    with pytest.raises(RuntimeError, match=r"blocks \[0\] of the stacked parameter slot .* have no gradient"):
        stack_gradients(t2.stacked, t2.model)
    views[1].grad = None
    assert any(p is base for p in optimizer_parameters(t2.model)) and base.requires_grad

    # a block parameter replaced behind the optimizer's back is an error, not a silent no-update

    row = t2.stacked[0][1][1]
    owner, name = next((m, n) for m in t2.model.modules() for n, q in m._parameters.items() if q is row)
    owner._parameters[name] = nn.Parameter(row.detach().clone())
    with pytest.raises(RuntimeError, match="replaced after the optimizer was built"):
        stack_gradients(t2.stacked, t2.model)


def test_tpu_step_casts_one_block_of_the_stacked_weights_at_a_time():
    """On TPU, the loop body's bf16 cast of the stacked weights (FSDP's compute copy) stays in the
    loop: XLA moves it in front of the loops for a plain dynamic slice of the stacked storage,
    holding a bf16 copy of every block's weights (3.2 GiB per chip on the 8B step; docs/DESIGN_NOTES.md)."""
    from torchtpu.distributed.topology import libtpu_available

    if not libtpu_available():
        pytest.skip("libtpu is not installed")
    from torchtpu.train.config.manager import load_config
    from torchtpu.train.dry_run.estimate import compile_step
    from torchtpu.train.trainer import Trainer

    argv = ["--config", "train_configs/llama3_8b.toml", "--dry-run", "--tpu.topology", "v5p:2x2x1"]
    argv += ["--model.flavor", "debugmodel", "--training.seq_len", "1024", "--tpu.loss_chunk_size", "1024"]
    t = Trainer(load_config(argv), n_layers=4)
    assert t.stacked and t.cfg.training.mixed_precision_param == "bfloat16"
    hlo = compile_step(t.built_step()).as_text()
    stacked_f32 = set(re.findall(r"f32\[4,\d+,\d+\]", hlo))
    stacked_bf16 = set(re.findall(r"bf16\[4,\d+,\d+\]", hlo))
    print("stacked f32", sorted(stacked_f32), "stacked bf16", sorted(stacked_bf16))
    assert {"f32[4,64,256]", "f32[4,192,256]", "f32[4,64,768]"} <= stacked_f32  # the storages: 4 blocks, FSDP 4
    assert not stacked_bf16


# ----------------------------------------------------------------------------- what the scan refuses


class _Block(nn.Module):
    def __init__(self, d=8, h=16):
        super().__init__()
        self.a = nn.Linear(d, h)
        self.b = nn.Linear(h, d)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class _Stack(nn.Module):
    def __init__(self, n=3, between=False, stop=None):
        super().__init__()
        self.layers = nn.ModuleList([_Block() for _ in range(n)])
        self.between = between
        self.stop = stop

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if self.stop is not None and i == self.stop:
                break
            x = layer(x)
            if self.between:
                x = x * 2
        return x.sum()


def _compiled_grads(model, x):
    def step(x):
        loss = model(x)
        loss.backward()
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    f = torchtpu.compile(step)
    f(x)
    return f(x)


def test_scanned_module_list_matches_cpu_gradients():
    torch.manual_seed(0)
    ref = _Stack(4)
    x = torch.randn(5, 8)
    loss = ref(x)
    loss.backward()
    model = _Stack(4).to("tpu")
    model.load_state_dict(ref.state_dict())
    scan_layers(model.layers)
    got_loss, grads = _compiled_grads(model, x.to("tpu"))
    torch.testing.assert_close(got_loss.cpu(), loss.detach(), rtol=1e-5, atol=1e-6)
    for g, p in zip(grads, ref.parameters()):
        torch.testing.assert_close(g.cpu(), p.grad, rtol=1e-5, atol=1e-6)


class _CountingBlock(_Block):
    """A block with buffers as a MoE layer holds them: one it reads (`scale`, its own per block),
    one its forward adds to in place (`count`, how many activations were positive)."""

    def __init__(self, scale):
        super().__init__()
        self.register_buffer("scale", torch.full((8,), scale))
        self.register_buffer("count", torch.zeros(8))

    def forward(self, x):
        with torch.no_grad():
            self.count.add_((x > 0).float().sum(0))
        return super().forward(x * self.scale)


class _DenseThenCounting(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(h=32)] + [_CountingBlock(s) for s in (0.5, 1.5, 2.0)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_scan_carries_block_buffers_and_leaves_the_blocks_in_front_out():
    """The scan runs blocks 1-3 (block 0 differs and runs as it is): each block reads its own
    buffer and adds to another in place, once per step (the backward's recomputation adds
    nothing); gradients and buffers equal eager PyTorch on the CPU's after two steps."""
    torch.manual_seed(0)
    ref = _DenseThenCounting()
    model = _DenseThenCounting().to("tpu")
    model.load_state_dict(ref.state_dict())
    x = torch.randn(5, 8)
    for _ in range(2):
        ref.zero_grad()
        loss = ref(x)
        loss.backward()
    with pytest.raises(ValueError, match="block 1 differs from block 0"):
        scan_layers(model.layers)
    scan_layers(model.layers, start=1)
    got_loss, grads = _compiled_grads(model, x.to("tpu"))
    torch.testing.assert_close(got_loss.cpu(), loss.detach(), rtol=1e-5, atol=1e-6)
    for g, p in zip(grads, ref.parameters()):
        torch.testing.assert_close(g.cpu(), p.grad, rtol=1e-5, atol=1e-6)
    for block, ref_block in zip(model.layers[1:], ref.layers[1:]):
        assert ref_block.count.sum() > 0
        torch.testing.assert_close(block.count.cpu(), ref_block.count, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["between", "stop"])
def test_loops_the_scan_cannot_stand_for_raise(kind):
    model = _Stack(3, between=kind == "between", stop=2 if kind == "stop" else None).to("tpu")
    scan_layers(model.layers)
    with pytest.raises(ScanError, match="scan_layers = false"):
        _compiled_grads(model, torch.randn(5, 8).to("tpu"))


def test_only_identical_blocks_scan():
    layers = nn.ModuleList([_Block(), _Block(h=32)])
    with pytest.raises(ValueError, match="block 1 differs from block 0"):
        scan_layers(layers)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        scan_layers(nn.ModuleList([_Block()]))
    with pytest.raises(TypeError, match="ModuleDict or nn.ModuleList"):
        scan_layers(nn.Sequential(_Block(), _Block()))


def test_scan_needs_full_recomputation():
    from torchtpu.models.llama3 import parallelize_llama

    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp_shard",))
    with pytest.raises(ValueError, match="ac_mode='full'"):
        parallelize_llama(_llama().to("tpu"), mesh, ac_mode="none", scan_layers=True)


# ----------------------------------------------------------------------------- per-op selective checkpointing


class _CountOps(TorchDispatchMode):
    """Counts the ops that run (a replayed one does not reach it): entered around backward, what
    the recomputation computed again."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def _train_recording_backward(ac_mode, scan, steps=2):
    """The 2-block Llama 3 debug model under FSDP over the 8 devices, trained `steps` AdamW steps
    with `ac_mode`: (losses, each step's gradients, the ops the last compiled backward ran)."""
    from torchtpu.distributed import distribute_tensor
    from torchtpu.models.llama3 import parallelize_llama
    from torchtpu.models.llama3.parallelize import batch_placements

    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp_shard",))
    model = _llama().to("tpu")
    parallelize_llama(model, mesh, ac_mode=ac_mode, scan_layers=scan)
    assert is_scanned(model.layers) == scan
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1, capturable=True, foreach=True)
    counter = _CountOps()

    def step(inp, lab):
        loss = F.cross_entropy(model(inp).flatten(0, 1).float(), lab.flatten(0, 1))
        counter.counts.clear()
        with counter:
            loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        return loss.detach(), grads

    cstep = torchtpu.compile(step)
    losses, grads = [], []
    for b in _batches()[:steps]:
        inp, lab = (distribute_tensor(t, mesh, batch_placements(mesh)) for t in (b[:, :-1], b[:, 1:]))
        loss, g = cstep(inp, lab)
        losses.append(loss.item())
        grads.append([x.cpu() for x in g])
    return losses, grads, counter.counts


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_op_selective_checkpointing_matches_full_and_keeps_matmuls_and_attention(scan):
    """torchtitan's per-op policy ("op"): the same losses and gradients as full recomputation, and
    the compiled backward recomputes 3 of a block's 7 matmuls (it keeps the 1st, 3rd, 5th and 7th)
    and not its attention, which full recomputation runs again."""
    aten = torch.ops.aten
    sdpa = aten._scaled_dot_product_fused_attention_overrideable.default
    full = _train_recording_backward("full", scan)
    op = _train_recording_backward("op", scan)
    assert full[0] == op[0]  # the same program but for what is kept: the same losses, to the bit
    for g_full, g_op in zip(full[1], op[1]):
        for a, b in zip(g_full, g_op):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    blocks = 1 if scan else 2  # the scan's backward body is traced once for all blocks
    assert full[2][sdpa] == blocks and op[2][sdpa] == 0
    # the backward's matmuls: 2 for the output projection, then per block 14 for the gradients of
    # its 7 matmuls and those it recomputes: 3 with "op"; full recomputation runs 7 again (6
    # unrolled: PyTorch's checkpoint stops recomputing after the last value the backward needs)
    assert op[2][aten.mm.default] == 2 + blocks * (14 + 3)
    assert full[2][aten.mm.default] == 2 + blocks * (14 + (7 if scan else 6))


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_op_policy_recomputes_the_router_gates_shape_without_counting_it(monkeypatch, scan):
    """torchtitan's default per_op_sac_force_recompute_mm_shapes_by_fqns (a MoE router's gate): a
    matmul of a named linear layer's shape is recomputed and not counted. Named here for the Llama
    block's w1 (whose shape w3 shares), the backward recomputes wk, wo, w1 and w3 (4 matmuls), where
    the plain policy recomputes wk, wo and w3 (3), with the same losses as full recomputation."""
    from torchtpu.backend import activation_checkpoint

    monkeypatch.setattr(activation_checkpoint, "FORCE_RECOMPUTE_MM_FQNS", ("feed_forward.w1",))
    aten = torch.ops.aten
    full = _train_recording_backward("full", scan)
    op = _train_recording_backward("op", scan)
    assert full[0] == op[0]
    blocks = 1 if scan else 2
    assert op[2][aten.mm.default] == 2 + blocks * (14 + 4)


class _GradDependentBlock(nn.Module):
    """A block whose kept ops (OpPolicy) differ with gradients on, as the backward recomputes it,
    from those with gradients off, as the scan's forward runs it."""

    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)
        self.kind = kind

    def forward(self, x):
        y = self.lin(x)  # aten.mm, kept (the block's first matmul)
        if not torch.is_grad_enabled():
            return y * torch.max(y)  # aten.max, kept
        if self.kind == "other op":
            w = self.lin.weight
            return y @ w @ w  # the 2nd matmul (recomputed), the 3rd (kept) where the forward ran max
        if self.kind == "other shape":
            return y * torch.max(y[:, :4])
        return y  # "fewer": no max


class _GradDependentStack(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.layers = nn.ModuleList([_GradDependentBlock(kind) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


_F32 = r" torch\.float32"


@pytest.mark.parametrize(
    "kind, message",
    [
        (
            "other op",
            rf"ran aten\.mm\.default on \(5, 8\){_F32}, \(8, 8\){_F32} as kept op 1, where the forward ran "
            rf"aten\.max\.default on \(5, 8\){_F32}",
        ),
        (
            "other shape",
            rf"ran aten\.max\.default on \(5, 4\){_F32} as kept op 1, where the forward ran aten\.max\.default on "
            rf"\(5, 8\){_F32}",
        ),
        ("fewer", r"ran 1 of the 2 ops the forward kept \(the next was aten\.max\.default"),
    ],
)
def test_scan_refuses_a_recomputation_that_runs_other_kept_ops(kind, message):
    model = _GradDependentStack(kind).to("tpu")
    scan_layers(model.layers, save_ops=True)
    with pytest.raises(ScanError, match=message):
        _compiled_grads(model, torch.randn(5, 8).to("tpu"))
