"""FLOPs per token, peak FLOP/s, the metrics logger (jsonl, console, TensorBoard, W&B offline),
and the learning-rate schedule against torchtitan's own."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from torchtpu.train import metrics as M
from torchtpu.train.lr import build_lr_scheduler, lr_multiplier
from torchtpu.train.metrics import MetricsLogger, model_flops_per_token, num_flops_per_token, peak_flops

# ---------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("flavor,seq_len", [("debugmodel", 2048), ("8B", 8192)])
def test_flops_per_token_matches_torchtitan(flavor, seq_len):
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import Transformer

    args = llama3_args[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    assert model_flops_per_token(model, args, seq_len) == args.get_nparams_and_flops(model, seq_len)
    head_dim = args.dim // args.n_heads
    _, non_emb = M.non_embedding_params(model)
    assert num_flops_per_token(non_emb, args.n_layers, args.n_heads, head_dim, seq_len) == (
        6 * non_emb + 12 * args.n_layers * args.n_heads * head_dim * seq_len
    )


# ---------------------------------------------------------------------------- peak FLOP/s


@pytest.mark.parametrize(
    "kind,tflops,name",
    [
        ("TPU v4", 275, "TPU v4"),
        ("TPU v5 lite", 197, "TPU v5e"),
        ("TPU v5e", 197, "TPU v5e"),
        ("TPU v5", 459, "TPU v5p"),
        ("TPU v5p", 459, "TPU v5p"),
        ("TPU v6 lite", 918, "TPU v6e"),
        ("TPU v6e", 918, "TPU v6e"),
    ],
)
def test_peak_flops_tpu_table(kind, tflops, name):
    assert peak_flops(kind) == (tflops * 1e12, f"table: {name}")


def test_peak_flops_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(M, "_MEMO", {})
    flops, where = peak_flops("cpu")
    path = tmp_path / "peak_flops.json"
    assert where.startswith("measured once on cpu") and "float32" in where and str(path) in where
    assert 1e8 < flops < 1e14
    entry = json.loads(path.read_text())["cpu:cpu"]
    assert entry["flops"] == flops and entry["dtype"] == "float32"
    # A new process (empty memo) reads the file instead of measuring: plant a value and get it back.
    path.write_text(json.dumps({"cpu:cpu": dict(entry, flops=123.0e9)}))
    monkeypatch.setattr(M, "_MEMO", {})
    assert peak_flops(None) == (123.0e9, where)
    with pytest.raises(ValueError, match="no peak FLOP/s known.*TPU v99"):
        peak_flops("TPU v99")


# ---------------------------------------------------------------------------- logger


def _metrics(step):
    return {
        "loss": 5.0 / step,
        "grad_norm": 1.5,
        "lr": 3e-4 * step,
        "tps": 1234.5,
        "tflops": 0.5,
        "mfu": 12.5,
        "step_time": 0.25,
        "memory_gib": 1.5,
    }


def test_logger_jsonl_console_and_tensorboard(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(str(tmp_path / "run"), log_freq=2, enable_tensorboard=True, enable_wandb=False, total_steps=6)
    steps = [s for s in range(1, 7) if log.should_log(s)]
    assert steps == [1, 2, 4, 6]
    for s in steps:
        log.log(s, dict(_metrics(s), loss=torch.tensor(5.0 / s)))  # tensors are accepted too
    log.close()
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step")]
    assert len(lines) == len(steps)
    assert lines[1] == (
        "step 2/6 | eta 0:00:00 | loss 2.5000 | grad_norm 1.5000 | lr 6.000e-04 | tps 1,234 | tflops 0.50 | mfu 12.50%"
        " | step 0.250s | mem 1.50GiB"
    )
    # the first line's ETA is its own step time times the steps left: 0.25 s x 5
    assert lines[0].startswith("step 1/6 | eta 0:00:01 | loss 5.0000")
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == steps
    for r in records:
        assert {"step", "loss", "grad_norm", "lr", "tps", "mfu"} <= set(r)
        assert r["loss"] == pytest.approx(5.0 / r["step"])
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    assert {"loss", "grad_norm", "lr", "tps", "mfu", "tflops"} <= set(acc.Tags()["scalars"])
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == steps
    assert [e.value for e in loss] == pytest.approx([5.0 / s for s in steps])


def test_logger_non_main_process_writes_nothing(tmp_path, capsys):
    log = MetricsLogger(str(tmp_path / "run"), 1, enable_tensorboard=True, enable_wandb=True, is_main_process=False)
    log.log(1, _metrics(1))
    log.close()
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().out == ""


def test_logger_wandb_offline(tmp_path):
    """W&B in offline mode, run files under dump_folder. Run in a subprocess with a timeout so a
    network problem cannot hang the suite; the module is loaded from its file so the child does
    not import torch or jax (only wandb)."""
    script = textwrap.dedent(
        f"""
        import importlib.util, json
        spec = importlib.util.spec_from_file_location("metrics_under_test", {M.__file__!r})
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        log = m.MetricsLogger({str(tmp_path / "run")!r}, 1, enable_tensorboard=False, enable_wandb=True,
                              wandb_project="torchtpu-test", run_name="t", config_dict={{"lr": 0.1}})
        for step in (1, 2, 3):
            log.log(step, {{"loss": 1.0 / step, "grad_norm": 1.0, "lr": 0.1, "tps": 10.0, "mfu": 1.0}})
        print("MODE", log.wandb_mode)
        log.close()
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_CONFIG_DIR=str(tmp_path / "cfg"),
        WANDB_CACHE_DIR=str(tmp_path / "cache"),
        WANDB_DATA_DIR=str(tmp_path / "data"),
    )
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "MODE offline" in res.stdout
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "run").rglob("*"))[:20]
    assert list(runs[0].glob("*.wandb")), list(runs[0].iterdir())
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3


# ---------------------------------------------------------------------------- lr schedule

LR_CASES = [
    dict(warmup_steps=2, decay_ratio=None, decay_type="linear", min_lr_factor=0.0, training_steps=10),
    dict(warmup_steps=3, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1, training_steps=20),
    dict(warmup_steps=5, decay_ratio=0.8, decay_type="sqrt", min_lr_factor=0.05, training_steps=17),  # capped decay
    dict(warmup_steps=0, decay_ratio=0.3, decay_type="linear", min_lr_factor=0.2, training_steps=13),
    dict(warmup_steps=30, decay_ratio=None, decay_type="cosine", min_lr_factor=0.0, training_steps=12),  # capped warmup
]


@pytest.mark.parametrize("case", LR_CASES)
def test_lr_schedule_matches_torchtitan(case):
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.config import LRScheduler as LRConfig

    base = 0.01

    def opt():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)

    ours_opt, theirs_opt = opt(), opt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = build_lr_scheduler(ours_opt, **case)
        theirs = build_lr_schedulers(
            [theirs_opt],
            LRConfig(
                warmup_steps=case["warmup_steps"],
                decay_ratio=case["decay_ratio"],
                decay_type=case["decay_type"],
                min_lr_factor=case["min_lr_factor"],
            ),
            case["training_steps"],
        )
        for step in range(case["training_steps"]):
            lr = ours_opt.param_groups[0]["lr"]
            assert lr == pytest.approx(theirs_opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15), step
            assert lr == pytest.approx(base * lr_multiplier(step, **case), rel=1e-12)
            assert lr > 0
            ours.step()
            theirs.step()


def test_lr_schedule_shape():
    c = dict(warmup_steps=4, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.1, training_steps=20)
    m = [lr_multiplier(s, **c) for s in range(20)]
    assert m[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert m[4:11] == [1.0] * 7
    assert all(a > b for a, b in zip(m[10:], m[11:]))
    assert m[-1] == pytest.approx(0.1 + 0.9 * 0.1)
    with pytest.raises(ValueError, match="decay_type"):
        build_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 1, None, "step", 0.0, 10)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_lr_scheduler_with_tensor_lr():
    c = dict(warmup_steps=2, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1, training_steps=8)
    # capturable optimizer with a tensor lr: the scheduler writes the same tensor in place
    lr = torch.tensor(0.1)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr, capturable=True)
    sched = build_lr_scheduler(opt, **c)
    for step in range(8):
        assert opt.param_groups[0]["lr"] is lr
        assert lr.item() == pytest.approx(0.1 * lr_multiplier(step, **c), rel=1e-6)
        sched.step()
    assert opt.param_groups[0]["initial_lr"].item() == pytest.approx(0.1)
    # and real CPU optimizer steps read the scheduled tensor
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=torch.tensor(1.0))
    sched = build_lr_scheduler(opt, **c)
    expected = 0.0
    for step in range(8):
        p.grad = torch.ones(1)
        expected -= lr_multiplier(step, **c)
        opt.step()
        sched.step()
        assert p.item() == pytest.approx(expected, rel=1e-6)
