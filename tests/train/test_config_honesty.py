"""A configuration that never lies: every key of the trainer's schema either changes what the trainer
does, or a non-default value is refused with an error naming the key.

The list of keys comes from the schema itself (torchtpu.train.config.job_config), so a key added without a
behaviour (or a refusal) makes test_every_key_is_accounted_for fail. Each key is in exactly one group:

- PROBED: changing the key (alone, from a base configuration) changes `plan(cfg)`, what the
  trainer's own building blocks derive from the configuration (the resolved parallel degrees, the
  model arguments, optimizer and schedule values, the data and validation loaders, the checkpoint
  manager and when it saves, the metrics logger, the profiler, the devices, one real training step
  on a small CPU model, ...), or the command line's result;
- REFUSED: a non-default value is a one-line ConfigError naming the key;
- COVERED_BY: the behaviour needs a real training run, which the named test performs (this test
  checks that the named test exists and sets the key);
- NO_EFFECT_BY_DESIGN: [compile] enable/components, whose meaning holds because every step is
  always compiled; --help says so;
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import types

import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.train import parallel_dims as P
from torchtpu.train.config import job_config as S
from torchtpu.train.config import manager as C
from torchtpu.train.config import schema
from torchtpu.train.xla_env import xla_env_updates

KEYS = [".".join(path) for path, _ in schema.walk(S.JobConfig)]
SPECS = {".".join(path): spec for path, spec in schema.walk(S.JobConfig)}

NO_EFFECT_BY_DESIGN = {"compile.enable", "compile.components"}

# key -> a non-default value that must be refused
REFUSED = {
    "profiling.profiler_warmup": "5",
    "model.name": "mixtral",
    "training.mixed_precision_reduce": "bfloat16",
    "training.dataloader.num_workers": "2",
    "training.dataloader.persistent_workers": "true",
    "training.dataloader.prefetch_factor": "2",
    "validation.dataloader.num_workers": "2",
    "validation.dataloader.persistent_workers": "true",
    "validation.dataloader.prefetch_factor": "2",
    "parallelism.pipeline_parallel_degree": "2",
    "parallelism.context_parallel_degree": "2",
    "parallelism.expert_tensor_parallel_degree": "2",
    "compile.backend": "inductor",
}

# the real run that shows a key's behaviour -> its keys
_COVERING_RUNS = {
    "tests/train/test_trainer.py::test_final_model_only_save_resume_and_initial_load": [
        "checkpoint.initial_load_model_only",
        "checkpoint.last_save_model_only",
        "checkpoint.export_dtype",
    ],
    "tests/train/test_checkpoint.py::test_kill_9_mid_save_then_resume_and_corrupt_files": [
        "checkpoint.load_step",
        "checkpoint.exclude_from_loading",
    ],
    "tests/train/test_hf_weights.py::test_import_first_loss_equals_exporting_runs_next_loss": [
        "checkpoint.initial_load_in_hf"
    ],
    "tests/train/test_hf_weights.py::test_export_loads_in_transformers_and_logits_match": [
        "checkpoint.last_save_in_hf"
    ],
    "tests/distributed/test_scan_layers.py::test_trainer_scan_matches_pytorch_and_checkpoints_move_between_scan_and_no_scan": [
        "tpu.scan_layers"
    ],
    "tests/train/test_loss.py::test_trainer_chunked_loss_matches_plain_loss_sharded": ["tpu.loss_chunk_size"],
    "tests/train/test_families.py::test_expert_parallel_under_the_layer_scan_gives_the_ep1_losses_and_counts_and_resumes_under_another_degree": [
        "parallelism.expert_parallel_degree"
    ],
    "tests/train/test_families.py::test_flex_attention_flavors_are_refused_or_sdpa_on_request": ["model.attn_type"],
    "tests/launch/test_launch.py::test_init_timeout_bounds_the_wait_for_missing_hosts": ["comm.init_timeout_seconds"],
    "tests/launch/test_launch.py::test_stuck_host_trips_the_watchdog": [
        "comm.train_timeout_seconds",
        "debug.inject_stall",
    ],
    "tests/train/test_faults.py::test_first_job_is_untouched_and_its_log_reads_n_of_N_with_eta": [
        "training.max_bad_records"
    ],
    "tests/train/test_custom_import.py::test_a_users_op_trains_under_fsdp_with_the_reference_ops_losses": [
        "experimental.custom_import"
    ],
}
# key -> the real run that shows its behaviour
COVERED_BY = {key: run for run, keys in _COVERING_RUNS.items() for key in keys}

VALIDATION = [
    "--validation.enable",
    "--validation.dataset",
    "bundled_validation",
    "--validation.seq_len",
    "32",
    "--validation.local_batch_size",
    "1",
]
CHECKPOINTS = ["--checkpoint.enable", "--checkpoint.interval", "2"]
SLICES = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.num_slices", "2"]

# key -> (changed value, extra options both configurations get)
PROBED = {
    "job.config_file": ("CONFIG_FILE", []),
    "job.dump_folder": ("DUMP/other", []),
    "job.description": ("another run", []),
    "job.print_config": ("true", []),
    "job.save_config_file": ("resolved.toml", []),
    "profiling.enable_profiling": ("true", []),
    "profiling.save_traces_folder": ("traces2", []),
    "profiling.profile_freq": ("5", []),
    "profiling.profiler_active": ("2", []),
    "profiling.enable_memory_snapshot": ("true", []),
    "profiling.save_memory_snapshot_folder": ("mem2", ["--profiling.enable_memory_snapshot"]),
    "metrics.log_freq": ("3", []),
    "metrics.enable_tensorboard": ("true", []),
    "metrics.disable_color_printing": ("true", []),
    "metrics.save_tb_folder": ("tb2", ["--metrics.enable_tensorboard"]),
    "metrics.save_for_all_ranks": ("true", []),
    "metrics.enable_wandb": ("true", []),
    "model.flavor": ("8B", []),
    "model.hf_assets_path": ("DUMP/no-such-folder", []),
    "model.n_layers": ("2", []),
    "model.flavor_overrides": ('{"dim": 64, "n_heads": 4}', []),
    "optimizer.name": ("Adam", []),
    "optimizer.lr": ("0.01", []),
    "optimizer.beta1": ("0.8", []),
    "optimizer.beta2": ("0.9", []),
    "optimizer.eps": ("1e-6", []),
    "optimizer.weight_decay": ("0.2", []),
    "lr_scheduler.warmup_steps": ("5", []),
    "lr_scheduler.total_steps": ("30", []),
    "lr_scheduler.decay_ratio": ("0.5", []),
    "lr_scheduler.decay_type": ("cosine", []),
    "lr_scheduler.min_lr_factor": ("0.5", []),
    "training.dataset": ("bundled_validation", []),
    "training.dataset_path": ("DUMP/docs.txt", []),
    "training.local_batch_size": ("2", []),
    "training.global_batch_size": ("128", []),
    "training.seq_len": ("64", []),
    "training.max_norm": ("0.001", []),
    "training.steps": ("20", []),
    "training.dtype": ("bfloat16", []),
    "training.mixed_precision_param": ("float32", []),
    "training.gc_freq": ("7", []),
    "parallelism.data_parallel_replicate_degree": ("2", []),
    "parallelism.data_parallel_shard_degree": ("2", ["--parallelism.tensor_parallel_degree", "2"]),
    "parallelism.tensor_parallel_degree": ("2", []),
    "parallelism.num_slices": ("2", ["--parallelism.data_parallel_replicate_degree", "2"]),
    "parallelism.dcn_axis": ("dp_shard", SLICES),
    "checkpoint.enable": ("true", []),
    "checkpoint.folder": ("ckpt2", CHECKPOINTS),
    "checkpoint.interval": ("3", CHECKPOINTS),
    "checkpoint.initial_load_path": ("DUMP/no-such-checkpoint", []),
    "checkpoint.async_mode": ("async", CHECKPOINTS),
    "checkpoint.keep_latest_k": ("3", CHECKPOINTS),
    "checkpoint.enable_first_step_checkpoint": ("true", CHECKPOINTS),
    "checkpoint.load_only": ("true", CHECKPOINTS),
    "activation_checkpoint.mode": ("full", []),
    "activation_checkpoint.selective_ac_option": ("3", []),
    "validation.enable": ("true", VALIDATION[1:]),
    "validation.dataset": ("bundled", VALIDATION),
    "validation.dataset_path": ("DUMP/docs.txt", VALIDATION),
    "validation.local_batch_size": ("2", VALIDATION),
    "validation.seq_len": ("64", VALIDATION),
    "validation.freq": ("3", VALIDATION),
    "validation.steps": ("2", VALIDATION),
    "debug.seed": ("3", []),
    "debug.deterministic": ("true", []),
    "debug.verbose": ("true", []),
    "tpu.topology": ("v5p:2x2x1", []),
    "tpu.dry_run": ("true", ["--tpu.topology", "v5p:2x2x1"]),
    "tpu.xla_flags": ("--xla_dump_to=/tmp/nowhere", []),
    "tpu.libtpu_init_args": ("--xla_tpu_enable_latency_hiding_scheduler=true", []),
}


def test_every_key_is_accounted_for():
    groups = [set(PROBED), set(REFUSED), set(COVERED_BY), NO_EFFECT_BY_DESIGN]
    named = [k for g in groups for k in g]
    assert len(named) == len(set(named)), sorted(k for k in named if named.count(k) > 1)
    missing = sorted(set(KEYS) - set(named))
    assert not missing, f"keys with no proven behaviour and no refusal: {missing}"
    assert not set(named) - set(KEYS), sorted(set(named) - set(KEYS))


# ---------------------------------------------------------------------------------------------- plan


def _outcome(fn):
    """fn()'s result, or its error as ("error", type, message)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return ("error", type(e).__name__, str(e))


def _step_probe(cfg):
    """One real trainer step (step.train_step: forward, loss, backward, clipping, update) on a tiny
    CPU model standing in for the Transformer: the updated weights."""
    from torchtpu.train.step import train_step

    torch.manual_seed(0)
    model = torch.nn.Embedding(16, 16)
    ns = types.SimpleNamespace(
        cfg=cfg,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        stacked=[],  # no layer scan, no stacked parameter storage
        balanced_moe=[],  # no MoE layer moves its expert bias
        moe_layers=[],
        loss_context=contextlib.nullcontext,
    )
    x = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    loss, norm, _ = train_step(ns, [(x, x.roll(1, 1))])
    return round(float(loss), 6), round(float(norm), 6), model.weight.detach().sum().item()


def _summary(obj, names):
    return {n: getattr(obj, n) for n in names}


def plan(cfg) -> dict:
    """What the trainer's own building blocks make of `cfg` (no model is materialized, nothing compiles)."""
    import dataclasses

    from torchtpu.train import build as T
    from torchtpu.train import model_builder as M
    from torchtpu.train.lr import build_schedule
    from torchtpu.train.metrics import build_metrics_logger
    from torchtpu.train.optimizer import build_optimizer
    from torchtpu.train.profiling import Profiler
    from torchtpu.train.tokenizer import build_tokenizer
    from torchtpu.train.validate import build_validator

    out: dict = {}
    out["devices"] = _outcome(lambda: [d.platform for d in P.job_devices(cfg)])
    dims = _outcome(lambda: P.resolve_dims(cfg, 8))
    out["dims"] = dims
    out["model_args"] = _outcome(lambda: dataclasses.asdict(M.build_model_args(cfg, None)))
    out["dtype"] = _outcome(
        lambda: str(next(M.build_meta_model(cfg, M.build_model_args(cfg, None)).parameters()).dtype)
    )
    out["mixed_precision"] = M.mixed_precision_dtypes(cfg)
    out["activation_checkpoint"] = _outcome(lambda: M.ac_settings(cfg))
    param = torch.nn.Parameter(torch.zeros(2).to("tpu"))
    opt = build_optimizer([param], cfg)
    group = opt.param_groups[0]
    out["optimizer"] = (type(opt).__name__, float(group["lr"]), group["betas"], group["eps"], group["weight_decay"])
    sched = build_schedule(opt, cfg)
    out["schedule"] = [round(sched.lr_lambdas[0](k), 9) for k in [*range(0, 60, 3), 150, 500, 2000, 5000, 8000, 9990]]
    tok = build_tokenizer(None)
    if isinstance(dims, P.ParallelDims):
        out["train_data"] = _outcome(
            lambda: (
                _summary(T.build_train_dataloader(cfg, tok, dims), ["local_batch_size", "seq_len"])
                | {"source": T.build_train_dataloader(cfg, tok, dims).source.name}
            )
        )

        def validator():
            v = build_validator(cfg, None, tok, dims, None, None)
            return (
                None
                if v is None
                else (
                    _summary(v, ["num_batches", "host_batch", "tokens_per_batch"])
                    | {"due": [s for s in range(1, 40) if v.should_validate(s)], "source": v._loader().source.name}
                )
            )

        out["validation"] = _outcome(validator)
    ck = T.build_checkpointer(cfg)
    out["checkpointer"] = ck and _summary(ck, ["folder", "interval", "keep_latest_k", "async_mode"])
    out["saves"] = [(s, T.save_due(cfg, ck, s)) for s in range(1, 13)]
    out["gc"] = [s for s in range(1, 60) if T.gc_due(cfg, s)]
    prof = Profiler(cfg)
    out["profiler"] = _summary(prof, ["enabled", "freq", "active", "folder", "memory", "memory_folder"])
    out["seed"] = T.resolve_seed(cfg)
    out["env"] = xla_env_updates(cfg, environ={})
    out["step"] = _step_probe(cfg)
    out["saved_config"] = C.save_resolved_config(cfg)
    logger = build_metrics_logger(cfg, 0, 10, stdout_is_terminal=True)
    try:
        out["metrics"] = _summary(logger, ["jsonl_path", "tb_dir", "log_freq", "color", "run_name", "wandb_mode"]) | {
            "tensorboard": logger._tb is not None
        }
    finally:
        logger.close()
    return out


def cli(argv, capsys):
    """torchtpu-train's in-process result for argv: (exit status, stdout, stderr)."""
    from torchtpu.cli import train_main

    status = train_main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


# A configuration the command line refuses before training (8 devices cannot take tensor parallel degree 3).
CLI_BASE = ["--parallelism.tensor_parallel_degree", "3"]
CLI_PROBED = {"job.print_config", "debug.verbose"}


@pytest.mark.parametrize("key", sorted(PROBED))
def test_changing_the_key_changes_what_the_trainer_does(key, tmp_path, monkeypatch, capsys):
    from torchtpu.distributed import mesh

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.chdir(tmp_path)
    before = mesh.current_mesh()
    (tmp_path / "docs.txt").write_text("\n\n".join(f"document {i} " + "word " * 40 for i in range(40)))
    config_file = tmp_path / "job.toml"
    config_file.write_text("[training]\nseq_len = 96\n[optimizer]\nlr = 0.003\n")
    value, extra = PROBED[key]
    value = value.replace("DUMP", str(tmp_path)).replace("CONFIG_FILE", str(config_file))
    base = [
        "--job.dump_folder",
        str(tmp_path / "out"),
        "--training.dataset",
        "bundled",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "1",
        *extra,
    ]
    if key == "training.dataset":
        base = [a for a in base if a != "bundled"]
        base.remove("--training.dataset")
    changed = base + ["--" + key, value]
    try:
        if key in CLI_PROBED:
            a, b = cli(base + CLI_BASE, capsys), cli(changed + CLI_BASE, capsys)
        else:
            a, b = plan(C.load_config(base)), plan(C.load_config(changed))
    finally:
        mesh.set_mesh(before)
        torch.use_deterministic_algorithms(False)
    assert a != b, f"--{key} {value} changed nothing the trainer uses"


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_unsupported_values_are_refused(key):
    value = REFUSED[key]
    section, name = key.rsplit(".", 1)
    with pytest.raises(S.ConfigError) as info:
        C.load_config(["--" + key, value])
    msg = str(info.value)
    assert f"[{section}] {name} = " in msg and value in msg and "\n" not in msg, msg
    assert "not supported" in msg or "allowed:" in msg, msg
    # and the default is accepted
    C.load_config(["--" + key, schema.fmt(SPECS[key].default).strip('"')] if SPECS[key].default is not None else [])


@pytest.mark.parametrize("key", sorted(COVERED_BY))
def test_covering_runs_exist_and_set_the_key(key):
    path, name = COVERED_BY[key].split("::")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    test = getattr(module, name, None)
    assert callable(test), COVERED_BY[key]
    source = inspect.getsource(module)  # the key may be set by a fixture or helper the test uses
    assert key.rsplit(".", 1)[1] in inspect.getsource(test) or f"--{key}" in source, (key, COVERED_BY[key])


def test_keys_without_effect_say_so_in_help():
    help_text = C.help_text()
    for key in NO_EFFECT_BY_DESIGN:
        assert "changes nothing" in SPECS[key].help, key
        assert SPECS[key].help.split(";")[0] in " ".join(help_text.split()), key
    assert "always compiles the whole training step" in " ".join(help_text.split())
