"""The trainer's configuration: one typed schema, read from defaults, a TOML file and the command line.

Section and key names, types and defaults follow torchtitan 0.2.2's JobConfig wherever a key means
the same thing on TPU, so a torchtitan TOML file mostly reads as is. Keys that only make sense on
CUDA are left out (naming one gives an error that says so); TPU-specific keys live in
[parallelism] (`num_slices`, `dcn_axis`) and in a [tpu] section.

Precedence: command line > TOML file > defaults.

    cfg = load_config(["--config", "train_configs/debug_model.toml", "--training.steps", "20"])
    dims = validate(cfg, num_devices=8)      # resolved degrees and gradient-accumulation steps
    print(cfg.to_toml())

Every problem raises ConfigError with a one-line message naming the file (or "command line"),
the section, the key and the value, and saying what is allowed.

This module only imports the standard library, so `--help` and config errors are fast.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = [
    "ConfigError",
    "HelpRequested",
    "JobConfig",
    "ParallelDims",
    "load_config",
    "validate",
    "config_from_dict",
    "help_text",
    "topology_num_devices",
    "xla_env_updates",
    "MODEL_FLAVORS",
]

COMMAND_LINE = "command line"

# Models torchtpu trains, by torchtitan model name, with the flavors it supports.
MODEL_FLAVORS: dict[str, tuple[str, ...]] = {"llama3": ("debugmodel", "8B", "70B", "405B")}


class ConfigError(Exception):
    """A configuration problem. str(error) is a single line naming where the bad value came from."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class HelpRequested(Exception):
    """Raised by load_config for -h/--help; .text is the help to print."""

    def __init__(self, text: str):
        super().__init__("help requested")
        self.text = text


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
        return None if v == default else f"not supported by torchtpu yet ({why}); leave it at {_fmt(default)}"

    return check


def _state_parts(v):
    bad = [c for c in v if c not in ("optimizer", "lr_scheduler", "dataloader")]
    return None if not bad else (f"cannot exclude {bad[0]!r}; allowed: optimizer, lr_scheduler, dataloader (the "
                                 "model weights and the step are always restored)")


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
    dump_folder: str = _opt("./outputs", "Folder that receives everything the run writes: checkpoints, "
                            "TensorBoard events, profiler traces, saved configs.")
    description: str = _opt("default job", "Free-form description of the run, shown in the logs.")
    print_config: bool = _opt(False, "Print the fully resolved configuration as TOML and exit without training.")
    save_config_file: str | None = _opt(None, "If set, the trainer writes the resolved configuration to this "
                                        "file name inside dump_folder.")


@dataclass
class Profiling:
    enable_profiling: bool = _opt(False, "Record XLA profiler traces (open them in TensorBoard or Perfetto).")
    save_traces_folder: str = _opt("profile_traces", "Sub-folder of dump_folder for profiler traces.")
    profile_freq: int = _opt(10, "Record one trace window every this many steps.", check=_positive)
    profiler_active: int = _opt(1, "Number of steps recorded in each trace window.", check=_positive)
    profiler_warmup: int = _opt(3, "Steps traced and discarded just before each recorded window (torchtitan's "
                                "torch.profiler schedule). Only the default is accepted: jax.profiler cannot "
                                "discard part of a trace, so a recorded window always starts cold.",
                                check=_not_supported(3, "jax.profiler cannot trace steps and discard them"))
    enable_memory_snapshot: bool = _opt(False, "Save a device-memory profile (which buffers hold device memory, "
                                        "pprof format) every profile_freq steps, as "
                                        "<save_memory_snapshot_folder>/iteration_<step>/memory.prof.")
    save_memory_snapshot_folder: str = _opt("memory_snapshot", "Sub-folder of dump_folder for memory profiles.")


@dataclass
class Metrics:
    log_freq: int = _opt(10, "Report loss, tokens/s and MFU every this many steps.", check=_positive)
    enable_tensorboard: bool = _opt(False, "Also write the metrics as TensorBoard events.")
    disable_color_printing: bool = _opt(False, "Log to the terminal without ANSI colours (colours are only "
                                        "ever used when stdout is a terminal).")
    save_tb_folder: str = _opt("tb", "Sub-folder of dump_folder for TensorBoard events.")
    save_for_all_ranks: bool = _opt(False, "Write metrics from every host (process) instead of only the first: "
                                    "host r>0 writes metrics_rank_<r>.jsonl and TensorBoard events under "
                                    "<save_tb_folder>/rank_<r>; the console shows only the first host's.")
    enable_wandb: bool = _opt(False, "Also send the metrics to Weights & Biases.")


@dataclass
class Model:
    name: str = _opt("llama3", "Model family, by its torchtitan name.", choices=tuple(MODEL_FLAVORS))
    flavor: str = _opt("debugmodel", "Size of the model within the family (llama3: debugmodel, 8B, 70B, 405B).")
    hf_assets_path: str = _opt("", "Folder with the model's Hugging Face files (tokenizer.json or "
                               "tokenizer.model, config.json, optionally *.safetensors). Empty: the small "
                               "tokenizer bundled with torchtpu, meant for the debug model.")


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
    total_steps: int | None = _opt(None, "Length of the schedule in steps; unset means training.steps. "
                                   "Lets a short run follow a long run's curve.", check=_positive)
    decay_ratio: float | None = _opt(None, "Fraction of the schedule spent decaying. Unset: decay starts "
                                     "right after warm-up; otherwise the rate stays flat until the last "
                                     "decay_ratio of the steps (warmup-stable-decay).", check=_fraction)
    decay_type: str = _opt("linear", "Shape of the decay.", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = _opt(0.0, "The rate decays to optimizer.lr times this factor, not below.",
                                check=_fraction)


@dataclass
class DataLoader:
    num_workers: int = _opt(0, "Background worker processes that prepare batches. Only 0 (batches are read "
                            "and tokenized in the training process, while the devices run the previous "
                            "step) is supported yet.",
                            check=_not_supported(0, "batches are prepared in the training process"))
    persistent_workers: bool = _opt(False, "Keep the workers alive between passes over the data (needs "
                                    "num_workers > 0, so not supported yet).",
                                    check=_not_supported(False, "there are no data-loading workers"))
    prefetch_factor: int | None = _opt(None, "Batches each worker prepares ahead (needs num_workers > 0, so not "
                                       "supported yet).",
                                       check=_not_supported(None, "there are no data-loading workers"))


@dataclass
class Training:
    dataset: str = _opt("c4_test", 'Dataset name: "bundled" (the small corpus shipped with torchtpu), '
                        '"c4", "c4_test", ... (see the data loader for the full list).')
    dataset_path: str | None = _opt(None, "Local folder or file to read the dataset from instead of "
                                    "downloading it.")
    local_batch_size: int = _opt(8, "Sequences per data-parallel rank in each micro-batch.", check=_positive)
    global_batch_size: int = _opt(-1, "Sequences per optimizer step over all ranks; -1 means local_batch_size "
                                  "x data-parallel degree. A multiple of that product accumulates gradients "
                                  "over global / (local x dp) micro-batches.", check=_minus_one_or_positive)
    seq_len: int = _opt(2048, "Tokens per sequence.", check=_positive)
    max_norm: float = _opt(1.0, "Clip the global gradient norm to this value.", check=_positive)
    steps: int = _opt(10000, "Optimizer steps to train for.", check=_positive)
    dtype: str = _opt("float32", "Storage dtype of parameters, gradients and optimizer state. bfloat16 trains "
                      "fully in bf16 with no fp32 master copy.", choices=("bfloat16", "float32"))
    mixed_precision_param: str = _opt("bfloat16", "Dtype parameters are cast to for the forward and backward "
                                      "computation (mixed precision).", choices=("bfloat16", "float32"))
    mixed_precision_reduce: str = _opt("float32", "Dtype of gradient reductions across data-parallel ranks.",
                                       choices=("float32",))
    loss_chunk_size: int = _opt(2048, "Sequence positions per chunk of the loss: the output projection and "
                                "cross entropy run one chunk at a time, recomputed in backward, so the float32 "
                                "logits of the whole sequence are never held. 0 computes the loss on the whole "
                                "logits. With tensor parallelism the loss is always computed whole (its logits are already split "
                                "over the tp ranks; chunking them is not supported yet).", check=_non_negative)
    gc_freq: int = _opt(50, "Run Python's garbage collector every this many steps.", check=_positive)
    dataloader: DataLoader = _section(DataLoader, "Data loading for training.")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = _opt(1, "Ranks holding full replicas of the parameters (DDP; HSDP "
                                               "when combined with sharding). 1 disables it.", check=_positive)
    data_parallel_shard_degree: int = _opt(-1, "Ranks the parameters, gradients and optimizer state are "
                                           "sharded over (FSDP). -1 takes all devices left over by the other "
                                           "degrees; 1 disables it.", check=_minus_one_or_positive)
    tensor_parallel_degree: int = _opt(1, "Ranks each layer's weights are split over (tensor parallelism with "
                                       "sequence parallelism). 1 disables it.", check=_positive)
    pipeline_parallel_degree: int = _opt(1, "Pipeline stages. Must be 1 in torchtpu.",
                                         check=_only_one("pipeline parallelism"))
    context_parallel_degree: int = _opt(1, "Ranks a sequence is split over (context parallelism). Must be 1 "
                                        "in torchtpu.", check=_only_one("context parallelism"))
    num_slices: int = _opt(1, "TPU slices the job spans (Multislice, connected over the data-center network, "
                           "DCN). The mesh axis named by dcn_axis is split across slices.", check=_positive)
    dcn_axis: str = _opt("dp_replicate", "Mesh axis that crosses slice boundaries when num_slices > 1; its "
                         "degree must be a multiple of num_slices.", choices=("dp_replicate", "dp_shard"))


@dataclass
class Checkpoint:
    enable: bool = _opt(False, "Save checkpoints, and resume from the newest one in the checkpoint folder.")
    folder: str = _opt("checkpoint", "Sub-folder of dump_folder holding the checkpoints (step-N folders).")
    interval: int = _opt(500, "Save every this many steps.", check=_positive)
    initial_load_path: str | None = _opt(None, "Checkpoint to start from when the checkpoint folder is still "
                                         "empty (e.g. pre-trained weights); ignored once the run has "
                                         "checkpoints of its own.")
    initial_load_model_only: bool = _opt(True, "Load only the model weights from initial_load_path; false "
                                         "also restores optimizer, scheduler and step.")
    initial_load_in_hf: bool = _opt(False, "initial_load_path is a Hugging Face model folder (config.json + "
                                    "safetensors) rather than a torchtpu checkpoint (needs "
                                    "initial_load_model_only).")
    last_save_model_only: bool = _opt(True, "At the end of training save only the model weights; false saves "
                                      "the full resumable state.")
    last_save_in_hf: bool = _opt(False, "Also write the final weights as a Hugging Face folder, "
                                 "<folder>/hf_step_N (config.json + safetensors in export_dtype; needs "
                                 "last_save_model_only).")
    export_dtype: str = _opt("float32", "Dtype of the weights in the final model-only save.",
                             choices=("float16", "bfloat16", "float32"))
    async_mode: str = _opt("disabled", "disabled: training waits for each save; async: saves are written in "
                           "the background; async_with_pinned_mem: the same, staging through host memory.",
                           choices=("disabled", "async", "async_with_pinned_mem"))
    keep_latest_k: int = _opt(10, "Keep only the newest k checkpoints; 0 keeps them all.", check=_non_negative)
    load_step: int = _opt(-1, "Resume from this step's checkpoint (an error listing the steps there are if it "
                          "does not exist); -1: the newest readable one (a save that never finished is ignored, a "
                          "damaged checkpoint is renamed step_N.unreadable and the one before it is used).",
                          check=_minus_one_or_non_negative)
    exclude_from_loading: list[str] = _opt([], "Parts of the state not to restore when resuming (they are not read "
                                           "and start fresh): optimizer, lr_scheduler, dataloader.",
                                           check=_state_parts)
    enable_first_step_checkpoint: bool = _opt(False, "Also save right after step 1, to prove saving works early.")
    load_only: bool = _opt(False, "Load checkpoints but never save any.")


@dataclass
class ActivationCheckpoint:
    mode: str = _opt("selective", "Recompute activations in the backward pass instead of storing them: none, "
                     "full (every transformer block) or selective.", choices=("selective", "full", "none"))
    selective_ac_option: str = _opt("2", 'For mode = "selective": "N" checkpoints every N-th block; "op" '
                                    "saves the outputs of expensive ops and recomputes the rest.",
                                    check=_selective_ac_option)


@dataclass
class Compile:
    enable: bool = _opt(False, "Accepted for torchtitan configs; changes nothing. torchtpu-train always compiles "
                        "the whole training step (model, loss, backward, clipping, optimizer) into one XLA "
                        "program, and the validation forward into another, whether this is true or false.")
    components: list[str] = _opt(["model", "loss"], "Accepted for torchtitan configs; changes nothing: the model "
                                 "and the loss are always compiled, as parts of the one program per step. "
                                 "Allowed: model, loss.", check=_components)
    backend: str = _opt("tpu", "The compiler: XLA, through torchtpu (torch.compile's \"tpu\" backend). Other "
                        "backends (torchtitan's \"inductor\") do not target TPUs.", choices=("tpu",))


@dataclass
class Comm:
    init_timeout_seconds: int = _opt(300, "Time allowed for start-up and the first step: the hosts joining the job "
                                     "(jax.distributed's initialization timeout), building the model and compiling "
                                     "the step. Past it the step watchdog dumps every stack and exits 42.",
                                     check=_positive)
    train_timeout_seconds: int = _opt(100, "Step watchdog after the first step: when no step finishes in this time "
                                      "(a host is stuck or gone), every Python stack is written to the log and the "
                                      "process exits with 42 (retriable).", check=_positive)


@dataclass
class Validation:
    enable: bool = _opt(False, "Evaluate the loss and perplexity on held-out data at step 1 and every freq steps, "
                        "as a compiled forward-only program sharded like training; logged with the training "
                        "metrics (console, metrics.jsonl, TensorBoard, W&B) as validation/loss and "
                        "validation/perplexity.")
    dataset: str = _opt("c4_validation", 'Validation dataset name: "bundled_validation" (the held-out documents '
                        'of the bundled corpus, which dataset = "bundled" never trains on), "c4_validation", a '
                        'Hugging Face "org/name", or any name with dataset_path.')
    dataset_path: str | None = _opt(None, "Local folder or file to read the validation dataset from.")
    local_batch_size: int = _opt(8, "Validation sequences per data-parallel rank in each batch.", check=_positive)
    seq_len: int = _opt(2048, "Tokens per validation sequence.", check=_positive)
    freq: int = _opt(10, "Validate at step 1 and every this many training steps.", check=_positive)
    steps: int = _opt(-1, "Validation batches per evaluation: -1 reads the whole validation set (with several "
                      "hosts, as many batches as the host with the fewest has); N reads its first N batches, "
                      "wrapping around a smaller set. Every evaluation reads the same batches.",
                      check=_minus_one_or_positive)
    dataloader: DataLoader = _section(DataLoader, "Data loading for validation.")


@dataclass
class Debug:
    seed: int | None = _opt(None, "Base random seed; unset picks a fresh one each run.", check=_non_negative)
    deterministic: bool = _opt(False, "Make runs repeatable: seed 0 when seed is unset (instead of a fresh random "
                               "seed each run), and PyTorch's deterministic algorithms "
                               "(torch.use_deterministic_algorithms) for the ops that run on the host.")
    verbose: bool = _opt(False, "Show full tracebacks on errors and debug-level logs (same as --debug).")


@dataclass
class Tpu:
    topology: str = _opt("", 'Target TPU slice, e.g. "v5p:4x4x4" (64 chips). Set: the configuration is checked '
                         "against that many chips and --dry-run compiles for it ahead of time. Empty: the "
                         "devices attached to this host(s).", check=_topology)
    dry_run: bool = _opt(False, "Build and compile the train step, report memory and FLOPs, and exit without "
                         "training (same as --dry-run).")
    xla_flags: str = _opt("", "Extra XLA flags (appended to $XLA_FLAGS; flags already in the environment win), "
                          'e.g. "--xla_force_host_platform_device_count=8" for 8 CPU devices.')
    libtpu_init_args: str = _opt("", "Extra libtpu flags (appended to $LIBTPU_INIT_ARGS; flags already in the "
                                 "environment win).")
    scan_layers: bool = _opt(True, "Compile the model's identical transformer blocks once and run them under "
                             "jax.lax.scan (compile time independent of depth). Applies with [activation_checkpoint] "
                             'mode = "full" (the scan recomputes each block in backward); false: blocks unrolled.')


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
        # Where each value came from: (section, ..., key) -> file path or COMMAND_LINE. Absent: default.
        self._origins: dict[tuple[str, ...], str] = {}

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (section -> key -> value); unset optional keys are None."""
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The configuration as TOML that load_config reads back to an equal configuration."""
        lines = ["# torchtpu-train configuration, fully resolved"]
        if self.job.config_file:
            lines.append(f"# read from {self.job.config_file}")
        _emit_toml(self, (), lines)
        return "\n".join(lines) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> "JobConfig":
        return config_from_dict(data, source)

    def origin(self, *path: str) -> str | None:
        """Where the value at path (e.g. "training", "seq_len") was set: a file, "command line", or None (default)."""
        return self._origins.get(tuple(path))


# Keys torchtitan 0.2.2 has that torchtpu deliberately lacks (CUDA-only, or features not built).
_TORCHTITAN_ONLY_SECTIONS = ("quantize", "memory_estimation", "fault_tolerance", "experimental")
_TORCHTITAN_ONLY_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("job",): ("custom_config_module",),
    ("model",): ("tokenizer_path", "converters", "print_after_conversion"),
    ("optimizer",): ("implementation", "early_step_in_backward"),
    ("training",): ("enable_cpu_offload", "gc_debug"),
    ("training", "dataloader"): ("pin_memory",),
    ("validation", "dataloader"): ("pin_memory",),
    ("parallelism",): (
        "fsdp_reshard_after_forward", "disable_loss_parallel", "enable_async_tensor_parallel",
        "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
        "pipeline_parallel_expert_parallel_overlap", "context_parallel_load_balancer",
        "context_parallel_rotate_method", "expert_parallel_degree", "expert_tensor_parallel_degree",
        "expert_parallel_comm_backend",
    ),
    ("checkpoint",): ("enable_ft_dataloader_checkpoints", "initial_load_in_hf_quantized", "create_seed_checkpoint"),
    ("activation_checkpoint",): (
        "per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop", "memory_budget",
        "visualize_memory_budget_pareto", "preserve_rng_state", "determinism_check", "debug",
    ),
    ("comm",): ("trace_buf_size", "save_traces_folder", "save_traces_file_prefix", "mode"),
    ("debug",): ("deterministic_warn_only", "moe_force_load_balance"),
}


# ----------------------------------------------------------------------------------------------
# Schema introspection
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    name: str
    base: type  # bool, int, float, str, list (of str), or a section dataclass
    optional: bool
    default: Any
    help: str
    choices: tuple | None
    check: Check | None

    @property
    def is_section(self) -> bool:
        return dataclasses.is_dataclass(self.base)

    def describe(self, cli: bool = False) -> str:
        if self.choices:
            text = "one of " + ", ".join(_fmt(c) for c in self.choices)
        else:
            text = {
                bool: "true or false",
                int: "an integer",
                float: "a number",
                str: "a string",
                list: "a comma-separated list of strings" if cli else "a list of strings, e.g. [\"a\", \"b\"]",
            }[self.base]
        if self.optional:
            text += ' or "none" to unset' if cli else " (leave the key out to unset)"
        return text


_SPECS: dict[type, dict[str, _Spec]] = {}


def _specs(cls: type) -> dict[str, _Spec]:
    if cls in _SPECS:
        return _SPECS[cls]
    hints = typing.get_type_hints(cls)
    out: dict[str, _Spec] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        optional = False
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            optional = len(args) < len(typing.get_args(hint))
            (hint,) = args
        base = list if typing.get_origin(hint) is list else hint
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        out[f.name] = _Spec(f.name, base, optional, default, f.metadata.get("help", ""),
                            f.metadata.get("choices"), f.metadata.get("check"))
    _SPECS[cls] = out
    return out


def _walk(cls: type = JobConfig, path: tuple[str, ...] = ()):
    """Yield (path, spec) for every leaf key, in schema order (sections before their sub-sections)."""
    subsections = []
    for name, spec in _specs(cls).items():
        if spec.is_section:
            subsections.append((path + (name,), spec.base))
        else:
            yield path + (name,), spec
    for sub_path, sub_cls in subsections:
        yield from _walk(sub_cls, sub_path)


def _section_name(path: tuple[str, ...]) -> str:
    return ".".join(path)


def _fmt(value: Any) -> str:
    """A value as a TOML literal (for messages and for to_toml)."""
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_fmt(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _emit_toml(obj: Any, path: tuple[str, ...], lines: list[str]) -> None:
    specs = _specs(type(obj))
    if path:
        lines.append("")
        lines.append(f"[{_section_name(path)}]")
    for name, spec in specs.items():
        if spec.is_section:
            continue
        if path == ("job",) and name == "config_file":
            continue  # given with --config, not inside the file
        value = getattr(obj, name)
        if value is None:
            lines.append(f"# {name} is unset")
        else:
            lines.append(f"{name} = {_fmt(value)}")
    for name, spec in specs.items():
        if spec.is_section:
            _emit_toml(getattr(obj, name), path + (name,), lines)


# ----------------------------------------------------------------------------------------------
# Reading values
# ----------------------------------------------------------------------------------------------

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")


class _Bad(Exception):
    """A value problem; the caller adds where it happened."""


def _coerce(spec: _Spec, value: Any, cli: bool) -> Any:
    """Turn a TOML value (cli=False) or a command-line string (cli=True) into the key's type."""
    if cli:
        assert isinstance(value, str)
        if spec.optional and value.strip().lower() in _NONE:
            return None
        if spec.base is bool:
            low = value.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise _Bad(f"expected {spec.describe(cli)}")
        if spec.base is int:
            try:
                return int(value.strip())
            except ValueError:
                raise _Bad(f"expected {spec.describe(cli)}") from None
        if spec.base is float:
            try:
                return float(value.strip())
            except ValueError:
                raise _Bad(f"expected {spec.describe(cli)}") from None
        if spec.base is list:
            return [part.strip() for part in value.split(",") if part.strip()]
        return value
    # TOML value
    base = spec.base
    ok = (
        (base is bool and isinstance(value, bool))
        or (base is int and isinstance(value, int) and not isinstance(value, bool))
        or (base is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (base is str and isinstance(value, str))
        or (base is list and isinstance(value, list) and all(isinstance(v, str) for v in value))
    )
    if not ok:
        raise _Bad(f"expected {spec.describe(cli)}")
    if base is float:
        return float(value)
    if base is list:
        return list(value)
    return value


def _check_value(spec: _Spec, value: Any) -> None:
    if value is None:
        if not spec.optional:
            raise _Bad(f"expected {spec.describe()}")
        return
    if spec.choices and value not in spec.choices:
        raise _Bad("allowed: " + ", ".join(_fmt(c) for c in spec.choices))
    if spec.check is not None:
        problem = spec.check(value)
        if problem:
            raise _Bad(problem)


def _value_error(source: str, path: tuple[str, ...], value: Any, problem: str, raw: bool = False) -> ConfigError:
    shown = json.dumps(value) if raw else _fmt(value)
    return ConfigError(f"{source}: [{_section_name(path[:-1])}] {path[-1]} = {_short(shown)}: {problem}")


def _unknown_key_message(source: str, path: tuple[str, ...], value_text: str, cli: bool) -> str:
    """Message for a key that does not exist, with the closest valid key suggested."""
    section, key = path[:-1], path[-1]
    sec_text = _section_name(section)
    prefix = f"{source}: [{sec_text}] {key}{value_text}"
    if key in _TORCHTITAN_ONLY_KEYS.get(section, ()):
        hint = " (use hf_assets_path)" if key == "tokenizer_path" else ""
        return f"{prefix}: a torchtitan key that torchtpu does not support{hint}; remove it"
    cls = _section_class(section)
    valid = [name for name, s in _specs(cls).items() if not s.is_section]
    # The same key in another section is the likeliest mistake.
    elsewhere = [p for p, _ in _walk() if p[-1] == key and p[:-1] != section]
    if elsewhere:
        where = elsewhere[0]
        spelled = f"--{'.'.join(where)}" if cli else f"[{_section_name(where[:-1])}] {key}"
        return f"{prefix}: unknown key in [{sec_text}]; did you mean {spelled}?"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        spelled = f"--{_section_name(section)}.{close[0]}" if cli else repr(close[0])
        suggestion = f"did you mean {spelled}? "
    else:
        suggestion = ""
    return f"{prefix}: unknown key; {suggestion}valid keys in [{sec_text}]: {', '.join(valid)}"


def _unknown_section_message(source: str, path: tuple[str, ...], cli: bool, extra: str = "") -> str:
    name = _section_name(path)
    if path[0] in _TORCHTITAN_ONLY_SECTIONS:
        return f"{source}: [{name}]{extra}: a torchtitan section that torchtpu does not support; remove it"
    if len(path) > 1:
        parent = _section_class(path[:-1])
        valid = [_section_name(path[:-1] + (n,)) for n, s in _specs(parent).items() if s.is_section]
    else:
        valid = list(_specs(JobConfig))
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    suggestion = f"did you mean [{close[0]}]? " if close else ""
    allowed = ", ".join(f"[{v}]" for v in valid) if valid else "none"
    return f"{source}: [{name}]{extra}: unknown section; {suggestion}valid sections here: {allowed}"


def _section_class(path: tuple[str, ...]) -> type:
    cls: type = JobConfig
    for name in path:
        cls = _specs(cls)[name].base
    return cls


def _get(cfg: JobConfig, path: tuple[str, ...]) -> Any:
    obj: Any = cfg
    for name in path:
        obj = getattr(obj, name)
    return obj


def _set(cfg: JobConfig, path: tuple[str, ...], value: Any) -> None:
    setattr(_get(cfg, path[:-1]), path[-1], value)


def _apply_table(cfg: JobConfig, table: dict, path: tuple[str, ...], source: str) -> None:
    cls = _section_class(path)
    specs = _specs(cls)
    for key, value in table.items():
        here = path + (key,)
        spec = specs.get(key)
        if spec is None:
            if not path:
                if isinstance(value, dict):
                    raise ConfigError(_unknown_section_message(source, here, cli=False))
                owners = [p for p, _ in _walk() if p[-1] == key]
                hint = (f"; did you mean [{_section_name(owners[0][:-1])}] {key}?" if owners
                        else "; every key belongs under a [section]")
                raise ConfigError(f"{source}: {key} = {_short(_fmt(value))}: key outside any section{hint}")
            if isinstance(value, dict) and key not in _TORCHTITAN_ONLY_KEYS.get(path, ()):
                raise ConfigError(_unknown_section_message(source, here, cli=False))
            raise ConfigError(_unknown_key_message(source, here, f" = {_short(_fmt(value))}", cli=False))
        if spec.is_section:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: [{_section_name(path)}] {key} = {_short(_fmt(value))}: "
                                  f"{key} is a section; write it as [{_section_name(here)}]")
            _apply_table(cfg, value, here, source)
            continue
        if path == ("job",) and key == "config_file":
            raise ConfigError(f"{source}: [job] config_file = {_short(_fmt(value))}: not allowed inside a config "
                              "file; give the file with --config")
        try:
            coerced = _coerce(spec, value, cli=False)
            _check_value(spec, coerced)
        except _Bad as e:
            raise _value_error(source, here, value, str(e)) from None
        _set(cfg, here, coerced)
        cfg._origins[here] = source


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> JobConfig:
    """Build a JobConfig from a nested dict (as from to_dict() or a parsed TOML file) over the defaults.

    None values (unset optional keys, as to_dict() writes them) are accepted for optional keys.
    """
    cfg = JobConfig()

    def strip_none(table: dict, path: tuple[str, ...]) -> dict:
        out = {}
        for k, v in table.items():
            if isinstance(v, dict):
                out[k] = strip_none(v, path + (k,))
            elif v is None:
                try:
                    spec = _specs(_section_class(path))[k]
                except (KeyError, AttributeError, TypeError):
                    out[k] = v  # let _apply_table report the unknown key
                    continue
                if not spec.optional:
                    raise ConfigError(f"{source}: [{_section_name(path)}] {k} = (unset): "
                                      f"expected {spec.describe()}")
            else:
                out[k] = v
        return out

    data = strip_none(data, ())
    job = data.get("job")
    if isinstance(job, dict) and "config_file" in job:
        job = dict(job)
        cfg.job.config_file = job.pop("config_file")
        data = dict(data, job=job)
    _apply_table(cfg, data, (), source)
    _check_relations(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

_ALIASES = {
    "--dry-run": ("tpu", "dry_run"),
    "--dry_run": ("tpu", "dry_run"),
    "--topology": ("tpu", "topology"),
    "--debug": ("debug", "verbose"),
    "--config": ("job", "config_file"),
}


def _resolve_cli_key(option: str, value: str | None = None) -> tuple[tuple[str, ...], bool | None]:
    """'--training.seq-len' -> (('training', 'seq_len'), None); '--checkpoint.no-enable' -> (..., False).

    Raises ConfigError for options that name no key (value, if known, is quoted in the message).
    """
    if option in _ALIASES:
        return _ALIASES[option], None
    body = option[2:]
    shown = "" if value is None else f" = {_short(json.dumps(value))}"
    if "." not in body:
        name = body.replace("-", "_")
        owners = [p for p, _ in _walk() if p[-1] == name]
        hint = f"; did you mean --{'.'.join(owners[0])}?" if owners else ""
        raise ConfigError(f"{COMMAND_LINE}: {option}{shown}: unknown option; options are --config FILE, "
                          f"--dry-run, --topology NAME, --debug, --help and --SECTION.KEY VALUE{hint}")
    parts = tuple(p.replace("-", "_") for p in body.split("."))
    # Find the section prefix.
    cls: type = JobConfig
    for i, name in enumerate(parts[:-1]):
        spec = _specs(cls).get(name)
        if spec is None or not spec.is_section:
            raise ConfigError(_unknown_section_message(COMMAND_LINE, parts[: i + 1], cli=True,
                                                       extra=f" (from {option}{shown})"))
        cls = spec.base
    key = parts[-1]
    specs = _specs(cls)
    if key in specs and not specs[key].is_section:
        return parts, None
    if key.startswith("no_") and key[3:] in specs and specs[key[3:]].base is bool:
        return parts[:-1] + (key[3:],), False
    if key in specs:  # a section given as a key
        raise ConfigError(f"{COMMAND_LINE}: {option}: [{_section_name(parts)}] is a section; "
                          f"set one of its keys, e.g. --{'.'.join(parts)}.{next(iter(_specs(specs[key].base)))}")
    raise ConfigError(_unknown_key_message(COMMAND_LINE, parts, f"{shown} (from {option})", cli=True))


def _parse_argv(argv: list[str]) -> tuple[str | None, list[tuple[tuple[str, ...], Any, str]]]:
    """Split argv into the config file and an ordered list of (path, raw value or bool, option text)."""
    config_file = None
    overrides: list[tuple[tuple[str, ...], Any, str]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token in ("-h", "--help"):
            raise HelpRequested(help_text())
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"{COMMAND_LINE}: {token!r}: unexpected argument; options look like "
                              "--SECTION.KEY VALUE (see --help)")
        option, eq, inline = token.partition("=")
        if eq:
            peek: str | None = inline
        elif i < len(argv) and not argv[i].startswith("--"):
            peek = argv[i]
        else:
            peek = None
        path, negated = _resolve_cli_key(option, peek)
        spec = _specs(_section_class(path[:-1]))[path[-1]]
        if spec.base is bool:
            if eq:
                raw: Any = inline
            elif i < len(argv) and argv[i].strip().lower() in _TRUE + _FALSE:
                raw = argv[i]
                i += 1
            else:
                raw = True
            if negated is not None:
                if raw is not True:
                    raise ConfigError(f"{COMMAND_LINE}: [{_section_name(path[:-1])}] {path[-1]} = {raw}: "
                                      f"{option} takes no value; use --{'.'.join(path)} {raw}")
                raw = False
        else:
            if eq:
                raw = inline
            elif i < len(argv):
                raw = argv[i]
                i += 1
            else:
                raise ConfigError(f"{COMMAND_LINE}: [{_section_name(path[:-1])}] {path[-1]}: {option} needs a "
                                  f"value ({spec.describe(cli=True)})")
        if path == ("job", "config_file"):
            config_file = raw
            continue
        overrides.append((path, raw, option))
    return config_file, overrides


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found (current directory: {os.getcwd()})") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder; --config expects a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config file: {e}") from None


def load_config(argv: list[str]) -> JobConfig:
    """Defaults, then the TOML file from --config (or --job.config_file), then the other options in order.

    Raises ConfigError (one line) for any problem, HelpRequested for -h/--help.
    """
    config_file, overrides = _parse_argv(list(argv))
    cfg = JobConfig()
    if config_file is not None:
        _apply_table(cfg, _read_toml(config_file), (), config_file)
        cfg.job.config_file = config_file
    for path, raw, _option in overrides:
        spec = _specs(_section_class(path[:-1]))[path[-1]]
        try:
            value = raw if isinstance(raw, bool) else _coerce(spec, raw, cli=True)
        except _Bad as e:
            raise _value_error(COMMAND_LINE, path, raw, str(e), raw=True) from None
        try:
            _check_value(spec, value)
        except _Bad as e:
            raise _value_error(COMMAND_LINE, path, value, str(e)) from None
        _set(cfg, path, value)
        cfg._origins[path] = COMMAND_LINE
    _check_relations(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------
# Checks that involve more than one key, and validation against the devices
# ----------------------------------------------------------------------------------------------


def _describe(cfg: JobConfig, section: tuple[str, ...], keys: list[str]) -> str:
    """'FILE: [section] k1 = v1, k2 = v2 (default)' naming where each value came from."""
    file = cfg.job.config_file
    parts = []
    for key in keys:
        path = section + (key,)
        text = f"{key} = {_short(_fmt(_get(cfg, path)), 80)}"
        origin = cfg._origins.get(path)
        if origin is None:
            text += " (default)"
        elif origin != file:
            text += f" ({origin})"
        parts.append(text)
    return f"{file or COMMAND_LINE}: [{_section_name(section)}] " + ", ".join(parts)


def _check_all_fields(cfg: JobConfig) -> None:
    """Types and allowed values of every key (for configs built or edited in code)."""
    for path, spec in _walk():
        value = _get(cfg, path)
        try:
            if value is not None:
                _coerce(spec, value, cli=False)  # type check only
            _check_value(spec, value)
        except _Bad as e:
            raise ConfigError(f"{_describe(cfg, path[:-1], [path[-1]])}: {e}") from None


def _check_relations(cfg: JobConfig) -> None:
    flavors = MODEL_FLAVORS.get(cfg.model.name, ())
    if cfg.model.flavor not in flavors:
        raise ConfigError(f"{_describe(cfg, ('model',), ['name', 'flavor'])}: unknown flavor; allowed for "
                          f"{cfg.model.name}: {', '.join(flavors)}")
    ck = cfg.checkpoint
    if ck.initial_load_in_hf and not ck.initial_load_model_only:
        raise ConfigError(f"{_describe(cfg, ('checkpoint',), ['initial_load_in_hf', 'initial_load_model_only'])}: "
                          "Hugging Face weights hold only the model; set initial_load_model_only = true")
    if ck.last_save_in_hf and not ck.last_save_model_only:
        raise ConfigError(f"{_describe(cfg, ('checkpoint',), ['last_save_in_hf', 'last_save_model_only'])}: "
                          "Hugging Face safetensors hold only the model; set last_save_model_only = true")
    if ck.last_save_in_hf and (not ck.enable or ck.load_only):
        raise ConfigError(f"{_describe(cfg, ('checkpoint',), ['last_save_in_hf', 'enable', 'load_only'])}: "
                          "the Hugging Face folder is written with the final checkpoint; set enable = true and "
                          "load_only = false")
    for section in (("training", "dataloader"), ("validation", "dataloader")):
        dl = _get(cfg, section)
        if dl.num_workers == 0:
            for key, bad in (("persistent_workers", dl.persistent_workers), ("prefetch_factor",
                                                                             dl.prefetch_factor is not None)):
                if bad:
                    raise ConfigError(f"{_describe(cfg, section, ['num_workers', key])}: {key} needs "
                                      "num_workers > 0")


@dataclass(frozen=True)
class ParallelDims:
    """Resolved parallelism for a device count (what validate returns).

    Mesh axes, outermost first: dp_replicate, dp_shard, tp (pp and cp are always 1 in torchtpu).
    """

    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    local_batch_size: int
    global_batch_size: int
    grad_accum_steps: int
    seq_len: int
    pp: int = 1
    cp: int = 1
    num_slices: int = 1
    dcn_axis: str = "dp_replicate"

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def mesh_axis_names(self) -> tuple[str, ...]:
        return ("dp_replicate", "dp_shard", "tp")

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.dp_shard, self.tp)

    @property
    def dcn_mesh_shape(self) -> tuple[int, ...]:
        """Per-axis split across slices (for jax mesh_utils.create_hybrid_device_mesh)."""
        return tuple(self.num_slices if name == self.dcn_axis else 1 for name in self.mesh_axis_names)

    @property
    def ici_mesh_shape(self) -> tuple[int, ...]:
        """Per-axis size within one slice; ici_mesh_shape[i] * dcn_mesh_shape[i] == mesh_shape[i]."""
        return tuple(m // d for m, d in zip(self.mesh_shape, self.dcn_mesh_shape))

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


def _is_remote(path: str) -> bool:
    return "://" in path


def _check_path(cfg: JobConfig, section: str, key: str, what: str) -> None:
    value = getattr(getattr(cfg, section), key)
    if not value or _is_remote(value):
        return
    if not os.path.exists(os.path.expanduser(value)):
        raise ConfigError(f"{_describe(cfg, (section,), [key])}: {what} not found (relative paths are from "
                          f"{os.getcwd()}); give an existing path" + (' or "" for the bundled tokenizer'
                                                                     if key == "hf_assets_path" else
                                                                     " or leave the key out"))


def validate(cfg: JobConfig, num_devices: int) -> ParallelDims:
    """Check cfg for a run on num_devices chips (all hosts together) and resolve the parallel degrees.

    torchtitan's rules: data_parallel_shard_degree = -1 takes the devices the other degrees leave;
    the degrees must multiply to num_devices; global_batch_size = -1 means local_batch_size x dp,
    otherwise it must be a multiple of that and the quotient is the gradient-accumulation steps.
    Paths that are set (tokenizer folder, dataset paths, initial checkpoint) must exist.
    Raises ConfigError (one line).
    """
    _check_all_fields(cfg)
    _check_relations(cfg)
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ConfigError(f"validate: num_devices = {num_devices!r}: must be a positive integer")
    par = cfg.parallelism
    sec = ("parallelism",)
    rep, shard, tp = par.data_parallel_replicate_degree, par.data_parallel_shard_degree, par.tensor_parallel_degree
    pp, cp = par.pipeline_parallel_degree, par.context_parallel_degree
    others = rep * tp * pp * cp
    keys = ["data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree"]
    if shard == -1:
        if num_devices % others:
            raise ConfigError(f"{_describe(cfg, sec, keys)}: the other degrees multiply to {others}, which does "
                              f"not divide the {num_devices} devices, so data_parallel_shard_degree = -1 has no "
                              f"whole number to take; choose degrees whose product divides {num_devices}")
        shard = num_devices // others
    elif others * shard != num_devices:
        raise ConfigError(f"{_describe(cfg, sec, keys)}: the degrees multiply to {others * shard} but there are "
                          f"{num_devices} devices; their product must equal {num_devices} (or set "
                          "data_parallel_shard_degree = -1 to use the devices left over)")
    if par.num_slices > 1:
        if num_devices % par.num_slices:
            raise ConfigError(f"{_describe(cfg, sec, ['num_slices'])}: {num_devices} devices cannot be split "
                              f"evenly into {par.num_slices} slices")
        axis_degree = {"dp_replicate": rep, "dp_shard": shard}[par.dcn_axis]
        if axis_degree % par.num_slices:
            degree_key = {"dp_replicate": "data_parallel_replicate_degree",
                          "dp_shard": "data_parallel_shard_degree"}[par.dcn_axis]
            raise ConfigError(f"{_describe(cfg, sec, ['num_slices', 'dcn_axis', degree_key])}: the {par.dcn_axis} "
                              f"degree ({axis_degree}) must be a multiple of num_slices ({par.num_slices})")
    tr = cfg.training
    if tp > 1:
        if tr.seq_len % tp:
            raise ConfigError(f"{_describe(cfg, ('training',), ['seq_len'])}: with tensor_parallel_degree = {tp} "
                              f"(sequence parallel) seq_len must be a multiple of {tp}")
        if cfg.validation.enable and cfg.validation.seq_len % tp:
            raise ConfigError(f"{_describe(cfg, ('validation',), ['seq_len'])}: with tensor_parallel_degree = "
                              f"{tp} (sequence parallel) seq_len must be a multiple of {tp}")
    dp = rep * shard
    micro = tr.local_batch_size * dp
    if tr.global_batch_size == -1:
        global_batch = micro
    else:
        global_batch = tr.global_batch_size
        if global_batch % micro:
            raise ConfigError(f"{_describe(cfg, ('training',), ['global_batch_size', 'local_batch_size'])}: "
                              f"global_batch_size must be a multiple of local_batch_size x data-parallel degree "
                              f"= {tr.local_batch_size} x {dp} = {micro} (e.g. {micro} or {2 * micro}), or -1 "
                              f"for {micro}")
    _check_path(cfg, "model", "hf_assets_path", "tokenizer / Hugging Face assets folder")
    _check_path(cfg, "training", "dataset_path", "dataset path")
    if cfg.validation.enable:
        _check_path(cfg, "validation", "dataset_path", "validation dataset path")
    _check_path(cfg, "checkpoint", "initial_load_path", "initial checkpoint")
    return ParallelDims(
        world_size=num_devices, dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, cp=cp,
        local_batch_size=tr.local_batch_size, global_batch_size=global_batch,
        grad_accum_steps=global_batch // micro, seq_len=tr.seq_len,
        num_slices=par.num_slices, dcn_axis=par.dcn_axis,
    )


# ----------------------------------------------------------------------------------------------
# Environment for XLA / libtpu
# ----------------------------------------------------------------------------------------------


def _merge_flags(env_value: str, extra: str) -> str:
    have = env_value.split()
    names = {tok.split("=", 1)[0] for tok in have}
    add = [tok for tok in extra.split() if tok.split("=", 1)[0] not in names]
    return " ".join(have + add)


def xla_env_updates(cfg: JobConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables to change so tpu.xla_flags / tpu.libtpu_init_args take effect.

    Flags already in the environment win over the config's. Empty dict: nothing to change.
    Must be applied before the XLA backend starts.
    """
    environ = os.environ if environ is None else environ
    updates = {}
    for var, extra in (("XLA_FLAGS", cfg.tpu.xla_flags), ("LIBTPU_INIT_ARGS", cfg.tpu.libtpu_init_args)):
        current = environ.get(var, "")
        merged = _merge_flags(current, extra)
        if merged != " ".join(current.split()) and extra.split():
            updates[var] = merged
    return updates


# ----------------------------------------------------------------------------------------------
# --help
# ----------------------------------------------------------------------------------------------


def _wrap(text: str, indent: str, width: int = 100) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent,
                         break_on_hyphens=False, break_long_words=False) or [indent]


def help_text(prog: str = "torchtpu-train") -> str:
    lines = [
        f"usage: {prog} --config FILE [--SECTION.KEY VALUE ...] [--dry-run] [--topology NAME] [--debug]",
        "",
        *_wrap("Train a torchtitan Llama 3 model on TPU chips (or on XLA CPU devices). Every value starts at "
               "the default listed below, is replaced by the TOML file given with --config, then by "
               "--SECTION.KEY options (later options win). In the TOML file a key is written under its "
               "[SECTION] header.", ""),
        "",
        *_wrap("Booleans: --SECTION.KEY sets true; --SECTION.no-KEY sets false; --SECTION.KEY true|false also "
               "works. Lists: comma-separated (--compile.components model,loss). Optional keys: the value "
               "'none' unsets them. --SECTION.KEY=VALUE and hyphens for underscores are accepted.", ""),
        "",
        "general options:",
        "  -h, --help            show this help and exit",
        "  --config FILE         TOML configuration file (same as --job.config_file)",
        "  --dry-run             same as --tpu.dry_run",
        "  --topology NAME       same as --tpu.topology NAME, e.g. v5p:4x4x4",
        "  --debug               same as --debug.verbose: full tracebacks on errors",
        "",
        "Configuration errors exit with status 2; other failures with status 1.",
    ]
    current: tuple[str, ...] | None = None
    for path, spec in _walk():
        section = path[:-1]
        if section != current:
            current = section
            parent = _section_class(section[:-1])
            title = _specs(parent)[section[-1]].help
            lines += ["", f"[{_section_name(section)}]  {title}"]
        name = "--" + ".".join(path)
        if spec.base is bool:
            usage = f"{name}, --{_section_name(section)}.no-{path[-1]}"
        else:
            metavar = {int: "INT", float: "FLOAT", str: "STR", list: "A,B,..."}[spec.base]
            usage = f"{name} {'VALUE' if spec.choices else metavar}"
        default = "unset" if spec.default is None else _fmt(spec.default)
        lines.append(f"  {usage}  (default: {default})")
        text = spec.help
        if spec.choices:
            text += " Allowed: " + ", ".join(_fmt(c) for c in spec.choices) + "."
        lines += _wrap(text, "      ")
    return "\n".join(lines) + "\n"


def copy_config(cfg: JobConfig) -> JobConfig:
    """A deep copy that keeps where each value came from."""
    return copy.deepcopy(cfg)
