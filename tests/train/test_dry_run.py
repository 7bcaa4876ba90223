"""The dry run's step-time estimate: honest through loops over layers (torchtpu/train/dry_run/estimate.py).

XLA's cost analysis costs a while-loop body once, so a program whose layers run under lax.scan
reports a fraction of its work. The dry run costs the step from 2- and 4-layer copies without loops
(a scanned job's keep its scan, unrolled into straight-line code) and extrapolates to the model's
depth; these tests check that against XLA's own figures for the whole program without loops, on TPU
v5p programs compiled ahead of time.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torchtpu.costing import depth_extrapolated_cost
from torchtpu.distributed.topology import (
    aot_compile,
    compile_report,
    costing_compiles,
    libtpu_available,
    topology_mesh,
)

pytestmark = pytest.mark.skipif(not libtpu_available(), reason="libtpu is not installed")

TOPOLOGY = "v5p:2x2x1"
DIM, BATCH, DEPTH = 512, 2048, 8
# the debug model's depth in the trainer's dry run: the shallowest it is costed by extrapolation at
# (deeper than the 4-layer costing copy), one layer less of the full program to compile than its 6
DEBUG_DEPTH = 5


def _block(h, w):
    # a pre-norm residual MLP block: matmuls, a nonlinearity and a normalization, as in a decoder
    x = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    return h + jax.nn.silu(x @ w[0]) @ w[1]


def _report(n_layers: int, scan: bool):
    mesh = topology_mesh(TOPOLOGY, (4,), ("dp",))
    block = jax.checkpoint(_block)  # full recomputation, as the trainer's configs use

    def loss(ws, emb, x):
        h = x @ emb
        if scan and n_layers:
            h, _ = jax.lax.scan(lambda c, w: (block(c, w), None), h, ws)
        else:
            for i in range(n_layers):
                h = block(h, ws[i])
        return jnp.mean(jnp.square(h @ emb.T))

    def step(ws, emb, x):
        g_ws, g_emb = jax.grad(loss, argnums=(0, 1))(ws, emb, x)
        return ws - 1e-3 * g_ws, emb - 1e-3 * g_emb

    ws = jax.ShapeDtypeStruct((n_layers, 2, DIM, DIM), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, None, "dp")))
    emb = jax.ShapeDtypeStruct((DIM, DIM), jnp.bfloat16, sharding=NamedSharding(mesh, P("dp")))
    x = jax.ShapeDtypeStruct((BATCH, DIM), jnp.bfloat16, sharding=NamedSharding(mesh, P("dp")))
    compiled = aot_compile(jax.jit(step).lower(ws, emb, x))
    return compile_report(compiled, mesh)


def test_scanned_estimate_equals_unrolled_within_5_percent():
    unrolled = _report(DEPTH, scan=False)
    scanned = _report(DEPTH, scan=True)
    # the blind spot being corrected: XLA's raw figures for the scanned program count one layer
    assert [lp["trip_count"] for lp in scanned["while_loops"]] == [DEPTH, DEPTH]  # forward and backward loops
    assert not unrolled["while_loops"]
    assert scanned["flops_per_device"] < 0.5 * unrolled["flops_per_device"]
    # the dry run's method: the same program unrolled at 2 and 4 layers, extrapolated to 8
    est = depth_extrapolated_cost(_report(2, scan=False), _report(4, scan=False), 2, 4, DEPTH)
    for key in ("flops_per_device", "estimated_step_seconds"):
        truth = unrolled[key]
        assert truth and truth > 0, key
        assert est[key] == pytest.approx(truth, rel=0.05), (key, est[key], truth)


def test_costing_compiles_count_every_step_of_a_collective_matmul():
    """XLA's TPU compiler may turn a matmul whose weight is sharded along the contraction (FSDP) into
    a loop over the weight's shards that overlaps each all-gather step with a slice of the matmul
    (windowed einsum); its cost analysis then counts one trip of that loop. The pure-JAX Llama 3 70B
    reference on v5p:4x4x4 has such loops (bench/tpu_step.py), so they must not go uncounted there,
    nor in a dry run whose program gets them. Here: one MLP's weight gradients, FSDP 8 x TP 8, at 70B's
    sizes (compiled ahead of time: no memory is used)."""
    mesh = topology_mesh("v5p:4x4x4", (8, 8), ("fsdp", "tp"))
    seq, dim, hidden = 8192, 8192, 28672

    def loss(w1, w2, x):
        h = jax.lax.with_sharding_constraint(x @ w1, NamedSharding(mesh, P("fsdp", None, "tp")))
        y = jax.lax.with_sharding_constraint(jax.nn.silu(h) @ w2, NamedSharding(mesh, P("fsdp", None, None)))
        return jnp.mean(y.astype(jnp.float32) ** 2)

    def sds(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))

    args = (sds((dim, hidden), P("fsdp", "tp")), sds((hidden, dim), P("tp", "fsdp")), sds((8, seq, dim), P("fsdp")))
    # the matmuls' FLOPs per chip: h, y, dW1, dW2 and dh (x needs no gradient), 8 sequences over 64 chips
    matmul_flops = 5 * 2 * seq * dim * hidden / 8

    def report():
        return compile_report(aot_compile(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args)), mesh)

    plain = report()
    assert [lp["trip_count"] for lp in plain["while_loops"]] == [4]  # the blind spot, as XLA compiles it
    assert plain["flops_per_device"] < 0.95 * matmul_flops
    with costing_compiles(mesh):
        costed = report()
    assert not costed["while_loops"]
    assert costed["flops_per_device"] == pytest.approx(matmul_flops, rel=0.01)
    assert costed["estimated_step_seconds"] > plain["estimated_step_seconds"]


def test_costing_compiles_past_oom_change_nothing_for_a_program_that_fits():
    """The dry run compiles its costing copies with `xla_tpu_no_crash_on_oom`
    (topology.PAST_OOM_COMPILER_OPTIONS): an unrolled copy may need more HBM than the scanned step
    (DeepSeek-V3 671B's does). A program that fits reports the same figures with the option as
    without; one that does not fit, which XLA refuses without it, compiles, reports that it does not
    fit, and the estimate's method says so. The option also lets a kernel needing more VMEM than the
    chip has compile, which is why only programs a checked compile has vetted get it."""
    from jax.experimental import pallas as pl

    from torchtpu.train.dry_run.estimate import out_of_memory_line, with_fit_note

    with costing_compiles(topology_mesh(TOPOLOGY, (4,), ("dp",)), past_oom=True):
        past = _report(2, scan=False)
    with costing_compiles(topology_mesh(TOPOLOGY, (4,), ("dp",))):
        checked = _report(2, scan=False)
    assert past["fits"] and past["estimated_step_seconds"] > 0 and past["flops_per_device"] > 0
    assert past == checked

    mesh = topology_mesh(TOPOLOGY, (4,), ("dp",))
    # 32 GiB per device in, 64 GiB out: more than a v5p chip's 95 GiB of HBM
    x = jax.ShapeDtypeStruct((4 * 65536, 2 * 65536), jnp.float32, sharding=NamedSharding(mesh, P("dp")))
    lowered = jax.jit(lambda x: (jnp.sin(x), jnp.cos(x))).lower(x)
    with costing_compiles(mesh), pytest.raises(Exception, match="Ran out of memory"):
        aot_compile(lowered)
    with costing_compiles(mesh, past_oom=True):
        over = compile_report(aot_compile(lowered), mesh)
    assert over["fits"] is False and over["hbm_bytes_needed"] >= 96 * 1024**3
    est = {"method": "extrapolated", "estimated_step_seconds": 0.5}
    assert with_fit_note(est, [past, past]) == est
    noted = with_fit_note(est, [past, over])
    assert noted["estimated_step_seconds"] == 0.5
    assert "the 4-layer one needs 96.00 GiB of 95.00 GiB per device" in noted["method"], noted["method"]
    assert "2-layer" not in noted["method"]

    # a Pallas kernel whose 64 MiB input and output blocks exceed a v5p core's VMEM
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    block = pl.BlockSpec((4096, 4096), lambda i: (jnp.int32(0), jnp.int32(0)))
    big = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    call = pl.pallas_call(kernel, out_shape=big, grid=(1,), in_specs=[block], out_specs=block)
    lowered = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)).lower(
        jax.ShapeDtypeStruct(big.shape, big.dtype, sharding=NamedSharding(mesh, P()))
    )
    with costing_compiles(mesh), pytest.raises(Exception, match="memory space vmem") as vmem:
        aot_compile(lowered)
    # the dry run's line for it names VMEM, not HBM, and gives no sharding hint
    line = out_of_memory_line(str(vmem.value), TOPOLOGY, "shard more")
    assert "a kernel needs more VMEM" in line and "Ran out of memory in memory space vmem" in line, line
    assert "shard more" not in line and "\n" not in line
    line = out_of_memory_line("RESOURCE_EXHAUSTED: Ran out of memory on HBM.\nmore", TOPOLOGY, "shard more")
    assert line.endswith("the XLA compiler says: RESOURCE_EXHAUSTED: Ran out of memory on HBM; shard more"), line
    with costing_compiles(mesh, past_oom=True):
        assert compile_report(aot_compile(lowered), mesh)["fits"]  # compiled: nothing in the report says


def test_trainer_estimate_matches_the_straight_line_debug_step(tmp_path, capsys, monkeypatch):
    """The dry run of the debug model (5 of its 6 layers, full recomputation) on v5p: the estimate it
    extrapolates for the trainer's own scanned step equals XLA's figure for the whole 5-layer scanned
    program with its loops unrolled into straight-line code within 5%, and the report prints the
    estimate, tokens/s per chip, MFU, the method and the largest temporaries.

    The estimate is the one `dry_run` itself computes (recorded on its way through, not computed
    again): at 5 layers it comes from the 2- and 4-layer straight-line copies of the same scanned
    job, and each TPU program here is compiled once (the whole straight-line step, the scanned step,
    2 and 4 layers)."""
    import torchtpu.train.dry_run.estimate as dry_run_module
    from torchtpu.distributed.scan import straight_line_loops
    from torchtpu.train.config.manager import load_config
    from torchtpu.train.dry_run.estimate import compile_step, dry_run, step_estimate
    from torchtpu.train.trainer import Trainer

    argv = [
        "--config",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(tmp_path),
        "--dry-run",
        "--tpu.topology",
        TOPOLOGY,
        "--activation_checkpoint.mode",
        "full",
    ]
    with straight_line_loops():
        t = Trainer(load_config(argv), n_layers=DEBUG_DEPTH)
        assert t.cfg.tpu.scan_layers
        full = compile_report(compile_step(t.built_step()), t.mesh.jax_mesh)
    assert full["estimated_step_seconds"] and not full["while_loops"]
    del t

    # the trainer's own layer scan (on by default with full recomputation): XLA's raw figures for the
    # scanned program count the loop body once; the dry run's estimate equals the straight-line one
    seen = []

    def recorded_step_estimate(trainer, report):
        est = step_estimate(trainer, report)
        seen.append((trainer.cfg.tpu.scan_layers, report, est))
        return est

    monkeypatch.setattr(dry_run_module, "step_estimate", recorded_step_estimate)
    monkeypatch.setattr(dry_run_module, "HEARTBEAT_SECONDS", 0.5)  # the 8B's 20 s, scaled to this small program
    capsys.readouterr()
    assert dry_run(Trainer(load_config(argv), n_layers=DEBUG_DEPTH).built_step()) == 0
    [(scan_layers, scanned, est)] = seen
    assert scan_layers
    assert scanned["while_loops"] and scanned["flops_per_device"] < 0.6 * full["flops_per_device"]
    assert f"unrolled 2- and 4-layer programs, extrapolated to {DEBUG_DEPTH} layers" in est["method"]
    assert "the copies keep the layer scan, unrolled into straight-line code" in est["method"]
    for key in ("flops_per_device", "estimated_step_seconds"):
        assert est[key] == pytest.approx(full[key], rel=0.05), (key, est[key], full[key])

    out = capsys.readouterr().out
    for needle in (
        "costing method",
        "estimated step",
        "tokens/s per chip",
        "MFU (estimate)",
        "largest temporaries",
        "activation recomputation 'full' expects 1.33x)",  # a dense model: no MoE layer's clause
        "dry run: it fits",
    ):
        assert needle in out, out
    assert "upper bound" not in out
    assert "64-bit / complex" not in out
    # what it is doing, while it does it: the mesh, each phase with its time, a heartbeat while compiling
    assert f"dry run: mesh dp_replicate 1 x dp_shard 4 x tp 1 = 4 devices ({TOPOLOGY})" in out, out
    for what in ("the full program", "the 2-layer costing copy", "the 4-layer costing copy"):
        assert f"dry run: lowering {what}: done in " in out and f"dry run: compiling {what}: done in " in out, out
    assert "dry run: compiling the full program: still working, " in out
    # one estimate: the scanned program's raw XLA figures (its loop body costed once) are not printed
    assert "XLA estimated step" not in out and "flops / device" not in out
    assert "below, from the costing programs (this program loops over layers)" in out


def test_an_estimate_from_costing_programs_with_loops_is_withdrawn():
    """If a costing program still holds a while loop (its body costed once), the extrapolated time
    is not shown as an estimate, and the method says why."""
    from torchtpu.train.dry_run.estimate import with_loop_warning

    est = {"method": "extrapolated", "flops_per_device": 1e12, "estimated_step_seconds": 0.5}
    assert with_loop_warning(est, [{"while_loops": []}, {}]) == est
    loop = {"name": "while.1", "body": "wide.windowed_dot_general_body_ag", "trip_count": 4}
    warned = with_loop_warning(est, [{"while_loops": []}, {"while_loops": [loop, loop]}])
    assert warned["estimated_step_seconds"] is None and warned["flops_per_device"] == 1e12
    assert "2 in the 4-layer program" in warned["method"] and "costs once" in warned["method"]


def test_costing_depths_keep_every_leading_dense_block():
    """A model whose first blocks are dense and the rest MoE (DeepSeek-V3) is costed from copies
    holding all its dense blocks and 2 and 4 MoE blocks; a model of one repeating pattern (Qwen3
    MoE, Llama 4, Llama 3) from 2 and 4 layers."""
    from torchtpu.models.registry import get_family
    from torchtpu.train.dry_run.estimate import costing_depths

    assert costing_depths(get_family("deepseek_v3").model_args("671B")) == (5, 7)  # 3 dense blocks first
    assert costing_depths(get_family("deepseek_v3").model_args("16B")) == (3, 5)  # 1 dense block first
    assert costing_depths(get_family("qwen3").model_args("30B-A3B")) == (2, 4)
    assert costing_depths(get_family("llama4").model_args("17bx16e")) == (2, 4)
    assert costing_depths(get_family("llama3").model_args("8B")) == (2, 4)


def test_a_failed_costing_copy_without_a_whole_program_report_raises_its_error():
    """When a costing copy cannot be built or compiled, the dry run falls back on the whole program's
    figures; `bench.step_estimate`, which has none, gets the costing copy's own error."""
    from types import SimpleNamespace

    from torchtpu.models.registry import get_family
    from torchtpu.train.dry_run.estimate import step_estimate

    class ShallowCopyFails:  # a built step whose shallower copies cannot be built
        model_args = get_family("deepseek_v3").model_args("16B")
        cfg = SimpleNamespace(tpu=SimpleNamespace(scan_layers=False))

        def at_depth(self, cfg, n_layers):
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM")

    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        step_estimate(ShallowCopyFails(), {})
    whole = {"flops_per_device": 1e14, "bytes_accessed_per_device": 1e11, "estimated_step_seconds": 2.0}
    est = step_estimate(ShallowCopyFails(), {**whole, "while_loops": [{"name": "while.1"}]})
    assert est["flops_per_device"] == 1e14 and est["estimated_step_seconds"] is None
    assert "depth extrapolation failed: RuntimeError: RESOURCE_EXHAUSTED" in est["method"]


def test_only_a_model_that_runs_the_layer_scan_is_costed_with_scanned_copies(tmp_path):
    """The costing copies keep the scan only where the built model runs it: Llama 4's debug flavor
    (dense and MoE blocks interleaved) turns the scan off although `[tpu] scan_layers` is on, and is
    costed with unscanned copies; the Llama 3 debug model with the scan is costed with scanned ones."""
    from torchtpu.train.config.manager import load_config
    from torchtpu.train.dry_run.estimate import _runs_layer_scan
    from torchtpu.train.trainer import Trainer

    def trainer(config, *extra):
        argv = ["--config", f"train_configs/{config}", "--job.dump_folder", str(tmp_path), "--dry-run"]
        return Trainer(load_config([*argv, "--tpu.topology", TOPOLOGY, *extra]), n_layers=2).built_step()

    llama4 = trainer("llama4_debug.toml")
    assert llama4.cfg.tpu.scan_layers and not _runs_layer_scan(llama4)
    assert _runs_layer_scan(trainer("debug_model.toml", "--activation_checkpoint.mode", "full"))
    assert not _runs_layer_scan(trainer("debug_model.toml", "--tpu.scan_layers", "false"))
