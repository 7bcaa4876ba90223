"""The trainer loop (torchtpu.train.trainer): real torchtitan Llama 3 debug model, real data, FSDP over
the 8 XLA CPU devices, one compiled program per step. No mocks.

Kept small for a 2-core machine: short sequences, one sequence per data-parallel rank, a handful of
steps. The same job runs in-process twice (uninterrupted with checkpoints, then resumed), which
gives both the loss-parity and the resume checks; the `make train` equivalent runs as a real
process through the command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import torchtpu  # noqa: F401
from tests.processes import DEFAULT_CPU_PIPELINE
from torchtpu.backend.aot import compiler_options
from torchtpu.backend.tensor import storage_of
from torchtpu.cli import train_main
from torchtpu.train.config.manager import load_config

from .debug_run import DEBUG_TOML, REPO, debug_argv
from .reference import cpu_state, reference_losses

PY = sys.executable

SEQ, LBS, STEPS = 32, 1, 6
# the in-process jobs train a 2-block copy of the debug model (the CPU reference too): what they
# check does not depend on the depth; the CLI test trains the shipped config at its real depth
N_LAYERS = 2


def small_argv(dump, *extra):
    return debug_argv(dump, STEPS, *extra, seq_len=SEQ, local_batch_size=LBS, log_freq=1, warmup_steps=3)


# the trainer sets the process's current device mesh
pytestmark = pytest.mark.usefixtures("keep_current_mesh")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run A: 6 steps, checkpoint every 3. Run B: a new trainer in the same folder resumes from step 3."""
    from torchtpu.train.trainer import Trainer

    dump = tmp_path_factory.mktemp("trainer")
    argv = small_argv(
        dump,
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        "--checkpoint.keep_latest_k",
        "0",
        "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype",
        "bfloat16",
    )
    cfg = load_config(argv)
    a = Trainer(cfg, n_layers=N_LAYERS)
    init = cpu_state(a.model)
    hist_a = a.train()
    traces = a.step_fn.stats.snapshot()
    final = cpu_state(a.model)
    del a
    cfg_b = load_config(argv + ["--checkpoint.load_step", "3"])
    b = Trainer(cfg_b, n_layers=N_LAYERS)
    hist_b = b.train()
    return {
        "cfg": cfg,
        "init": init,
        "a": hist_a,
        "b": hist_b,
        "dump": dump,
        "traces": traces,
        "final": final,
        "argv": argv,
    }


def test_loss_parity_and_checkpoint_resume(runs):
    """One job (kept in one test so parallel test workers do not both run it):

    1. FSDP over 8 devices, compiled step: the first 5 losses match a plain PyTorch loop on the CPU
       (same weights, batches, AdamW, LR schedule, clipping) within 1e-4 relative.
    2. 6 steps with checkpoints every 3; a new trainer resumed from step 3 reproduces steps 4-6.
    """
    ref = reference_losses(runs["cfg"], runs["init"], 5, model_overrides={"n_layers": N_LAYERS})
    got = [h["loss"] for h in runs["a"][:5]]
    assert [h["step"] for h in runs["a"]] == list(range(1, STEPS + 1))
    rel = [abs(g - r) / abs(r) for g, r in zip(got, ref)]
    print(f"trainer {got}\nCPU     {ref}\nmax relative difference {max(rel):.2e}")
    assert max(rel) <= 1e-4, (got, ref)
    # one trace/compile, and every step (the first included) runs the compiled program
    assert runs["traces"] == {"traces": 1, "executions": STEPS}
    # the lr logged is the schedule's (warm-up of 3 steps to 8e-4)
    assert runs["a"][0]["lr"] == pytest.approx(8e-4 / 3)
    assert runs["a"][2]["lr"] == pytest.approx(8e-4)

    dump = runs["dump"]
    assert sorted(os.listdir(os.path.join(dump, "checkpoint"))) == ["step_3", "step_6"]
    a = {h["step"]: h["loss"] for h in runs["a"]}
    b = {h["step"]: h["loss"] for h in runs["b"]}
    print(f"uninterrupted {a}\nresumed       {b}")
    assert sorted(b) == [4, 5, 6]
    for s in (4, 5, 6):
        assert b[s] == pytest.approx(a[s], rel=1e-5, abs=0), (s, a, b)
    # metrics.jsonl holds both runs' lines
    lines = [json.loads(ln) for ln in open(os.path.join(dump, "metrics.jsonl"))]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6, 4, 5, 6]


def test_final_model_only_save_resume_and_initial_load(runs, tmp_path):
    """last_save_model_only + export_dtype: the final save of run A (step 6) holds only the weights, in
    bfloat16. A job in the same folder finds the run complete; one with more steps resumes from the newest
    full checkpoint (step 3); a new job starts from the final weights through initial_load_path."""
    from torchtpu.train.checkpoint.manager import CheckpointError, CheckpointManager, is_model_only
    from torchtpu.train.trainer import Trainer

    folder = os.path.join(runs["dump"], "checkpoint")
    ck = CheckpointManager(folder, interval=1, async_mode="sync")
    final_tree, full_tree = ck.manifest(STEPS), ck.manifest(3)
    ck.close()
    parts = dict(final_tree["dict"])
    assert is_model_only(final_tree) and not is_model_only(full_tree)
    assert sorted(parts) == ["model", "model_only", "step"]
    dtypes_saved = {n["dtype"] for _, n in parts["model"]["dict"] if "array" in n}
    assert "bfloat16" in dtypes_saved and "float32" not in dtypes_saved, dtypes_saved
    assert all("_checkpoint_wrapped_module" not in k for k, _ in parts["model"]["dict"])
    assert "optimizer" in dict(full_tree["dict"])
    want = {k: v.to(torch.bfloat16).float() for k, v in runs["final"].items()}

    # same folder, same steps: nothing left to train; the model holds the exported weights
    done = Trainer(load_config(runs["argv"]), n_layers=N_LAYERS)
    assert done.maybe_resume() and done.step == STEPS
    got = cpu_state(done.model)
    assert all(torch.equal(got[k], want[k]) for k in want)
    del done
    # more steps: the model-only save cannot give optimizer state; the full step-3 checkpoint does
    more = Trainer(load_config(runs["argv"] + ["--training.steps", "8"]), n_layers=N_LAYERS)
    assert more.maybe_resume() and more.step == 3
    del more
    with pytest.raises(CheckpointError, match="initial_load_path"):
        Trainer(
            load_config(runs["argv"] + ["--training.steps", "8", "--checkpoint.load_step", str(STEPS)]),
            n_layers=N_LAYERS,
        ).maybe_resume()
    # a new job (checkpointing off) starting from the exported weights
    new = Trainer(
        load_config(small_argv(tmp_path, "--checkpoint.initial_load_path", os.path.join(folder, f"step_{STEPS}"))),
        n_layers=N_LAYERS,
    )
    assert not new.maybe_resume() and new.step == 0
    got = cpu_state(new.model)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    # asking for the whole state of a model-only save is a config error naming the fix
    from torchtpu.train.config.job_config import ConfigError

    bad = Trainer(
        load_config(
            small_argv(
                tmp_path / "b",
                "--checkpoint.initial_load_path",
                os.path.join(folder, f"step_{STEPS}"),
                "--checkpoint.no-initial_load_model_only",
            )
        ),
        n_layers=N_LAYERS,
    )
    with pytest.raises(ConfigError, match="initial_load_model_only = true"):
        bad.maybe_resume()


def test_tensor_parallel_trainer_matches_fsdp(runs, tmp_path):
    """TP2 x FSDP4 (sequence parallel, loss_parallel: vocabulary-split logits) from run A's initial
    weights, on the same global batches: the first 3 losses equal run A's (FSDP8)."""
    from torchtpu.train.trainer import Trainer

    cfg = load_config(
        small_argv(
            tmp_path,
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.steps",
            "3",
            "--training.local_batch_size",
            str(2 * LBS),
            "--validation.no-enable",  # the losses compared are the training steps'
        )
    )
    t = Trainer(cfg, n_layers=N_LAYERS)
    assert t.dims.tp == 2 and t.dims.dp == 4 and t.dims.global_batch_size == runs["cfg"].training.local_batch_size * 8
    init = runs["init"]
    with torch.no_grad():
        for name, p in t.model.named_parameters():
            p.copy_(init[name.replace("_checkpoint_wrapped_module.", "")])
    hist = t.train()
    got = [h["loss"] for h in hist]
    want = [h["loss"] for h in runs["a"][:3]]
    print(f"TP2xFSDP4 {got}\nFSDP8     {want}")
    assert got == pytest.approx(want, rel=1e-4)


def test_lr_schedule_reaches_the_compiled_step():
    """The learning rate is a program input: a schedule that drops it to 0 freezes the parameters."""
    from torch.optim.lr_scheduler import LambdaLR

    from torchtpu.train.optimizer import build_optimizer

    cfg = load_config(["--optimizer.lr", "0.1", "--optimizer.weight_decay", "0.0"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to("tpu")
    opt = build_optimizer(list(model.parameters()), cfg)
    sched = LambdaLR(opt, lambda s: 1.0 if s < 3 else 0.0)

    @torchtpu.compile
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    x = torch.randn(5, 4).to("tpu")
    snapshots = []
    for _ in range(6):
        step(x)
        sched.step()
        snapshots.append(model.weight.detach().cpu().clone())
    assert step.stats.traces == 1
    moved = [not torch.equal(snapshots[i], snapshots[i + 1]) for i in range(5)]
    # steps 2 and 3 (compiled) used lr 0.1; steps 4..6 (same executable) used lr 0
    assert moved == [True, True, False, False, False]


def test_config_errors_exit_2_one_line(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # a tokenizer with more ids than the debug model's 2048-entry vocabulary
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(3000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    status = train_main(
        ["--config", DEBUG_TOML, "--model.hf_assets_path", str(tmp_path), "--job.dump_folder", str(tmp_path / "out")]
    )
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "3003" in lines[0] and "2048" in lines[0] and "hf_assets_path" in lines[0], err

    status = train_main(
        [
            "--config",
            DEBUG_TOML,
            "--parallelism.data_parallel_shard_degree",
            "3",
            "--job.dump_folder",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "data_parallel_shard_degree" in lines[0], err
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")


def test_debug_config_trains_through_the_cli(tmp_path):
    """`make train` in small: the shipped debug config, run as a program, writes metrics.jsonl and learns."""
    dump = tmp_path / "debug"
    steps = 20
    argv = [
        PY,
        "-m",
        "torchtpu.train",
        "--config",
        DEBUG_TOML,
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        str(steps),
        "--training.local_batch_size",
        "1",
        "--training.seq_len",
        "64",
        "--lr_scheduler.warmup_steps",
        "4",
        "--metrics.log_freq",
        "5",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "10",
    ]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the config's [tpu] xla_flags must do it
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [json.loads(ln) for ln in open(dump / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [1, 5, 10, 15, 20]
    for r in lines:
        for key in ("step", "loss", "grad_norm", "lr", "tps", "mfu", "tflops", "step_time"):
            assert isinstance(r[key], (int, float)), (key, r)
        assert r["tps"] > 0 and r["mfu"] > 0
    first, last = lines[0]["loss"], lines[-1]["loss"]
    assert 7.0 < first < 9.0  # ~ln(2048) at initialization
    assert last < 0.6 * first, lines
    assert "over 8 cpu devices" in p.stdout
    # jax.profiler traces of steps 10 and 20
    for it in (10, 20):
        traces = list((dump / "profile_traces" / f"iteration_{it}").rglob("*.xplane.pb"))
        assert traces, sorted(str(x) for x in dump.rglob("*"))


def test_dry_run_compiles_without_allocating(tmp_path, capsys):
    """--dry-run builds the job on lazy tensors, compiles the step ahead of time and reports; nothing is filled."""
    from torchtpu.train.trainer import Trainer

    cfg = load_config(small_argv(tmp_path, "--dry-run"))
    t = Trainer(cfg, n_layers=N_LAYERS)
    assert t.dataloader is None
    # XLA:CPU's default pipeline, as a user's dry run on CPU devices compiles (the tests' classic emitters
    # expand the embedding's scatter-add into a while loop, which the costing reports as a loop)
    with compiler_options(DEFAULT_CPU_PIPELINE):
        status = t.dry_run()
    out = capsys.readouterr().out
    assert status == 0
    for needle in ("HBM needed / device", "flops / device", "all-gather", "model FLOPs / step", "dry run: compiled"):
        assert needle in out, out
    # parameters and optimizer state were never created on any device
    params = list(t.model.parameters())
    assert params and all(storage_of(p).array is None for p in params)
    assert all(
        storage_of(v).array is None
        for st in t.optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_weights_initialized_in_fused_eager_equal_op_by_op_initialization(tmp_path):
    """The trainer runs the model's init_weights in fused eager (a few programs instead of one per
    op); the weights equal, bit for bit, those of op-by-op initialization (debug mode keeps it)."""
    from tests.train.reference import cpu_state
    from torchtpu.train.trainer import Trainer

    cfg = load_config(small_argv(tmp_path, "--validation.enable", "false"))
    fused = cpu_state(Trainer(cfg, n_layers=N_LAYERS).model)
    with torchtpu.eager_mode("debug"):
        op_by_op = cpu_state(Trainer(cfg, n_layers=N_LAYERS).model)
    assert fused.keys() == op_by_op.keys() and len(fused) > 10
    for name, value in fused.items():
        assert torch.equal(value, op_by_op[name]), name
