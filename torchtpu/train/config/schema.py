"""What the configuration schema (job_config.py) says about itself: each key's type, default, help
and allowed values (Spec), walked in schema order, and values written as TOML; plus the keys
torchtitan has that torchtpu deliberately lacks. Used by to_toml, --help and the config checks.
Standard library only, like job_config.py."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TORCHTITAN_ONLY_SECTIONS",
    "TORCHTITAN_ONLY_KEYS",
    "Spec",
    "section_specs",
    "walk",
    "section_name",
    "fmt",
    "emit_toml",
]


# Keys torchtitan 0.2.2 has that torchtpu deliberately lacks (CUDA-only, or features not built).
TORCHTITAN_ONLY_SECTIONS = ("quantize", "memory_estimation", "fault_tolerance")
TORCHTITAN_ONLY_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("job",): ("custom_config_module",),
    ("model",): ("tokenizer_path", "converters", "print_after_conversion"),
    ("optimizer",): ("implementation", "early_step_in_backward"),
    ("training",): ("enable_cpu_offload", "gc_debug"),
    ("training", "dataloader"): ("pin_memory",),
    ("validation", "dataloader"): ("pin_memory",),
    ("parallelism",): (
        "fsdp_reshard_after_forward",
        "disable_loss_parallel",
        "enable_async_tensor_parallel",
        "module_fqns_per_model_part",
        "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers",
        "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule",
        "pipeline_parallel_schedule_csv",
        "pipeline_parallel_microbatch_size",
        "pipeline_parallel_expert_parallel_overlap",
        "context_parallel_load_balancer",
        "context_parallel_rotate_method",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
        "expert_parallel_comm_backend",
    ),
    ("checkpoint",): ("enable_ft_dataloader_checkpoints", "initial_load_in_hf_quantized", "create_seed_checkpoint"),
    ("activation_checkpoint",): (
        "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "early_stop",
        "memory_budget",
        "visualize_memory_budget_pareto",
        "preserve_rng_state",
        "determinism_check",
        "debug",
    ),
    ("comm",): ("trace_buf_size", "save_traces_folder", "save_traces_file_prefix", "mode"),
    ("debug",): ("deterministic_warn_only", "moe_force_load_balance"),
    ("experimental",): ("custom_args_module",),
}


# ----------------------------------------------------------------------------------------------
# Schema introspection
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    name: str
    base: type  # bool, int, float, str, list (of str), or a section dataclass
    optional: bool
    default: Any
    help: str
    choices: tuple | None
    check: Callable[[Any], str | None] | None

    @property
    def is_section(self) -> bool:
        return dataclasses.is_dataclass(self.base)

    def describe(self, cli: bool = False) -> str:
        if self.choices:
            text = "one of " + ", ".join(fmt(c) for c in self.choices)
        else:
            text = {
                bool: "true or false",
                int: "an integer",
                float: "a number",
                str: "a string",
                list: "a comma-separated list of strings" if cli else 'a list of strings, e.g. ["a", "b"]',
            }[self.base]
        if self.optional:
            text += ' or "none" to unset' if cli else " (leave the key out to unset)"
        return text


_SPECS_CACHE: dict[type, dict[str, Spec]] = {}


def section_specs(cls: type) -> dict[str, Spec]:
    if cls in _SPECS_CACHE:
        return _SPECS_CACHE[cls]
    hints = typing.get_type_hints(cls)
    out: dict[str, Spec] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        optional = False
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            optional = len(args) < len(typing.get_args(hint))
            (hint,) = args
        base = list if typing.get_origin(hint) is list else hint
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        out[f.name] = Spec(
            f.name,
            base,
            optional,
            default,
            f.metadata.get("help", ""),
            f.metadata.get("choices"),
            f.metadata.get("check"),
        )
    _SPECS_CACHE[cls] = out
    return out


def walk(cls: type, path: tuple[str, ...] = ()):
    """Yield (path, spec) for every leaf key, in schema order (sections before their sub-sections)."""
    subsections = []
    for name, spec in section_specs(cls).items():
        if spec.is_section:
            subsections.append((path + (name,), spec.base))
        else:
            yield path + (name,), spec
    for sub_path, sub_cls in subsections:
        yield from walk(sub_cls, sub_path)


def section_name(path: tuple[str, ...]) -> str:
    return ".".join(path)


def fmt(value: Any) -> str:
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
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {fmt(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


def emit_toml(obj: Any, path: tuple[str, ...], lines: list[str]) -> None:
    specs = section_specs(type(obj))
    if path:
        lines.append("")
        lines.append(f"[{section_name(path)}]")
    for name, spec in specs.items():
        if spec.is_section:
            continue
        if path == ("job",) and name == "config_file":
            continue  # given with --config, not inside the file
        value = getattr(obj, name)
        if value is None:
            lines.append(f"# {name} is unset")
        else:
            lines.append(f"{name} = {fmt(value)}")
    for name, spec in specs.items():
        if spec.is_section:
            emit_toml(getattr(obj, name), path + (name,), lines)
