"""The trainer's configuration schema: one typed dataclass per TOML section, each key with its default,
its help text and what values it allows.

Section and key names, types and defaults follow torchtitan 0.2.2's JobConfig wherever a key means
the same thing on TPU, so a torchtitan TOML file mostly reads as is. Keys that only make sense on
CUDA are left out (naming one gives an error that says so); TPU-specific keys live in
[parallelism] (`num_slices`, `dcn_axis`), [model] (`attn_type`, `n_layers`, `flavor_overrides`),
[debug] (`verbose`, `inject_stall`) and in a [tpu] section.

Reading a configuration (defaults < TOML file < command line), --help and the checks that involve
several keys are in config_manager.py; resolving the parallel degrees for a device count is
parallel_dims.resolve_dims. This module only imports the standard library, so `--help` and config
errors are fast.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .schema import emit_toml, fmt

__all__ = ["ConfigError", "JobConfig", "MODEL_FLAVORS", "topology_num_devices"]


# Models torchtpu trains, by torchtitan model name, with the flavors it supports: the families of
# torchtpu.models.registry, written out because this module imports only the standard library
# (tests/train/test_families.py keeps the two equal).
MODEL_FLAVORS: dict[str, tuple[str, ...]] = {
    "llama3": ("debugmodel", "8B", "70B", "405B"),
    "qwen3": ("debugmodel", "0.6B", "1.7B", "4B", "8B", "14B", "32B", "debugmodel_moe", "30B-A3B", "235B-A22B"),
    "deepseek_v3": ("debugmodel", "debugmodel_flex_attn", "16B", "236B", "671B"),
    "llama4": ("debugmodel", "17bx16e", "17bx128e", "debugmodel_irope", "17bx16e_irope", "17bx128e_irope"),
}


class ConfigError(Exception):
    """A configuration problem. str(error) is a single line naming where the bad value came from."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


# ----------------------------------------------------------------------------------------------
# Field declarations
# ----------------------------------------------------------------------------------------------

Check = Callable[[Any], "str | None"]  # returns None if fine, else what is allowed


def _opt(default: Any, help: str, *, choices: tuple | None = None, check: Check | None = None):
    meta = {"help": help, "choices": choices, "check": check}
    if isinstance(default, list):
        return field(default_factory=lambda d=tuple(default): list(d), metadata=meta)
    return field(default=default, metadata=meta)


def _section(cls, help: str):
    return field(default_factory=cls, metadata={"help": help, "section": True})


def _positive(v):
    return None if v > 0 else "must be > 0"


def _non_negative(v):
    return None if v >= 0 else "must be >= 0"


def _minus_one_or_positive(v):
    return None if v == -1 or v > 0 else "must be -1 or > 0"


def _minus_one_or_non_negative(v):
    return None if v >= -1 else "must be -1 or >= 0"


def _fraction(v):
    return None if 0.0 <= v <= 1.0 else "must be between 0 and 1"


def _beta(v):
    return None if 0.0 <= v < 1.0 else "must be in [0, 1)"


def _only_one(what: str) -> Check:
    def check(v):
        return None if v == 1 else f"allowed: 1 (torchtpu does not support {what} yet)"

    return check


def _not_supported(default: Any, why: str) -> Check:
    """Only the default value is allowed: the key exists for torchtitan configs, the feature does not yet."""

    def check(v):
        return None if v == default else f"not supported by torchtpu yet ({why}); leave it at {fmt(default)}"

    return check


def _state_parts(v):
    bad = [c for c in v if c not in ("optimizer", "lr_scheduler", "dataloader")]
    return (
        None
        if not bad
        else (
            f"cannot exclude {bad[0]!r}; allowed: optimizer, lr_scheduler, dataloader (the "
            "model weights and the step are always restored)"
        )
    )


def _selective_ac_option(v):
    if v == "op" or (v.isdigit() and int(v) > 0):
        return None
    return 'allowed: a positive integer as a string (checkpoint every n-th block, e.g. "2") or "op"'


_TOPOLOGY_RE = re.compile(r"^(v\d+[a-z]*):(\d+)x(\d+)(?:x(\d+))?$")


def _topology(v):
    if v == "" or _TOPOLOGY_RE.match(v):
        if v and topology_num_devices(v) < 1:
            return "has no chips"
        return None
    return 'allowed: "" (the attached devices) or GENERATION:AxB[xC], e.g. "v5p:4x4x4", "v5e:2x4", "v6e:16x16"'


def _json_object(v):
    if v == "":
        return None
    try:
        value = json.loads(v)
    except ValueError as e:
        return f"not valid JSON ({e}); allowed: a JSON object of fields, e.g. '{{\"dim\": 64}}'"
    return None if isinstance(value, dict) else "allowed: a JSON object of fields, e.g. '{\"dim\": 64}'"


_STALL_RE = re.compile(r"^(\d+):(\d+):(\d+(?:\.\d*)?)$")


def _stall(v):
    return None if v == "" or _STALL_RE.match(v) else 'allowed: "" (none) or "HOST:STEP:SECONDS", e.g. "1:4:600"'


def _components(v):
    bad = [c for c in v if c not in ("model", "loss")]
    return None if not bad else f"unknown component {bad[0]!r}; allowed: model, loss"


def topology_num_devices(topology: str) -> int:
    """Chips in a TPU topology name such as "v5p:4x4x4" (64) or "v5e:2x4" (8)."""
    m = _TOPOLOGY_RE.match(topology)
    if not m:
        raise ConfigError(f"[tpu] topology = {json.dumps(topology)}: {_topology(topology)}")
    return math.prod(int(d) for d in m.groups()[1:] if d is not None)


# ----------------------------------------------------------------------------------------------
# The schema
# ----------------------------------------------------------------------------------------------


@dataclass
class Job:
    config_file: str | None = _opt(None, "The TOML file the values were read from; give it with --config.")
    dump_folder: str = _opt(
        "./outputs",
        "Folder that receives everything the run writes: checkpoints, "
        "TensorBoard events, profiler traces, saved configs.",
    )
    description: str = _opt("default job", "Free-form description of the run, shown in the logs.")
    print_config: bool = _opt(False, "Print the fully resolved configuration as TOML and exit without training.")
    save_config_file: str | None = _opt(
        None, "If set, the trainer writes the resolved configuration to this file name inside dump_folder."
    )


@dataclass
class Profiling:
    enable_profiling: bool = _opt(False, "Record XLA profiler traces (open them in TensorBoard or Perfetto).")
    save_traces_folder: str = _opt("profile_traces", "Sub-folder of dump_folder for profiler traces.")
    profile_freq: int = _opt(10, "Record one trace window every this many steps.", check=_positive)
    profiler_active: int = _opt(1, "Number of steps recorded in each trace window.", check=_positive)
    profiler_warmup: int = _opt(
        3,
        "Steps traced and discarded just before each recorded window (torchtitan's "
        "torch.profiler schedule). Only the default is accepted: jax.profiler cannot "
        "discard part of a trace, so a recorded window always starts cold.",
        check=_not_supported(3, "jax.profiler cannot trace steps and discard them"),
    )
    enable_memory_snapshot: bool = _opt(
        False,
        "Save a device-memory profile (which buffers hold device memory, "
        "pprof format) every profile_freq steps, as "
        "<save_memory_snapshot_folder>/iteration_<step>/memory.prof.",
    )
    save_memory_snapshot_folder: str = _opt("memory_snapshot", "Sub-folder of dump_folder for memory profiles.")


@dataclass
class Metrics:
    log_freq: int = _opt(10, "Report loss, tokens/s and MFU every this many steps.", check=_positive)
    enable_tensorboard: bool = _opt(False, "Also write the metrics as TensorBoard events.")
    disable_color_printing: bool = _opt(
        False, "Log to the terminal without ANSI colours (colours are only ever used when stdout is a terminal)."
    )
    save_tb_folder: str = _opt("tb", "Sub-folder of dump_folder for TensorBoard events.")
    save_for_all_ranks: bool = _opt(
        False,
        "Write metrics from every host (process) instead of only the first: "
        "host r>0 writes metrics_rank_<r>.jsonl and TensorBoard events under "
        "<save_tb_folder>/rank_<r>; the console shows only the first host's.",
    )
    enable_wandb: bool = _opt(False, "Also send the metrics to Weights & Biases.")


@dataclass
class Model:
    name: str = _opt("llama3", "Model family, by its torchtitan name.", choices=tuple(MODEL_FLAVORS))
    flavor: str = _opt(
        "debugmodel",
        "Size of the model within the family: "
        + "; ".join(f"{name}: {', '.join(flavors)}" for name, flavors in MODEL_FLAVORS.items())
        + ".",
    )
    hf_assets_path: str = _opt(
        "",
        "Folder with the model's Hugging Face files (tokenizer.json or "
        "tokenizer.model, config.json, optionally *.safetensors). Empty: the small "
        "tokenizer bundled with torchtpu, meant for the debug model.",
    )
    attn_type: str = _opt(
        "",
        'Attention of the model: "" = the flavor\'s; "sdpa" = causal attention over each whole sequence, '
        "for the flavors whose torchtitan attention is flex_attention with block-causal document masks "
        "(deepseek_v3 debugmodel_flex_attn, 16B, 236B, 671B), which torchtpu does not run: documents "
        "packed into one sequence then attend to the ones before them. Same weights.",
        choices=("", "sdpa"),
    )
    n_layers: int | None = _opt(
        None,
        "Transformer blocks of the model; unset: the flavor's. The flavor with fewer blocks (same width) tries a "
        "configuration quickly; its checkpoints fit only a model of the same depth.",
        check=_positive,
    )
    flavor_overrides: str = _opt(
        "",
        "Other fields of the flavor's torchtitan model arguments to replace, as a JSON object, e.g. "
        '\'{"dim": 64, "n_heads": 4, "moe_args": {"num_experts": 8}}\' (an object for a nested argument '
        "replaces some of its fields); a field the flavor's arguments lack is an error. Empty: the flavor as it is.",
        check=_json_object,
    )


@dataclass
class Optimizer:
    name: str = _opt("AdamW", "Optimizer.", choices=("AdamW", "Adam"))
    lr: float = _opt(8e-4, "Peak learning rate (reached at the end of warm-up).", check=_non_negative)
    beta1: float = _opt(0.9, "Decay rate of the first-moment (mean) estimate.", check=_beta)
    beta2: float = _opt(0.95, "Decay rate of the second-moment (variance) estimate.", check=_beta)
    eps: float = _opt(1e-8, "Term added to the denominator for numerical stability.", check=_non_negative)
    weight_decay: float = _opt(0.1, "Decoupled weight decay (AdamW) or L2 penalty (Adam).", check=_non_negative)


@dataclass
class LRScheduler:
    warmup_steps: int = _opt(200, "Steps of linear warm-up from near zero to optimizer.lr.", check=_non_negative)
    total_steps: int | None = _opt(
        None,
        "Length of the schedule in steps; unset means training.steps. Lets a short run follow a long run's curve.",
        check=_positive,
    )
    decay_ratio: float | None = _opt(
        None,
        "Fraction of the schedule spent decaying. Unset: decay starts "
        "right after warm-up; otherwise the rate stays flat until the last "
        "decay_ratio of the steps (warmup-stable-decay).",
        check=_fraction,
    )
    decay_type: str = _opt("linear", "Shape of the decay.", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = _opt(0.0, "The rate decays to optimizer.lr times this factor, not below.", check=_fraction)


@dataclass
class DataLoader:
    num_workers: int = _opt(
        0,
        "Background worker processes that prepare batches. Only 0 (batches are read "
        "and tokenized in the training process, while the devices run the previous "
        "step) is supported yet.",
        check=_not_supported(0, "batches are prepared in the training process"),
    )
    persistent_workers: bool = _opt(
        False,
        "Keep the workers alive between passes over the data (needs num_workers > 0, so not supported yet).",
        check=_not_supported(False, "there are no data-loading workers"),
    )
    prefetch_factor: int | None = _opt(
        None,
        "Batches each worker prepares ahead (needs num_workers > 0, so not supported yet).",
        check=_not_supported(None, "there are no data-loading workers"),
    )


@dataclass
class Training:
    dataset: str = _opt(
        "c4_test",
        'Dataset name: "bundled" (the small corpus shipped with torchtpu), '
        '"c4", "c4_test", ... (see the data loader for the full list).',
    )
    dataset_path: str | None = _opt(None, "Local folder or file to read the dataset from instead of downloading it.")
    local_batch_size: int = _opt(8, "Sequences per data-parallel rank in each micro-batch.", check=_positive)
    global_batch_size: int = _opt(
        -1,
        "Sequences per optimizer step over all ranks; -1 means local_batch_size "
        "x data-parallel degree. A multiple of that product accumulates gradients "
        "over global / (local x dp) micro-batches.",
        check=_minus_one_or_positive,
    )
    seq_len: int = _opt(2048, "Tokens per sequence.", check=_positive)
    max_norm: float = _opt(1.0, "Clip the global gradient norm to this value.", check=_positive)
    steps: int = _opt(10000, "Optimizer steps to train for.", check=_positive)
    dtype: str = _opt(
        "float32",
        "Storage dtype of parameters, gradients and optimizer state. bfloat16 trains "
        "fully in bf16 with no fp32 master copy.",
        choices=("bfloat16", "float32"),
    )
    mixed_precision_param: str = _opt(
        "bfloat16",
        "Dtype parameters are cast to for the forward and backward computation (mixed precision).",
        choices=("bfloat16", "float32"),
    )
    mixed_precision_reduce: str = _opt(
        "float32", "Dtype of gradient reductions across data-parallel ranks.", choices=("float32",)
    )
    gc_freq: int = _opt(50, "Run Python's garbage collector every this many steps.", check=_positive)
    max_bad_records: int = _opt(
        0,
        "Malformed data records (a JSON line that does not parse or has no text field) to skip and count "
        "(metric bad_records) before failing; 0 fails on the first, naming its file:line.",
        check=_non_negative,
    )
    dataloader: DataLoader = _section(DataLoader, "Data loading for training.")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = _opt(
        1,
        "Ranks holding full replicas of the parameters (DDP; HSDP when combined with sharding). 1 disables it.",
        check=_positive,
    )
    data_parallel_shard_degree: int = _opt(
        -1,
        "Ranks the parameters, gradients and optimizer state are "
        "sharded over (FSDP). -1 takes all devices left over by the other "
        "degrees; 1 disables it.",
        check=_minus_one_or_positive,
    )
    tensor_parallel_degree: int = _opt(
        1,
        "Ranks each layer's weights are split over (tensor parallelism with sequence parallelism). 1 disables it.",
        check=_positive,
    )
    pipeline_parallel_degree: int = _opt(
        1, "Pipeline stages. Must be 1 in torchtpu.", check=_only_one("pipeline parallelism")
    )
    context_parallel_degree: int = _opt(
        1,
        "Ranks a sequence is split over (context parallelism). Must be 1 in torchtpu.",
        check=_only_one("context parallelism"),
    )
    expert_parallel_degree: int = _opt(
        1,
        "Ranks the routed experts of a Mixture-of-Experts model are split over (expert parallelism), "
        "borrowed as in torchtitan with expert_tensor_parallel_degree = 1: every tensor-parallel rank and "
        "part of the FSDP shards, so it is tensor_parallel_degree times a divisor of "
        "data_parallel_shard_degree, and each expert is sharded over the remaining "
        "data_parallel_shard_degree x tensor_parallel_degree / expert_parallel_degree ranks. 1 disables it.",
        check=_positive,
    )
    expert_tensor_parallel_degree: int = _opt(
        1,
        "Ranks each routed expert is split over (tensor parallelism inside expert parallelism). Must be 1 in "
        "torchtpu: with tensor parallelism, expert parallelism takes the tensor-parallel ranks (torchtitan's etp = 1).",
        check=_only_one("expert tensor parallelism"),
    )
    num_slices: int = _opt(
        1,
        "TPU slices the job spans (Multislice, connected over the data-center network, "
        "DCN). The mesh axis named by dcn_axis is split across slices.",
        check=_positive,
    )
    dcn_axis: str = _opt(
        "dp_replicate",
        "Mesh axis that crosses slice boundaries when num_slices > 1; its degree must be a multiple of num_slices.",
        choices=("dp_replicate", "dp_shard"),
    )


@dataclass
class Checkpoint:
    enable: bool = _opt(False, "Save checkpoints, and resume from the newest one in the checkpoint folder.")
    folder: str = _opt("checkpoint", "Sub-folder of dump_folder holding the checkpoints (step-N folders).")
    interval: int = _opt(500, "Save every this many steps.", check=_positive)
    initial_load_path: str | None = _opt(
        None,
        "Checkpoint to start from when the checkpoint folder is still "
        "empty (e.g. pre-trained weights); ignored once the run has "
        "checkpoints of its own.",
    )
    initial_load_model_only: bool = _opt(
        True, "Load only the model weights from initial_load_path; false also restores optimizer, scheduler and step."
    )
    initial_load_in_hf: bool = _opt(
        False,
        "initial_load_path is a Hugging Face model folder (config.json + "
        "safetensors) rather than a torchtpu checkpoint (needs "
        "initial_load_model_only).",
    )
    last_save_model_only: bool = _opt(
        True, "At the end of training save only the model weights; false saves the full resumable state."
    )
    last_save_in_hf: bool = _opt(
        False,
        "Also write the final weights as a Hugging Face folder, "
        "<folder>/hf_step_N (config.json + safetensors in export_dtype, the "
        "tokenizer's files and generation_config.json: transformers and vLLM load "
        "it as it is; needs last_save_model_only).",
    )
    export_dtype: str = _opt(
        "float32", "Dtype of the weights in the final model-only save.", choices=("float16", "bfloat16", "float32")
    )
    async_mode: str = _opt(
        "disabled",
        "disabled: training waits for each save; async: saves are written in "
        "the background; async_with_pinned_mem: the same, staging through host memory.",
        choices=("disabled", "async", "async_with_pinned_mem"),
    )
    keep_latest_k: int = _opt(10, "Keep only the newest k checkpoints; 0 keeps them all.", check=_non_negative)
    load_step: int = _opt(
        -1,
        "Resume from this step's checkpoint (an error listing the steps there are if it "
        "does not exist); -1: the newest readable one (a save that never finished is ignored, a "
        "damaged checkpoint is renamed step_N.unreadable and the one before it is used).",
        check=_minus_one_or_non_negative,
    )
    exclude_from_loading: list[str] = _opt(
        [],
        "Parts of the state not to restore when resuming (they are not read "
        "and start fresh): optimizer, lr_scheduler, dataloader.",
        check=_state_parts,
    )
    enable_first_step_checkpoint: bool = _opt(False, "Also save right after step 1, to prove saving works early.")
    load_only: bool = _opt(False, "Load checkpoints but never save any.")


@dataclass
class ActivationCheckpoint:
    mode: str = _opt(
        "selective",
        "Recompute activations in the backward pass instead of storing them: none, "
        "full (every transformer block) or selective.",
        choices=("selective", "full", "none"),
    )
    selective_ac_option: str = _opt(
        "2",
        'For mode = "selective": "N" recomputes every N-th block; "op" recomputes every '
        "block but keeps the outputs of torchtitan's per-op policy (every other matmul, "
        "attention, reduce-scatters, max; a MoE router's gate always recomputed, torchtitan's "
        "default) instead of recomputing those ops, with the layer scan and without it.",
        check=_selective_ac_option,
    )


@dataclass
class Compile:
    enable: bool = _opt(
        False,
        "Accepted for torchtitan configs; changes nothing. torchtpu-train always compiles "
        "the whole training step (model, loss, backward, clipping, optimizer) into one XLA "
        "program, and the validation forward into another, whether this is true or false.",
    )
    components: list[str] = _opt(
        ["model", "loss"],
        "Accepted for torchtitan configs; changes nothing: the model "
        "and the loss are always compiled, as parts of the one program per step. "
        "Allowed: model, loss.",
        check=_components,
    )
    backend: str = _opt(
        "tpu",
        'The compiler: XLA, through torchtpu (torch.compile\'s "tpu" backend). Other '
        'backends (torchtitan\'s "inductor") do not target TPUs.',
        choices=("tpu",),
    )


@dataclass
class Comm:
    init_timeout_seconds: int = _opt(
        300,
        "Time allowed for start-up and the first step: the hosts joining the job "
        "(jax.distributed's initialization timeout), building the model and compiling "
        "the step. Past it the step watchdog dumps every stack and exits 42.",
        check=_positive,
    )
    train_timeout_seconds: int = _opt(
        100,
        "Step watchdog after the first step: when no step finishes in this time "
        "(a host is stuck or gone), every Python stack is written to the log and the "
        "process exits with 42 (retriable).",
        check=_positive,
    )


@dataclass
class Validation:
    enable: bool = _opt(
        False,
        "Evaluate the loss and perplexity on held-out data at step 1 and every freq steps, "
        "as a compiled forward-only program sharded like training; logged with the training "
        "metrics (console, metrics.jsonl, TensorBoard, W&B) as validation/loss and "
        "validation/perplexity.",
    )
    dataset: str = _opt(
        "c4_validation",
        'Validation dataset name: "bundled_validation" (the held-out documents '
        'of the bundled corpus, which dataset = "bundled" never trains on), "c4_validation", a '
        'Hugging Face "org/name", or any name with dataset_path.',
    )
    dataset_path: str | None = _opt(None, "Local folder or file to read the validation dataset from.")
    local_batch_size: int = _opt(8, "Validation sequences per data-parallel rank in each batch.", check=_positive)
    seq_len: int = _opt(2048, "Tokens per validation sequence.", check=_positive)
    freq: int = _opt(10, "Validate at step 1 and every this many training steps.", check=_positive)
    steps: int = _opt(
        -1,
        "Validation batches per evaluation: -1 reads the whole validation set (with several "
        "hosts, as many batches as the host with the fewest has); N reads its first N batches, "
        "wrapping around a smaller set. Every evaluation reads the same batches.",
        check=_minus_one_or_positive,
    )
    dataloader: DataLoader = _section(DataLoader, "Data loading for validation.")


@dataclass
class Debug:
    seed: int | None = _opt(None, "Base random seed; unset picks a fresh one each run.", check=_non_negative)
    deterministic: bool = _opt(
        False,
        "Make runs repeatable: seed 0 when seed is unset (instead of a fresh random "
        "seed each run), and PyTorch's deterministic algorithms "
        "(torch.use_deterministic_algorithms) for the ops that run on the host.",
    )
    verbose: bool = _opt(False, "Show full tracebacks on errors and debug-level logs (same as --debug).")
    inject_stall: str = _opt(
        "",
        'Fault injection, "HOST:STEP:SECONDS": process HOST sleeps SECONDS inside step STEP, as a stuck host '
        "does, to try the step watchdog ([comm] train_timeout_seconds) and a launcher's restarts. Empty: none.",
        check=_stall,
    )


@dataclass
class Tpu:
    topology: str = _opt(
        "",
        'Target TPU slice, e.g. "v5p:4x4x4" (64 chips). Set: the configuration is checked '
        "against that many chips and --dry-run compiles for it ahead of time. Empty: the "
        "devices attached to this host(s).",
        check=_topology,
    )
    dry_run: bool = _opt(
        False,
        "Build and compile the train step, report memory and FLOPs, and exit without training (same as --dry-run).",
    )
    xla_flags: str = _opt(
        "",
        "Extra XLA flags (appended to $XLA_FLAGS; flags already in the environment win), "
        'e.g. "--xla_force_host_platform_device_count=8" for 8 CPU devices.',
    )
    libtpu_init_args: str = _opt(
        "", "Extra libtpu flags (appended to $LIBTPU_INIT_ARGS; flags already in the environment win)."
    )
    scan_layers: bool = _opt(
        True,
        "Compile the model's identical transformer blocks once and run them under "
        "jax.lax.scan (compile time independent of depth). Applies with [activation_checkpoint] "
        'mode = "full" and with mode = "selective", selective_ac_option = "op" (the scan '
        'recomputes each block in backward, keeping the per-op policy\'s outputs with "op"); '
        "false: blocks unrolled.",
    )
    loss_chunk_size: int = _opt(
        2048,
        "Sequence positions per chunk of the loss: the output projection and "
        "cross entropy run one chunk at a time, each chunk's gradients computed right away "
        "(nothing recomputed in backward), so the float32 logits of the whole sequence are "
        "never held. 0 computes the loss on the whole "
        "logits. With tensor parallelism each chunk's logits stay split over the vocabulary "
        "(loss_parallel), as the whole logits do.",
        check=_non_negative,
    )


@dataclass
class JobConfig:
    """The whole configuration. Sections are attributes: cfg.training.seq_len, cfg.parallelism.num_slices."""

    job: Job = _section(Job, "The run itself")
    profiling: Profiling = _section(Profiling, "Profiler traces")
    metrics: Metrics = _section(Metrics, "Logging of training metrics")
    model: Model = _section(Model, "Which model to train")
    optimizer: Optimizer = _section(Optimizer, "Optimizer")
    lr_scheduler: LRScheduler = _section(LRScheduler, "Learning-rate schedule (warm-up, then decay)")
    training: Training = _section(Training, "Data, batch and step settings")
    parallelism: Parallelism = _section(Parallelism, "How the model and batch are split over devices")
    checkpoint: Checkpoint = _section(Checkpoint, "Saving and resuming")
    activation_checkpoint: ActivationCheckpoint = _section(ActivationCheckpoint, "Activation recomputation")
    compile: Compile = _section(Compile, "torch.compile")
    comm: Comm = _section(Comm, "Collective communication")
    validation: Validation = _section(Validation, "Held-out evaluation")
    debug: Debug = _section(Debug, "Reproducibility and debugging")
    tpu: Tpu = _section(Tpu, "TPU slice, XLA and libtpu settings")

    def __post_init__(self):
        # Where each value came from: (section, ..., key) -> file path or config_manager.COMMAND_LINE.
        # Absent: default.
        self._origins: dict[tuple[str, ...], str] = {}

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (section -> key -> value); unset optional keys are None."""
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The configuration as TOML that load_config reads back to an equal configuration."""
        lines = ["# torchtpu-train configuration, fully resolved"]
        if self.job.config_file:
            lines.append(f"# read from {self.job.config_file}")
        emit_toml(self, (), lines)
        return "\n".join(lines) + "\n"

    def origin(self, *path: str) -> str | None:
        """Where the value at path (e.g. "training", "seq_len") was set: a file, "command line", or None (default)."""
        return self._origins.get(tuple(path))
