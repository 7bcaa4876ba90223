"""The trainer's configuration schema: one typed dataclass per TOML section, each key with its default,
its help text and what values it allows.

Section and key names, types and defaults follow torchtitan 0.2.2's JobConfig wherever a key means
the same thing on TPU, so a torchtitan TOML file mostly reads as is. Keys that only make sense on
CUDA are left out (naming one gives an error that says so); TPU-specific keys live in
[parallelism] (`num_slices`, `dcn_axis`), [model] (`attn_type`, `n_layers`, `flavor_overrides`),
[debug] (`verbose`, `inject_stall`) and in a [tpu] section; [experimental] `custom_import` imports the
user's own module (its model families and ops) before the rest is checked.

Reading a configuration (defaults < TOML file < command line), --help and the checks that involve
several keys are in config_manager.py; resolving the parallel degrees for a device count is
parallel_dims.resolve_dims. This module only imports the standard library, so `--help` and config
errors are fast.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ...hardware import TOPOLOGY_FORM, TopologyNameError, parse_topology
from ...models.registry import model_flavors  # the families and flavors: data, standard library only
from .fields import (
    beta,
    fraction,
    json_object,
    known_components,
    minus_one_or_non_negative,
    minus_one_or_positive,
    model_family,
    non_negative,
    not_supported,
    only_one,
    option,
    positive,
    section_field,
    selective_ac_option,
    stall_spec,
    state_parts,
)
from .schema import emit_toml

__all__ = ["ConfigError", "JobConfig", "topology_num_devices"]


class ConfigError(Exception):
    """A configuration problem. str(error) is a single line naming where the bad value came from."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


# ----------------------------------------------------------------------------------------------
# TPU topology names
# ----------------------------------------------------------------------------------------------


def _topology(v):
    if v == "":
        return None
    try:
        return "has no chips" if parse_topology(v).chips < 1 else None
    except TopologyNameError:
        return f'allowed: "" (the attached devices) or {TOPOLOGY_FORM}'


def topology_num_devices(topology: str) -> int:
    """Chips in a TPU topology name such as "v5p:4x4x4" (64) or "v5e:2x4" (8)."""
    try:
        return parse_topology(topology).chips
    except TopologyNameError:
        raise ConfigError(f"[tpu] topology = {json.dumps(topology)}: {_topology(topology)}") from None


# ----------------------------------------------------------------------------------------------
# The schema
# ----------------------------------------------------------------------------------------------


@dataclass
class Job:
    config_file: str | None = option(None, "The TOML file the values were read from; give it with --config.")
    dump_folder: str = option(
        "./outputs",
        "Folder that receives everything the run writes: checkpoints, "
        "TensorBoard events, profiler traces, saved configs.",
    )
    description: str = option("default job", "Free-form description of the run, shown in the logs.")
    print_config: bool = option(False, "Print the fully resolved configuration as TOML and exit without training.")
    save_config_file: str | None = option(
        None, "If set, the trainer writes the resolved configuration to this file name inside dump_folder."
    )


@dataclass
class Profiling:
    enable_profiling: bool = option(False, "Record XLA profiler traces (open them in TensorBoard or Perfetto).")
    save_traces_folder: str = option("profile_traces", "Sub-folder of dump_folder for profiler traces.")
    profile_freq: int = option(10, "Record one trace window every this many steps.", check=positive)
    profiler_active: int = option(1, "Number of steps recorded in each trace window.", check=positive)
    profiler_warmup: int = option(
        3,
        "Steps traced and discarded just before each recorded window (torchtitan's "
        "torch.profiler schedule). Only the default is accepted: jax.profiler cannot "
        "discard part of a trace, so a recorded window always starts cold.",
        check=not_supported(3, "jax.profiler cannot trace steps and discard them"),
    )
    enable_memory_snapshot: bool = option(
        False,
        "Save a device-memory profile (which buffers hold device memory, "
        "pprof format) every profile_freq steps, as "
        "<save_memory_snapshot_folder>/iteration_<step>/memory.prof.",
    )
    save_memory_snapshot_folder: str = option("memory_snapshot", "Sub-folder of dump_folder for memory profiles.")


@dataclass
class Metrics:
    log_freq: int = option(10, "Report loss, tokens/s and MFU every this many steps.", check=positive)
    enable_tensorboard: bool = option(False, "Also write the metrics as TensorBoard events.")
    disable_color_printing: bool = option(
        False, "Log to the terminal without ANSI colours (colours are only ever used when stdout is a terminal)."
    )
    save_tb_folder: str = option("tb", "Sub-folder of dump_folder for TensorBoard events.")
    save_for_all_ranks: bool = option(
        False,
        "Write metrics from every host (process) instead of only the first: "
        "host r>0 writes metrics_rank_<r>.jsonl and TensorBoard events under "
        "<save_tb_folder>/rank_<r>; the console shows only the first host's.",
    )
    enable_wandb: bool = option(False, "Also send the metrics to Weights & Biases.")


@dataclass
class Model:
    name: str = option(
        "llama3",
        "Model family, by its torchtitan name, or a family of your own that [experimental] custom_import registers.",
        check=model_family,
    )
    flavor: str = option(
        "debugmodel",
        "Size of the model within the family: "
        + "; ".join(f"{name}: {', '.join(flavors)}" for name, flavors in model_flavors().items())
        + ".",
    )
    hf_assets_path: str = option(
        "",
        "Folder with the model's Hugging Face files (tokenizer.json or "
        "tokenizer.model, config.json, optionally *.safetensors). Empty: the small "
        "tokenizer bundled with torchtpu, meant for the debug model.",
    )
    attn_type: str = option(
        "",
        'Attention of the model: "" = the flavor\'s; "sdpa" = causal attention over each whole sequence, '
        "for the flavors whose torchtitan attention is flex_attention with block-causal document masks "
        "(deepseek_v3 debugmodel_flex_attn, 16B, 236B, 671B), which torchtpu does not run: documents "
        "packed into one sequence then attend to the ones before them. Same weights.",
        choices=("", "sdpa"),
    )
    n_layers: int | None = option(
        None,
        "Transformer blocks of the model; unset: the flavor's. The flavor with fewer blocks (same width) tries a "
        "configuration quickly; its checkpoints fit only a model of the same depth.",
        check=positive,
    )
    flavor_overrides: str = option(
        "",
        "Other fields of the flavor's torchtitan model arguments to replace, as a JSON object, e.g. "
        '\'{"dim": 64, "n_heads": 4, "moe_args": {"num_experts": 8}}\' (an object for a nested argument '
        "replaces some of its fields); a field the flavor's arguments lack is an error. Empty: the flavor as it is.",
        check=json_object,
    )


@dataclass
class Optimizer:
    name: str = option("AdamW", "Optimizer.", choices=("AdamW", "Adam"))
    lr: float = option(8e-4, "Peak learning rate (reached at the end of warm-up).", check=non_negative)
    beta1: float = option(0.9, "Decay rate of the first-moment (mean) estimate.", check=beta)
    beta2: float = option(0.95, "Decay rate of the second-moment (variance) estimate.", check=beta)
    eps: float = option(1e-8, "Term added to the denominator for numerical stability.", check=non_negative)
    weight_decay: float = option(0.1, "Decoupled weight decay (AdamW) or L2 penalty (Adam).", check=non_negative)


@dataclass
class LRScheduler:
    warmup_steps: int = option(200, "Steps of linear warm-up from near zero to optimizer.lr.", check=non_negative)
    total_steps: int | None = option(
        None,
        "Length of the schedule in steps; unset means training.steps. Lets a short run follow a long run's curve.",
        check=positive,
    )
    decay_ratio: float | None = option(
        None,
        "Fraction of the schedule spent decaying. Unset: decay starts "
        "right after warm-up; otherwise the rate stays flat until the last "
        "decay_ratio of the steps (warmup-stable-decay).",
        check=fraction,
    )
    decay_type: str = option("linear", "Shape of the decay.", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = option(0.0, "The rate decays to optimizer.lr times this factor, not below.", check=fraction)


@dataclass
class DataLoader:
    num_workers: int = option(
        0,
        "Background worker processes that prepare batches. Only 0 (batches are read "
        "and tokenized in the training process, while the devices run the previous "
        "step) is supported yet.",
        check=not_supported(0, "batches are prepared in the training process"),
    )
    persistent_workers: bool = option(
        False,
        "Keep the workers alive between passes over the data (needs num_workers > 0, so not supported yet).",
        check=not_supported(False, "there are no data-loading workers"),
    )
    prefetch_factor: int | None = option(
        None,
        "Batches each worker prepares ahead (needs num_workers > 0, so not supported yet).",
        check=not_supported(None, "there are no data-loading workers"),
    )


@dataclass
class Training:
    dataset: str = option(
        "c4_test",
        'Dataset name: "bundled" (the small corpus shipped with torchtpu), '
        '"c4", "c4_test", ... (see the data loader for the full list).',
    )
    dataset_path: str | None = option(None, "Local folder or file to read the dataset from instead of downloading it.")
    local_batch_size: int = option(8, "Sequences per data-parallel rank in each micro-batch.", check=positive)
    global_batch_size: int = option(
        -1,
        "Sequences per optimizer step over all ranks; -1 means local_batch_size "
        "x data-parallel degree. A multiple of that product accumulates gradients "
        "over global / (local x dp) micro-batches.",
        check=minus_one_or_positive,
    )
    seq_len: int = option(2048, "Tokens per sequence.", check=positive)
    max_norm: float = option(1.0, "Clip the global gradient norm to this value.", check=positive)
    steps: int = option(10000, "Optimizer steps to train for.", check=positive)
    dtype: str = option(
        "float32",
        "Storage dtype of parameters, gradients and optimizer state. bfloat16 trains "
        "fully in bf16 with no fp32 master copy.",
        choices=("bfloat16", "float32"),
    )
    mixed_precision_param: str = option(
        "bfloat16",
        "Dtype parameters are cast to for the forward and backward computation (mixed precision).",
        choices=("bfloat16", "float32"),
    )
    mixed_precision_reduce: str = option(
        "float32", "Dtype of gradient reductions across data-parallel ranks.", choices=("float32",)
    )
    gc_freq: int = option(50, "Run Python's garbage collector every this many steps.", check=positive)
    max_bad_records: int = option(
        0,
        "Malformed data records (a JSON line that does not parse or has no text field) to skip and count "
        "(metric bad_records) before failing; 0 fails on the first, naming its file:line.",
        check=non_negative,
    )
    dataloader: DataLoader = section_field(DataLoader, "Data loading for training.")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = option(
        1,
        "Ranks holding full replicas of the parameters (DDP; HSDP when combined with sharding). 1 disables it.",
        check=positive,
    )
    data_parallel_shard_degree: int = option(
        -1,
        "Ranks the parameters, gradients and optimizer state are "
        "sharded over (FSDP). -1 takes all devices left over by the other "
        "degrees; 1 disables it.",
        check=minus_one_or_positive,
    )
    tensor_parallel_degree: int = option(
        1,
        "Ranks each layer's weights are split over (tensor parallelism with sequence parallelism). 1 disables it.",
        check=positive,
    )
    pipeline_parallel_degree: int = option(
        1, "Pipeline stages. Must be 1 in torchtpu.", check=only_one("pipeline parallelism")
    )
    context_parallel_degree: int = option(
        1,
        "Ranks a sequence is split over (context parallelism). Must be 1 in torchtpu.",
        check=only_one("context parallelism"),
    )
    expert_parallel_degree: int = option(
        1,
        "Ranks the routed experts of a Mixture-of-Experts model are split over (expert parallelism), "
        "borrowed as in torchtitan with expert_tensor_parallel_degree = 1: every tensor-parallel rank and "
        "part of the FSDP shards, so it is tensor_parallel_degree times a divisor of "
        "data_parallel_shard_degree, and each expert is sharded over the remaining "
        "data_parallel_shard_degree x tensor_parallel_degree / expert_parallel_degree ranks. 1 disables it.",
        check=positive,
    )
    expert_tensor_parallel_degree: int = option(
        1,
        "Ranks each routed expert is split over (tensor parallelism inside expert parallelism). Must be 1 in "
        "torchtpu: with tensor parallelism, expert parallelism takes the tensor-parallel ranks (torchtitan's etp = 1).",
        check=only_one("expert tensor parallelism"),
    )
    num_slices: int = option(
        1,
        "TPU slices the job spans (Multislice, connected over the data-center network, "
        "DCN). The mesh axis named by dcn_axis is split across slices.",
        check=positive,
    )
    dcn_axis: str = option(
        "dp_replicate",
        "Mesh axis that crosses slice boundaries when num_slices > 1; its degree must be a multiple of num_slices.",
        choices=("dp_replicate", "dp_shard"),
    )


@dataclass
class Checkpoint:
    enable: bool = option(False, "Save checkpoints, and resume from the newest one in the checkpoint folder.")
    folder: str = option("checkpoint", "Sub-folder of dump_folder holding the checkpoints (step-N folders).")
    interval: int = option(500, "Save every this many steps.", check=positive)
    initial_load_path: str | None = option(
        None,
        "Checkpoint to start from when the checkpoint folder is still "
        "empty (e.g. pre-trained weights); ignored once the run has "
        "checkpoints of its own.",
    )
    initial_load_model_only: bool = option(
        True, "Load only the model weights from initial_load_path; false also restores optimizer, scheduler and step."
    )
    initial_load_in_hf: bool = option(
        False,
        "initial_load_path is a Hugging Face model folder (config.json + "
        "safetensors) rather than a torchtpu checkpoint (needs "
        "initial_load_model_only).",
    )
    last_save_model_only: bool = option(
        True, "At the end of training save only the model weights; false saves the full resumable state."
    )
    last_save_in_hf: bool = option(
        False,
        "Also write the final weights as a Hugging Face folder, "
        "<folder>/hf_step_N (config.json + safetensors in export_dtype, the "
        "tokenizer's files and generation_config.json: transformers and vLLM load "
        "it as it is; needs last_save_model_only).",
    )
    export_dtype: str = option(
        "float32", "Dtype of the weights in the final model-only save.", choices=("float16", "bfloat16", "float32")
    )
    async_mode: str = option(
        "disabled",
        "disabled: training waits for each save; async: saves are written in "
        "the background; async_with_pinned_mem: the same, staging through host memory.",
        choices=("disabled", "async", "async_with_pinned_mem"),
    )
    keep_latest_k: int = option(10, "Keep only the newest k checkpoints; 0 keeps them all.", check=non_negative)
    load_step: int = option(
        -1,
        "Resume from this step's checkpoint (an error listing the steps there are if it "
        "does not exist); -1: the newest readable one (a save that never finished is ignored, a "
        "damaged checkpoint is renamed step_N.unreadable and the one before it is used).",
        check=minus_one_or_non_negative,
    )
    exclude_from_loading: list[str] = option(
        [],
        "Parts of the state not to restore when resuming (they are not read "
        "and start fresh): optimizer, lr_scheduler, dataloader.",
        check=state_parts,
    )
    enable_first_step_checkpoint: bool = option(False, "Also save right after step 1, to prove saving works early.")
    load_only: bool = option(False, "Load checkpoints but never save any.")


@dataclass
class ActivationCheckpoint:
    mode: str = option(
        "selective",
        "Recompute activations in the backward pass instead of storing them: none, "
        "full (every transformer block) or selective.",
        choices=("selective", "full", "none"),
    )
    selective_ac_option: str = option(
        "2",
        'For mode = "selective": "N" recomputes every N-th block; "op" recomputes every '
        "block but keeps the outputs of torchtitan's per-op policy (every other matmul, "
        "attention, reduce-scatters, max; a MoE router's gate always recomputed, torchtitan's "
        "default) instead of recomputing those ops, with the layer scan and without it.",
        check=selective_ac_option,
    )


@dataclass
class Compile:
    enable: bool = option(
        False,
        "Accepted for torchtitan configs; changes nothing. torchtpu-train always compiles "
        "the whole training step (model, loss, backward, clipping, optimizer) into one XLA "
        "program, and the validation forward into another, whether this is true or false.",
    )
    components: list[str] = option(
        ["model", "loss"],
        "Accepted for torchtitan configs; changes nothing: the model "
        "and the loss are always compiled, as parts of the one program per step. "
        "Allowed: model, loss.",
        check=known_components,
    )
    backend: str = option(
        "tpu",
        'The compiler: XLA, through torchtpu (torch.compile\'s "tpu" backend). Other '
        'backends (torchtitan\'s "inductor") do not target TPUs.',
        choices=("tpu",),
    )


@dataclass
class Comm:
    init_timeout_seconds: int = option(
        300,
        "Time allowed for start-up and the first step: the hosts joining the job "
        "(jax.distributed's initialization timeout), building the model and compiling "
        "the step. Past it the step watchdog dumps every stack and exits 42.",
        check=positive,
    )
    train_timeout_seconds: int = option(
        100,
        "Step watchdog after the first step: when no step finishes in this time "
        "(a host is stuck or gone), every Python stack is written to the log and the "
        "process exits with 42 (retriable).",
        check=positive,
    )


@dataclass
class Validation:
    enable: bool = option(
        False,
        "Evaluate the loss and perplexity on held-out data at step 1 and every freq steps, "
        "as a compiled forward-only program sharded like training; logged with the training "
        "metrics (console, metrics.jsonl, TensorBoard, W&B) as validation/loss and "
        "validation/perplexity.",
    )
    dataset: str = option(
        "c4_validation",
        'Validation dataset name: "bundled_validation" (the held-out documents '
        'of the bundled corpus, which dataset = "bundled" never trains on), "c4_validation", a '
        'Hugging Face "org/name", or any name with dataset_path.',
    )
    dataset_path: str | None = option(None, "Local folder or file to read the validation dataset from.")
    local_batch_size: int = option(8, "Validation sequences per data-parallel rank in each batch.", check=positive)
    seq_len: int = option(2048, "Tokens per validation sequence.", check=positive)
    freq: int = option(10, "Validate at step 1 and every this many training steps.", check=positive)
    steps: int = option(
        -1,
        "Validation batches per evaluation: -1 reads the whole validation set (with several "
        "hosts, as many batches as the host with the fewest has); N reads its first N batches, "
        "wrapping around a smaller set. Every evaluation reads the same batches.",
        check=minus_one_or_positive,
    )
    dataloader: DataLoader = section_field(DataLoader, "Data loading for validation.")


@dataclass
class Debug:
    seed: int | None = option(None, "Base random seed; unset picks a fresh one each run.", check=non_negative)
    deterministic: bool = option(
        False,
        "Make runs repeatable: seed 0 when seed is unset (instead of a fresh random "
        "seed each run), and PyTorch's deterministic algorithms "
        "(torch.use_deterministic_algorithms) for the ops that run on the host.",
    )
    verbose: bool = option(False, "Show full tracebacks on errors and debug-level logs (same as --debug).")
    inject_stall: str = option(
        "",
        'Fault injection, "HOST:STEP:SECONDS": process HOST sleeps SECONDS inside step STEP, as a stuck host '
        "does, to try the step watchdog ([comm] train_timeout_seconds) and a launcher's restarts. Empty: none.",
        check=stall_spec,
    )


@dataclass
class Experimental:
    custom_import: str = option(
        "",
        "A Python module imported before the rest of the configuration is checked: a dotted name importable "
        "from the working directory or PYTHONPATH (e.g. my_kernels), or a .py file. It can register a model "
        "family of its own (torchtpu.models.registry.register_family) that [model] name then selects, with "
        "its own ops (torchtpu.jax_op); every process of the job imports it. Empty: none.",
    )


@dataclass
class Tpu:
    topology: str = option(
        "",
        'Target TPU slice, e.g. "v5p:4x4x4" (64 chips). Set: the configuration is checked '
        "against that many chips and --dry-run compiles for it ahead of time. Empty: the "
        "devices attached to this host(s).",
        check=_topology,
    )
    dry_run: bool = option(
        False,
        "Build and compile the train step, report memory and FLOPs, and exit without training (same as --dry-run).",
    )
    xla_flags: str = option(
        "",
        "Extra XLA flags (appended to $XLA_FLAGS; flags already in the environment win), "
        'e.g. "--xla_force_host_platform_device_count=8" for 8 CPU devices.',
    )
    libtpu_init_args: str = option(
        "", "Extra libtpu flags (appended to $LIBTPU_INIT_ARGS; flags already in the environment win)."
    )
    scan_layers: bool = option(
        True,
        "Compile the model's identical transformer blocks once and run them under "
        "jax.lax.scan (compile time independent of depth). Applies with [activation_checkpoint] "
        'mode = "full" and with mode = "selective", selective_ac_option = "op" (the scan '
        'recomputes each block in backward, keeping the per-op policy\'s outputs with "op"); '
        "false: blocks unrolled.",
    )
    loss_chunk_size: int = option(
        2048,
        "Sequence positions per chunk of the loss: the output projection and "
        "cross entropy run one chunk at a time, each chunk's gradients computed right away "
        "(nothing recomputed in backward), so the float32 logits of the whole sequence are "
        "never held. 0 computes the loss on the whole "
        "logits. With tensor parallelism each chunk's logits stay split over the vocabulary "
        "(loss_parallel), as the whole logits do.",
        check=non_negative,
    )


@dataclass
class JobConfig:
    """The whole configuration. Sections are attributes: cfg.training.seq_len, cfg.parallelism.num_slices."""

    job: Job = section_field(Job, "The run itself")
    profiling: Profiling = section_field(Profiling, "Profiler traces")
    metrics: Metrics = section_field(Metrics, "Logging of training metrics")
    model: Model = section_field(Model, "Which model to train")
    optimizer: Optimizer = section_field(Optimizer, "Optimizer")
    lr_scheduler: LRScheduler = section_field(LRScheduler, "Learning-rate schedule (warm-up, then decay)")
    training: Training = section_field(Training, "Data, batch and step settings")
    parallelism: Parallelism = section_field(Parallelism, "How the model and batch are split over devices")
    checkpoint: Checkpoint = section_field(Checkpoint, "Saving and resuming")
    activation_checkpoint: ActivationCheckpoint = section_field(ActivationCheckpoint, "Activation recomputation")
    compile: Compile = section_field(Compile, "torch.compile")
    comm: Comm = section_field(Comm, "Collective communication")
    validation: Validation = section_field(Validation, "Held-out evaluation")
    debug: Debug = section_field(Debug, "Reproducibility and debugging")
    tpu: Tpu = section_field(Tpu, "TPU slice, XLA and libtpu settings")
    experimental: Experimental = section_field(Experimental, "Your own code: model families and ops")

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
