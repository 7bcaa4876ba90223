"""Reading the trainer's configuration: defaults, then a TOML file, then the command line; --help;
and the checks that involve more than one key.

Precedence: command line > TOML file > defaults.

    cfg = load_config(["--config", "train_configs/debug_model.toml", "--training.steps", "20"])
    dims = resolve_dims(cfg, num_devices=8)  # parallel_dims.resolve_dims: degrees, accumulation steps
    print(cfg.to_toml())

Every problem raises ConfigError with a one-line message naming the file (or "command line"),
the section, the key and the value, and saying what is allowed.

The schema itself is job_config.py. This module only imports the standard library, so `--help`
and config errors are fast.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from typing import Any

from ...models.registry import model_flavors
from .custom_import import import_custom
from .job_config import ConfigError, JobConfig
from .schema import TORCHTITAN_ONLY_KEYS, TORCHTITAN_ONLY_SECTIONS, Spec, fmt, section_name, section_specs, walk

__all__ = [
    "COMMAND_LINE",
    "HelpRequested",
    "load_config",
    "config_from_dict",
    "help_text",
    "describe_keys",
    "check_fields",
    "check_relations",
    "check_paths",
    "save_resolved_config",
]


COMMAND_LINE = "command line"


class HelpRequested(Exception):
    """Raised by load_config for -h/--help; .text is the help to print."""

    def __init__(self, text: str):
        super().__init__("help requested")
        self.text = text


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------------------------
# Reading values
# ----------------------------------------------------------------------------------------------

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")


class _Bad(Exception):
    """A value problem; the caller adds where it happened."""


def _coerce(spec: Spec, value: Any, cli: bool) -> Any:
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


def _check_value(spec: Spec, value: Any) -> None:
    if value is None:
        if not spec.optional:
            raise _Bad(f"expected {spec.describe()}")
        return
    if spec.choices and value not in spec.choices:
        raise _Bad("allowed: " + ", ".join(fmt(c) for c in spec.choices))
    if spec.check is not None:
        problem = spec.check(value)
        if problem:
            raise _Bad(problem)


def _value_error(source: str, path: tuple[str, ...], value: Any, problem: str, raw: bool = False) -> ConfigError:
    shown = json.dumps(value) if raw else fmt(value)
    return ConfigError(f"{source}: [{section_name(path[:-1])}] {path[-1]} = {_short(shown)}: {problem}")


def _unknown_key_message(source: str, path: tuple[str, ...], value_text: str, cli: bool) -> str:
    """Message for a key that does not exist, with the closest valid key suggested."""
    section, key = path[:-1], path[-1]
    sec_text = section_name(section)
    prefix = f"{source}: [{sec_text}] {key}{value_text}"
    if key in TORCHTITAN_ONLY_KEYS.get(section, ()):
        hint = " (use hf_assets_path)" if key == "tokenizer_path" else ""
        return f"{prefix}: a torchtitan key that torchtpu does not support{hint}; remove it"
    cls = _section_class(section)
    valid = [name for name, s in section_specs(cls).items() if not s.is_section]
    # The same key in another section is the likeliest mistake.
    elsewhere = [p for p, _ in walk(JobConfig) if p[-1] == key and p[:-1] != section]
    if elsewhere:
        where = elsewhere[0]
        spelled = f"--{'.'.join(where)}" if cli else f"[{section_name(where[:-1])}] {key}"
        return f"{prefix}: unknown key in [{sec_text}]; did you mean {spelled}?"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        spelled = f"--{section_name(section)}.{close[0]}" if cli else repr(close[0])
        suggestion = f"did you mean {spelled}? "
    else:
        suggestion = ""
    return f"{prefix}: unknown key; {suggestion}valid keys in [{sec_text}]: {', '.join(valid)}"


def _unknown_section_message(source: str, path: tuple[str, ...], extra: str = "") -> str:
    name = section_name(path)
    if path[0] in TORCHTITAN_ONLY_SECTIONS:
        return f"{source}: [{name}]{extra}: a torchtitan section that torchtpu does not support; remove it"
    if len(path) > 1:
        parent = _section_class(path[:-1])
        valid = [section_name(path[:-1] + (n,)) for n, s in section_specs(parent).items() if s.is_section]
    else:
        valid = list(section_specs(JobConfig))
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    suggestion = f"did you mean [{close[0]}]? " if close else ""
    allowed = ", ".join(f"[{v}]" for v in valid) if valid else "none"
    return f"{source}: [{name}]{extra}: unknown section; {suggestion}valid sections here: {allowed}"


def _section_class(path: tuple[str, ...]) -> type:
    cls: type = JobConfig
    for name in path:
        cls = section_specs(cls)[name].base
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
    specs = section_specs(cls)
    for key, value in table.items():
        here = path + (key,)
        spec = specs.get(key)
        if spec is None:
            if not path:
                if isinstance(value, dict):
                    raise ConfigError(_unknown_section_message(source, here))
                owners = [p for p, _ in walk(JobConfig) if p[-1] == key]
                hint = (
                    f"; did you mean [{section_name(owners[0][:-1])}] {key}?"
                    if owners
                    else "; every key belongs under a [section]"
                )
                raise ConfigError(f"{source}: {key} = {_short(fmt(value))}: key outside any section{hint}")
            if isinstance(value, dict) and key not in TORCHTITAN_ONLY_KEYS.get(path, ()):
                raise ConfigError(_unknown_section_message(source, here))
            raise ConfigError(_unknown_key_message(source, here, f" = {_short(fmt(value))}", cli=False))
        if spec.is_section:
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{source}: [{section_name(path)}] {key} = {_short(fmt(value))}: "
                    f"{key} is a section; write it as [{section_name(here)}]"
                )
            _apply_table(cfg, value, here, source)
            continue
        if path == ("job",) and key == "config_file":
            raise ConfigError(
                f"{source}: [job] config_file = {_short(fmt(value))}: not allowed inside a config "
                "file; give the file with --config"
            )
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
                    spec = section_specs(_section_class(path))[k]
                except (KeyError, AttributeError, TypeError):
                    out[k] = v  # let _apply_table report the unknown key
                    continue
                if not spec.optional:
                    raise ConfigError(f"{source}: [{section_name(path)}] {k} = (unset): expected {spec.describe()}")
            else:
                out[k] = v
        return out

    data = strip_none(data, ())
    import_custom(data, source)
    job = data.get("job")
    if isinstance(job, dict) and "config_file" in job:
        job = dict(job)
        cfg.job.config_file = job.pop("config_file")
        data = dict(data, job=job)
    _apply_table(cfg, data, (), source)
    check_relations(cfg)
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
        owners = [p for p, _ in walk(JobConfig) if p[-1] == name]
        hint = f"; did you mean --{'.'.join(owners[0])}?" if owners else ""
        raise ConfigError(
            f"{COMMAND_LINE}: {option}{shown}: unknown option; options are --config FILE, "
            f"--dry-run, --topology NAME, --debug, --help and --SECTION.KEY VALUE{hint}"
        )
    parts = tuple(p.replace("-", "_") for p in body.split("."))
    # Find the section prefix.
    cls: type = JobConfig
    for i, name in enumerate(parts[:-1]):
        spec = section_specs(cls).get(name)
        if spec is None or not spec.is_section:
            raise ConfigError(_unknown_section_message(COMMAND_LINE, parts[: i + 1], extra=f" (from {option}{shown})"))
        cls = spec.base
    key = parts[-1]
    specs = section_specs(cls)
    if key in specs and not specs[key].is_section:
        return parts, None
    if key.startswith("no_") and key[3:] in specs and specs[key[3:]].base is bool:
        return parts[:-1] + (key[3:],), False
    if key in specs:  # a section given as a key
        raise ConfigError(
            f"{COMMAND_LINE}: {option}: [{section_name(parts)}] is a section; "
            f"set one of its keys, e.g. --{'.'.join(parts)}.{next(iter(section_specs(specs[key].base)))}"
        )
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
            raise ConfigError(
                f"{COMMAND_LINE}: {token!r}: unexpected argument; options look like --SECTION.KEY VALUE (see --help)"
            )
        option, eq, inline = token.partition("=")
        if eq:
            peek: str | None = inline
        elif i < len(argv) and not argv[i].startswith("--"):
            peek = argv[i]
        else:
            peek = None
        path, negated = _resolve_cli_key(option, peek)
        spec = section_specs(_section_class(path[:-1]))[path[-1]]
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
                    raise ConfigError(
                        f"{COMMAND_LINE}: [{section_name(path[:-1])}] {path[-1]} = {raw}: "
                        f"{option} takes no value; use --{'.'.join(path)} {raw}"
                    )
                raw = False
        else:
            if eq:
                raw = inline
            elif i < len(argv):
                raw = argv[i]
                i += 1
            else:
                raise ConfigError(
                    f"{COMMAND_LINE}: [{section_name(path[:-1])}] {path[-1]}: {option} needs a "
                    f"value ({spec.describe(cli=True)})"
                )
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
    table = _read_toml(config_file) if config_file is not None else {}
    import_custom(table, config_file, overrides)  # the user's model families, before [model] is checked
    if config_file is not None:
        _apply_table(cfg, table, (), config_file)
        cfg.job.config_file = config_file
    for path, raw, _option in overrides:
        spec = section_specs(_section_class(path[:-1]))[path[-1]]
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
    check_relations(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------
# Checks that involve more than one key, and validation against the devices
# ----------------------------------------------------------------------------------------------


def describe_keys(cfg: JobConfig, section: tuple[str, ...], keys: list[str]) -> str:
    """'FILE: [section] k1 = v1, k2 = v2 (default)' naming where each value came from."""
    file = cfg.job.config_file
    parts = []
    for key in keys:
        path = section + (key,)
        text = f"{key} = {_short(fmt(_get(cfg, path)), 80)}"
        origin = cfg._origins.get(path)
        if origin is None:
            text += " (default)"
        elif origin != file:
            text += f" ({origin})"
        parts.append(text)
    return f"{file or COMMAND_LINE}: [{section_name(section)}] " + ", ".join(parts)


def check_fields(cfg: JobConfig) -> None:
    """Types and allowed values of every key (for configs built or edited in code)."""
    for path, spec in walk(JobConfig):
        value = _get(cfg, path)
        try:
            if value is not None:
                _coerce(spec, value, cli=False)  # type check only
            _check_value(spec, value)
        except _Bad as e:
            raise ConfigError(f"{describe_keys(cfg, path[:-1], [path[-1]])}: {e}") from None


def check_relations(cfg: JobConfig) -> None:
    flavors = model_flavors().get(cfg.model.name, ())
    if cfg.model.flavor not in flavors:
        raise ConfigError(
            f"{describe_keys(cfg, ('model',), ['name', 'flavor'])}: unknown flavor; allowed for "
            f"{cfg.model.name}: {', '.join(flavors)}"
        )
    ck = cfg.checkpoint
    if ck.initial_load_in_hf and not ck.initial_load_model_only:
        raise ConfigError(
            f"{describe_keys(cfg, ('checkpoint',), ['initial_load_in_hf', 'initial_load_model_only'])}: "
            "Hugging Face weights hold only the model; set initial_load_model_only = true"
        )
    if ck.last_save_in_hf and not ck.last_save_model_only:
        raise ConfigError(
            f"{describe_keys(cfg, ('checkpoint',), ['last_save_in_hf', 'last_save_model_only'])}: "
            "Hugging Face safetensors hold only the model; set last_save_model_only = true"
        )
    if ck.last_save_in_hf and (not ck.enable or ck.load_only):
        raise ConfigError(
            f"{describe_keys(cfg, ('checkpoint',), ['last_save_in_hf', 'enable', 'load_only'])}: "
            "the Hugging Face folder is written with the final checkpoint; set enable = true and "
            "load_only = false"
        )
    for section in (("training", "dataloader"), ("validation", "dataloader")):
        dl = _get(cfg, section)
        if dl.num_workers == 0:
            for key, bad in (
                ("persistent_workers", dl.persistent_workers),
                ("prefetch_factor", dl.prefetch_factor is not None),
            ):
                if bad:
                    raise ConfigError(
                        f"{describe_keys(cfg, section, ['num_workers', key])}: {key} needs num_workers > 0"
                    )


def _is_remote(path: str) -> bool:
    return "://" in path


def _check_path(cfg: JobConfig, section: str, key: str, what: str) -> None:
    value = getattr(getattr(cfg, section), key)
    if not value or _is_remote(value):
        return
    if not os.path.exists(os.path.expanduser(value)):
        raise ConfigError(
            f"{describe_keys(cfg, (section,), [key])}: {what} not found (relative paths are from "
            f"{os.getcwd()}); give an existing path"
            + (' or "" for the bundled tokenizer' if key == "hf_assets_path" else " or leave the key out")
        )


def check_paths(cfg: JobConfig) -> None:
    """The paths that are set (tokenizer folder, dataset paths, initial checkpoint) must exist."""
    _check_path(cfg, "model", "hf_assets_path", "tokenizer / Hugging Face assets folder")
    _check_path(cfg, "training", "dataset_path", "dataset path")
    if cfg.validation.enable:
        _check_path(cfg, "validation", "dataset_path", "validation dataset path")
    _check_path(cfg, "checkpoint", "initial_load_path", "initial checkpoint")


# ----------------------------------------------------------------------------------------------
# --help
# ----------------------------------------------------------------------------------------------


def _wrap(text: str, indent: str, width: int = 100) -> list[str]:
    import textwrap

    return textwrap.wrap(
        text,
        width=width,
        initial_indent=indent,
        subsequent_indent=indent,
        break_on_hyphens=False,
        break_long_words=False,
    ) or [indent]


def help_text(prog: str = "torchtpu-train") -> str:
    lines = [
        f"usage: {prog} --config FILE [--SECTION.KEY VALUE ...] [--dry-run] [--topology NAME] [--debug]",
        "",
        *_wrap(
            "Train a torchtitan Llama 3 model on TPU chips (or on XLA CPU devices). Every value starts at "
            "the default listed below, is replaced by the TOML file given with --config, then by "
            "--SECTION.KEY options (later options win). In the TOML file a key is written under its "
            "[SECTION] header.",
            "",
        ),
        "",
        *_wrap(
            "Booleans: --SECTION.KEY sets true; --SECTION.no-KEY sets false; --SECTION.KEY true|false also "
            "works. Lists: comma-separated (--compile.components model,loss). Optional keys: the value "
            "'none' unsets them. --SECTION.KEY=VALUE and hyphens for underscores are accepted.",
            "",
        ),
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
    for path, spec in walk(JobConfig):
        section = path[:-1]
        if section != current:
            current = section
            parent = _section_class(section[:-1])
            title = section_specs(parent)[section[-1]].help
            lines += ["", f"[{section_name(section)}]  {title}"]
        name = "--" + ".".join(path)
        if spec.base is bool:
            usage = f"{name}, --{section_name(section)}.no-{path[-1]}"
        else:
            metavar = {int: "INT", float: "FLOAT", str: "STR", list: "A,B,..."}[spec.base]
            usage = f"{name} {'VALUE' if spec.choices else metavar}"
        default = "unset" if spec.default is None else fmt(spec.default)
        lines.append(f"  {usage}  (default: {default})")
        text = spec.help
        if spec.choices:
            text += " Allowed: " + ", ".join(fmt(c) for c in spec.choices) + "."
        lines += _wrap(text, "      ")
    return "\n".join(lines) + "\n"


def save_resolved_config(cfg: JobConfig) -> str | None:
    """job.save_config_file: write the resolved configuration into dump_folder; returns its path."""
    if not cfg.job.save_config_file:
        return None
    os.makedirs(cfg.job.dump_folder, exist_ok=True)
    path = os.path.join(cfg.job.dump_folder, cfg.job.save_config_file)
    with open(path, "w", encoding="utf-8") as f:
        f.write(cfg.to_toml())
    return path
