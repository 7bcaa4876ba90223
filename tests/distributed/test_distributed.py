"""The sharding layer on 8 XLA CPU devices: meshes, placements, distribute_tensor, tensor
parallelism, FSDP, and torchtitan's Llama 3 sharded every supported way against one device."""

from __future__ import annotations

import copy
import dataclasses
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import torchtpu
from torchtpu.distributed import (
    ColwiseParallel,
    MixedPrecisionPolicy,
    Partial,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    distribute_tensor,
    fully_shard,
    init_device_mesh,
    local_bytes,
    parallelize_module,
)
from torchtpu.distributed.placements import placements_for, spec_for


def spec(t):
    """The PartitionSpec of a tpu tensor, trailing unsplit dims dropped (P('x', None) == P('x'))."""
    entries = list(torchtpu.to_jax(t).sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


# ----------------------------------------------------------------------------- meshes


def test_mesh_dims_submeshes_and_flatten():
    mesh = init_device_mesh("tpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    assert mesh.shape == (2, 2, 2) and mesh.size() == 8 and mesh.ndim == 3
    tp = mesh["tp"]
    assert tp.ndim == 1 and tp.size() == 2 and tp.mesh_dim_names == ("tp",)
    dp = mesh["dp_replicate", "dp_shard"]
    assert dp.shape == (2, 2)
    flat = dp._flatten("dp")
    assert flat.ndim == 1 and flat.size() == 4 and flat.dims == (("dp_replicate", "dp_shard"),)
    assert mesh["dp"].dims == flat.dims  # the flattened name is known to the root afterwards
    # device ids laid out like the mesh
    assert mesh.mesh.shape == (2, 2, 2) and sorted(mesh.mesh.flatten().tolist()) == list(range(8))


def test_mesh_errors_are_clear():
    with pytest.raises(ValueError, match=r"does not match the 8 devices.*product is 8"):
        init_device_mesh("tpu", (3, 2), mesh_dim_names=("a", "b"))
    mesh = init_device_mesh("tpu", (2, 4), mesh_dim_names=("dp", "tp"))
    with pytest.raises(KeyError, match="no dimension named 'pp'"):
        mesh["pp"]
    with pytest.raises(ValueError, match="device_type"):
        init_device_mesh("cuda", (8,))


# ----------------------------------------------------------------------------- placements


def test_placements_to_partition_specs_and_back():
    mesh = init_device_mesh("tpu", (2, 4), mesh_dim_names=("dp", "tp"))
    assert spec_for(mesh, (Shard(0), Shard(1)), 2) == P("dp", "tp")
    assert spec_for(mesh, (Shard(0), Shard(0)), 2) == P(("dp", "tp"), None)
    assert spec_for(mesh, (Replicate(), Shard(-1)), 3) == P(None, None, "tp")
    assert spec_for(mesh, (Partial(), Replicate()), 2) == P(None, None)  # the raw spec keeps its Nones
    flat = mesh["dp", "tp"]._flatten("all")
    assert spec_for(flat, (Shard(1),), 2) == P(None, ("dp", "tp"))
    for pl in [(Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Replicate()), (Replicate(), Replicate())]:
        s = NamedSharding(mesh.jax_mesh, spec_for(mesh, pl, 2))
        assert placements_for(s, 2, mesh) == pl
    with pytest.raises(ValueError, match="one placement per mesh dimension"):
        spec_for(mesh, (Shard(0),), 2)


def test_distribute_tensor_full_tensor_redistribute():
    mesh = init_device_mesh("tpu", (2, 4), mesh_dim_names=("dp", "tp"))
    x = torch.randn(8, 12)
    d = distribute_tensor(x, mesh, (Shard(0), Shard(1)))
    assert d.device.type == "tpu" and tuple(d.shape) == (8, 12)
    assert spec(d) == P("dp", "tp")
    assert d.placements == (Shard(0), Shard(1)) and d.device_mesh == mesh
    shard_shapes = {s.data.shape for s in torchtpu.to_jax(d).addressable_shards}
    assert shard_shapes == {(4, 3)}
    full = d.full_tensor()
    assert spec(full) == P() and torch.equal(full.cpu(), x)
    r = d.redistribute(mesh, (Replicate(), Shard(0)))
    assert r.placements == (Replicate(), Shard(0)) and torch.equal(r.cpu(), x)
    assert d.to_local() is d  # single-program SPMD: the program works on the global tensor
    # a sub-mesh placement leaves the other axes replicated
    t = distribute_tensor(x, mesh["tp"], (Shard(1),))
    assert spec(t) == P(None, "tp") and t.device_mesh == mesh["tp"]
    # Partial is bookkeeping: the array already holds the reduced value
    p = distribute_tensor(x, mesh, (Partial(), Replicate()))
    assert p.placements[0] == Partial() and torch.equal(p.full_tensor().cpu(), x)
    with pytest.raises(ValueError, match="not divisible by 4"):
        distribute_tensor(torch.randn(8, 10), mesh, (Replicate(), Shard(1)))


def test_redistribute_and_full_tensor_are_differentiable():
    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp",))
    x = torch.randn(16, 4)
    d = distribute_tensor(x, mesh, (Shard(0),)).requires_grad_()
    (d.full_tensor() * 3).sum().backward()
    assert torch.allclose(d.grad.cpu(), torch.full((16, 4), 3.0))
    assert spec(d.grad) == P("dp")  # the gradient comes back in the input's layout


def test_ops_keep_layouts_and_in_place_writes_keep_them():
    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp",))
    w = distribute_tensor(torch.ones(16, 4), mesh, (Shard(0),))
    m = torch.zeros_like(w)
    assert spec(m) == P("dp")
    w.zero_()
    w.fill_(2.0)
    assert spec(w) == P("dp") and torch.equal(w.cpu(), torch.full((16, 4), 2.0))
    batch = torch.randn(16, 4).to("tpu")  # an ordinary tpu:0 tensor meets a sharded one
    assert torch.allclose((w + batch).cpu(), 2.0 + batch.cpu())


def test_random_init_of_a_sharded_tensor_draws_each_shard_on_its_device_with_the_unsharded_values():
    """trunc_normal_/normal_/uniform_ of a sharded parameter (its initialisation) is drawn in the
    parameter's layout: each device computes its own block, and the numbers are the ones the same
    seed draws for an unsharded tensor."""
    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp",))
    w = distribute_tensor(torch.empty(16, 32), mesh, (Replicate(),)).redistribute(mesh, (Shard(1),))
    plain = torch.empty(16, 32, device="tpu")
    for fill in (
        lambda t: t.normal_(0.0, 0.02),
        lambda t: t.uniform_(-1.0, 1.0),
        lambda t: torch.nn.init.trunc_normal_(t, std=0.02),
    ):
        for t in (w, plain):
            torch.tpu.manual_seed(11)
            fill(t)
        assert spec(w) == P(None, "dp") and torch.equal(w.full_tensor().cpu(), plain.cpu())
    # the functional op behind normal_ returns its samples laid out as its input, not on one device
    out = torch.ops.aten.normal_functional(w.to_local(), 0.0, 1.0)
    assert spec(out) == P(None, "dp")


# ----------------------------------------------------------------------------- tensor parallelism


class MLP(torch.nn.Module):
    def __init__(self, d=16, h=32):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, h)
        self.down = torch.nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.norm(x))))


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_colwise_rowwise_mlp_matches_cpu(sp):
    torch.manual_seed(0)
    ref = MLP()
    m = copy.deepcopy(ref).to("tpu")
    mesh = init_device_mesh("tpu", (2, 4), mesh_dim_names=("dp", "tp"))
    act = Shard(1) if sp else Replicate()
    plan = {"up": ColwiseParallel(input_layouts=act), "down": RowwiseParallel(output_layouts=act)}
    if sp:
        plan["norm"] = SequenceParallel()
    parallelize_module(m, mesh["tp"], plan)
    assert spec(m.up.weight) == P("tp") and spec(m.up.bias) == P("tp")
    assert spec(m.down.weight) == P(None, "tp") and spec(m.down.bias) == P()
    x = torch.randn(4, 8, 16)
    xt = distribute_tensor(x, mesh, (Shard(0), act))
    out = m(xt)
    expect = ref(x)
    assert torch.allclose(out.cpu(), expect, atol=1e-5)
    out.square().sum().backward()
    expect.square().sum().backward()
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad.cpu(), q.grad, atol=1e-4, rtol=1e-4), n


def test_parallelize_module_errors():
    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match="matches no submodule"):
        parallelize_module(MLP().to("tpu"), mesh, {"upp": ColwiseParallel()})
    with pytest.raises(TypeError, match="supports nn.Linear and nn.Embedding"):
        parallelize_module(MLP().to("tpu"), mesh, {"norm": ColwiseParallel()})
    with pytest.raises(ValueError, match="not divisible by 8"):
        parallelize_module(MLP(d=16, h=12).to("tpu"), mesh, {"up": ColwiseParallel()})


# ----------------------------------------------------------------------------- FSDP


def test_fully_shard_mixed_precision_matches_cpu_reference():
    torch.manual_seed(0)
    ref = MLP()
    m = copy.deepcopy(ref).to("tpu")
    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp_shard",))
    fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert spec(m.up.weight) == P("dp_shard") and m.up.weight.dtype == torch.float32
    x = torch.randn(8, 16)
    out = m(distribute_tensor(x, mesh, (Shard(0),)))
    assert out.dtype == torch.bfloat16  # computed with bf16 parameters
    bf = copy.deepcopy(ref).to(torch.bfloat16)
    expect = bf(x.to(torch.bfloat16))
    assert torch.allclose(out.float().cpu(), expect.float(), atol=2e-2, rtol=2e-2)
    out.float().sum().backward()
    g = m.up.weight.grad
    assert g.dtype == torch.float32 and spec(g) == P("dp_shard")  # reduced into the shard
    expect.float().sum().backward()
    assert torch.allclose(g.cpu(), bf.up.weight.grad.float(), atol=5e-2, rtol=5e-2)


# ----------------------------------------------------------------------------- Llama 3


def _llama(seed=0):
    """torchtitan's Llama 3 debugmodel, 2 blocks deep (the sharding is per block, so 2 show what 6
    would, and compile in a third of the time) and its RoPE table as long as the batches (the
    same values at every position: the table is the flavor's up to its length)."""
    from torchtitan.models.llama3 import Transformer, llama3_args

    torch.manual_seed(seed)
    m = Transformer(dataclasses.replace(llama3_args["debugmodel"], n_layers=2, max_seq_len=S))
    with torch.no_grad():
        m.init_weights()
    return m


B, S, STEPS = 8, 32, 10


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 2048, (B, S + 1), generator=g) for _ in range(STEPS)]


def _train(model, batches, mesh=None):
    from torchtpu.models.llama3.parallelize import batch_placements

    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1, capturable=True, foreach=True)

    def step(inp, lab):
        loss = F.cross_entropy(model(inp).flatten(0, 1).float(), lab.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    cstep = torchtpu.compile(step)
    losses = []
    for b in batches:
        inp, lab = b[:, :-1], b[:, 1:]
        if mesh is None:
            inp, lab = inp.to("tpu"), lab.to("tpu")
        else:
            inp = distribute_tensor(inp, mesh, batch_placements(mesh))
            lab = distribute_tensor(lab, mesh, batch_placements(mesh))
        losses.append(cstep(inp, lab))
    return [float(x.item()) for x in losses], cstep, opt


_REF: dict = {}


def _reference_losses():
    if "losses" not in _REF:
        _REF["losses"] = _train(_llama().to("tpu"), _batches())[0]
    return _REF["losses"]


CONFIGS = {
    "fsdp8": ((8,), ("dp_shard",), False),
    "hsdp2x4": ((2, 4), ("dp_replicate", "dp_shard"), False),
    "tp2_fsdp4": ((4, 2), ("dp_shard", "tp"), False),
    "tp8": ((8,), ("tp",), False),
    "tp4sp_fsdp2": ((2, 4), ("dp_shard", "tp"), True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_llama3_sharded_training_matches_one_device(name):
    from torchtpu.models.llama3 import parallelize_llama

    shape, names, sp = CONFIGS[name]
    mesh = init_device_mesh("tpu", shape, mesh_dim_names=names)
    model = _llama().to("tpu")
    parallelize_llama(model, mesh, sequence_parallel=sp, loss_parallel="tp" in names)
    losses, cstep, opt = _train(model, _batches(), mesh)
    ref = _reference_losses()
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    # parameters and optimizer state kept their layouts through the compiled steps
    wq = model.layers["0"].attention.wq.weight
    expect = {
        "fsdp8": P("dp_shard"),
        "hsdp2x4": P("dp_shard"),
        "tp2_fsdp4": P(("tp", "dp_shard")),
        "tp8": P("tp"),
        "tp4sp_fsdp2": P(("tp", "dp_shard")),
    }[name]
    assert spec(wq) == expect and spec(opt.state[wq]["exp_avg"]) == expect
    hlo = cstep.as_text()
    if "tp" in names:
        assert re.search(r"all-reduce|reduce-scatter", hlo)  # rowwise layers reduce their partial sums
    if "dp_shard" in names:
        assert "all-gather" in hlo  # FSDP gathers parameters before use


def test_fsdp_mixed_precision_with_activation_checkpointing_leaves_no_cast_weights():
    """Recomputation in backward stops early (it raises out of the block's forward): the bf16
    copies that fully_shard puts in place of the parameters must still be removed, or every
    layer's cast weights stay alive, and a compiled step holds them as state (seen in a 70B
    dry run as a full bf16 copy of every weight on every chip)."""
    from torchtpu.models.llama3 import parallelize_llama

    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp_shard",))
    model = _llama().to("tpu")
    parallelize_llama(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, ac_mode="full")
    inp = distribute_tensor(_batches()[0][:, :-1], mesh, (Shard(0),))
    model(inp).float().sum().backward()
    lingering = [
        f"{type(m).__name__}.{k}"
        for m in model.modules()
        for k, v in vars(m).items()
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and k in m._parameters
    ]
    assert not lingering, lingering
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_fsdp8_each_device_holds_an_eighth_of_parameters_and_optimizer_state():
    from torchtpu.models.llama3 import parallelize_llama

    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp_shard",))
    model = _llama().to("tpu")
    parallelize_llama(model, mesh)
    _, _, opt = _train(model, _batches()[:2], mesh)
    tensors = list(model.parameters()) + [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    total = sum(t.numel() * t.element_size() for t in tensors)
    per_device = local_bytes(tensors)
    assert len(per_device) == 8
    for dev, n in per_device.items():
        assert abs(n - total / 8) <= 0.10 * total / 8, (dev, n, total / 8)


# ----------------------------------------------------------------------------- TPU compilation


def _tiny_llama_on(mesh, sequence_parallel=False):
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    from torchtpu.distributed import materialize
    from torchtpu.models.llama3 import parallelize_llama

    with torch.device("meta"):
        model = Transformer(
            TransformerModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=512, max_seq_len=32)
        )
    parallelize_llama(
        model,
        mesh,
        sequence_parallel=sequence_parallel,
        loss_parallel=False,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
    )
    materialize(model)  # lazy: nothing is allocated, the step is only compiled
    return model


def _compile_step_for(model, mesh, batch=(4, 24)):
    from torchtpu.distributed import empty
    from torchtpu.models.llama3.parallelize import batch_placements

    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), capturable=True, foreach=True)

    def step(inp, lab):
        loss = F.cross_entropy(model(inp).flatten(0, 1).float(), lab.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    inp = empty(batch, torch.int64, mesh=mesh, placements=batch_placements(mesh))
    lab = empty(batch, torch.int64, mesh=mesh, placements=batch_placements(mesh))
    return torchtpu.compile(step).compile_for(inp, lab)


def _all_gather_shapes(hlo: str) -> set:
    return {m.group(1) for m in re.finditer(r"=\s*\(?(\w+\[[\d,]*\])[^=]*?\sall-gather(?:-start)?\(", hlo)}


@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2"])
def test_sharded_llama_step_compiles_for_tpu_topologies(topology):
    """Ahead-of-time compilation for real TPU chips, without a TPU (libtpu's topology)."""
    from torchtpu.distributed import topology as topo

    if not topo.libtpu_available():
        pytest.skip("libtpu is not installed (pip install 'torchtpu[tpu]')")
    devices = topo.topology_devices(topology)
    assert len(devices) == 4 and devices[0].platform == "tpu"

    # FSDP over the 4 chips: parameters gathered before use, gradients reduce-scattered
    mesh = init_device_mesh("tpu", (4,), mesh_dim_names=("dp_shard",), devices=devices)
    compiled = _compile_step_for(_tiny_llama_on(mesh), mesh)
    report = topo.compile_report(compiled, mesh.jax_mesh)
    assert report["collectives"]["all-gather"] > 0 and report["collectives"]["reduce-scatter"] > 0
    assert report["fits"] and 0 < report["hbm_bytes_needed"] < report["hbm_bytes_available"]
    assert report["flops_per_device"] > 0

    # tensor parallelism over the 4 chips: rowwise layers reduce, no TP weight is gathered whole
    mesh = init_device_mesh("tpu", (4,), mesh_dim_names=("tp",), devices=devices)
    model = _tiny_llama_on(mesh)
    compiled = _compile_step_for(model, mesh)
    report = topo.compile_report(compiled, mesh.jax_mesh)
    c = report["collectives"]
    assert c["all-reduce"] + c["reduce-scatter"] > 0
    hlo = compiled.as_text()
    whole = set()
    for mod in model.modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
            shape = ",".join(map(str, mod.weight.shape))
            whole |= {f"{dt}[{shape}]" for dt in ("f32", "bf16")}
    assert not (_all_gather_shapes(hlo) & whole), _all_gather_shapes(hlo) & whole
    assert report["fits"]


# ----------------------------------------------------------------------------- per-device code


def test_local_map_residuals_are_saved_tensors():
    """local_map's backward (the shard_map's vjp) takes its residuals through PyTorch's saved-tensor
    hooks (here moved to the host and back, so it can only have them from the hooks), so activation
    checkpointing can drop them; the gradient is x * sin(x)'s."""
    from torchtpu.distributed import local_map

    mesh = init_device_mesh("tpu", (8,), mesh_dim_names=("dp",))
    x = torch.linspace(-2.0, 2.0, 32).reshape(8, 4)
    d = distribute_tensor(x, mesh, (Shard(0),)).requires_grad_()
    packed = []

    def pack(t):
        packed.append(t.numel())
        return t.to("cpu")

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.to("tpu")):
        out = local_map(lambda t: t * torch.sin(t), (Shard(0),), [(Shard(0),)], device_mesh=mesh)(d)
    assert sum(packed) >= x.numel(), packed  # sin(x) and x at least
    out.sum().backward()
    torch.testing.assert_close(d.grad.cpu(), torch.sin(x) + x * torch.cos(x), rtol=1e-6, atol=1e-6)


def test_local_map_with_functional_collectives_matches_numpy():
    import torch.distributed._functional_collectives as funcol

    from torchtpu.distributed import local_map

    mesh = init_device_mesh("tpu", (2, 4), mesh_dim_names=("dp", "tp"))
    x = torch.arange(32.0).reshape(8, 4)
    d = distribute_tensor(x, mesh, (Replicate(), Shard(0))).requires_grad_()

    def per_device(t):  # t: this device's (2, 4) block
        total = funcol.all_reduce(t, "sum", mesh["tp"])
        gathered = funcol.all_gather_single(t, 0, "tp")
        scattered = funcol.reduce_scatter_single(gathered, "sum", 0, (mesh, 1))
        return total, gathered, scattered

    rep, row = (Replicate(), Replicate()), (Replicate(), Shard(0))
    total, gathered, scattered = local_map(per_device, [rep, rep, row], [row], device_mesh=mesh)(d)
    blocks = x.reshape(4, 2, 4)
    assert torch.equal(total.cpu(), blocks.sum(0))
    assert torch.equal(gathered.cpu(), x)
    assert torch.equal(scattered.cpu(), 4 * x)
    (total.sum() + scattered.sum()).backward()
    assert torch.equal(d.grad.cpu(), torch.full((8, 4), 5.0))
    with pytest.raises(RuntimeError, match="inside torchtpu.distributed.local_map"):
        funcol.all_reduce(d, "sum", mesh["tp"])

    # all_to_all over tp: each device's (4, 4) block is split in 4 rows; row i goes to device i
    y = torch.arange(64.0).reshape(16, 4)
    swapped = local_map(
        lambda t: funcol.all_to_all_single(t, None, None, mesh["tp"]) * 1, row, [row], device_mesh=mesh
    )(distribute_tensor(y, mesh, row))
    blocks = y.reshape(4, 4, 4)  # (source device, row, col)
    assert torch.equal(swapped.cpu().reshape(4, 4, 4), blocks.transpose(0, 1))


def test_loss_parallel_cross_entropy_matches_cpu_without_gathering_logits():
    from torchtpu.distributed import loss_parallel

    mesh = init_device_mesh("tpu", (2, 4), mesh_dim_names=("dp", "tp"))
    logits = torch.randn(4, 6, 16)
    target = torch.randint(0, 16, (4, 6))
    target[0, 0] = -100
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.flatten(0, 1), target.flatten(0, 1))
    ref.backward()
    d = distribute_tensor(logits, mesh, (Shard(0), Shard(2))).requires_grad_()
    t = distribute_tensor(target, mesh, (Shard(0), Replicate()))

    def loss_fn(lg, tg):
        with loss_parallel():
            return F.cross_entropy(lg.flatten(0, 1), tg.flatten(0, 1))

    loss = loss_fn(d, t)
    assert abs(loss.item() - ref.item()) < 1e-5
    loss.backward()
    assert torch.allclose(d.grad.cpu(), ref_logits.grad, atol=1e-6)
    assert spec(d.grad) == P("dp", None, "tp")
    # compiled: no all-gather produces the whole logits
    step = torchtpu.compile(lambda lg, tg: loss_fn(lg, tg).detach())
    step(d.detach(), t)
    step(d.detach(), t)
    assert "f32[4,6,16]" not in _all_gather_shapes(step.as_text()) and "f32[24,16]" not in _all_gather_shapes(
        step.as_text()
    )
