"""From the configuration to the model the trainer builds: the arguments of torchtitan's model
[model] name (a family of torchtpu.models.registry) in [model] flavor, the model on the meta device
in training.dtype, and the settings handed to the family's parallelize plan (mixed-precision
dtypes, activation recomputation).
"""

from __future__ import annotations

import dataclasses
import json

from .config.job_config import ConfigError, JobConfig

__all__ = [
    "build_model_args",
    "build_meta_model",
    "mixed_precision_dtypes",
    "ac_settings",
    "torch_dtype",
]


def build_model_args(cfg: JobConfig, tokenizer_vocab_size: int | None, overrides: dict | None = None):
    """The flavor's torchtitan model arguments (with [model] attn_type applied) with max_seq_len = training.seq_len (or validation.seq_len if
    validation is on and its sequences are longer), then [model] flavor_overrides and n_layers, then
    `overrides` (fields replaced, as flavor_overrides replaces them; tests build narrower copies).

    The model keeps the flavor's vocabulary size; a tokenizer with more ids than that cannot
    be trained on (its ids would index past the embedding table) and is refused."""
    from torchtpu.models.registry import UnknownModel, get_family

    flavor = cfg.model.flavor
    try:
        family = get_family(cfg.model.name)
        args = family.model_args(flavor)
    except UnknownModel as e:
        raise ConfigError(f"[model] name = {cfg.model.name!r}, flavor = {flavor!r}: {e}") from None
    sdpa = ", ".join(f for f in family.flavors if family.model_args(f).attn_type == "sdpa")
    if getattr(args, "every_n_layers_nope", None) is not None:
        raise ConfigError(
            f"[model] flavor = {flavor!r}: iRoPE (NoPE layers and chunked attention through flex_attention's "
            f"fixed-block masks) is not supported on tpu; use a flavor without it ({sdpa})"
        )
    if args.attn_type != "sdpa":
        if cfg.model.attn_type != "sdpa":
            raise ConfigError(
                f"[model] flavor = {flavor!r}: attention type {args.attn_type!r} (flex_attention, "
                f"{getattr(args, 'attn_mask_type', 'causal')} masks) is not supported on tpu; use a flavor with "
                f"SDPA attention ({sdpa}) or set [model] attn_type = 'sdpa' (causal attention over whole sequences)"
            )
        args.attn_type = "sdpa"
        if hasattr(args, "attn_mask_type"):
            args.attn_mask_type = "causal"
    if tokenizer_vocab_size is not None and tokenizer_vocab_size > args.vocab_size:
        where = cfg.origin("model", "hf_assets_path") or "default"
        raise ConfigError(
            f"{where}: [model] hf_assets_path = {cfg.model.hf_assets_path!r}: the tokenizer has "
            f"{tokenizer_vocab_size} ids but the {cfg.model.name} {flavor} model's vocabulary has "
            f"{args.vocab_size}; use that model's tokenizer (or a flavor with a vocabulary of at least "
            f"{tokenizer_vocab_size})"
        )
    # The RoPE table (a non-persistent buffer, so checkpoints do not depend on it) must cover the
    # validation sequences too.
    args.max_seq_len = max(cfg.training.seq_len, cfg.validation.seq_len if cfg.validation.enable else 0)
    return _with_overrides(cfg, args, overrides)


def _with_overrides(cfg: JobConfig, args, overrides: dict | None):
    """`args` with [model] flavor_overrides, [model] n_layers, then `overrides` replacing its fields (a
    dict for a dataclass field, such as moe_args, replaces some of that dataclass's fields)."""
    fields = {
        **(json.loads(cfg.model.flavor_overrides) if cfg.model.flavor_overrides else {}),
        **({} if cfg.model.n_layers is None else {"n_layers": cfg.model.n_layers}),
        **(overrides or {}),
    }
    if not fields:
        return args
    names = {f.name for f in dataclasses.fields(args)}
    where = cfg.origin("model", "flavor_overrides") or "default"
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ConfigError(
            f"{where}: [model] flavor_overrides = {cfg.model.flavor_overrides!r}: the {cfg.model.name} "
            f"{cfg.model.flavor} model's arguments ({type(args).__name__}) have no field {unknown[0]!r}; "
            f"fields: {', '.join(sorted(n for n in names if not n.startswith('_')))}"
        )
    try:
        return dataclasses.replace(
            args,
            **{k: dataclasses.replace(getattr(args, k), **v) if isinstance(v, dict) else v for k, v in fields.items()},
        )
    except TypeError as e:  # a nested field the nested arguments lack
        raise ConfigError(f"{where}: [model] flavor_overrides = {cfg.model.flavor_overrides!r}: {e}") from None


def build_meta_model(cfg: JobConfig, model_args):
    """torchtitan's model of [model] name on the meta device, prepared for tpu by its family (Llama 3:
    real rotary arithmetic, no complex64 table on the chip: docs/DESIGN_NOTES.md), its parameters
    in training.dtype."""
    import torch

    from torchtpu.models.registry import get_family

    with torch.device("meta"):
        model = get_family(cfg.model.name).build_model(model_args)
    param_dtype = torch_dtype(cfg.training.dtype)
    if param_dtype != torch.float32:
        # parameters only: the RoPE table (freqs_cis) keeps its float32 values
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None and p.is_floating_point():
                    mod._parameters[name] = torch.nn.Parameter(p.to(param_dtype), requires_grad=p.requires_grad)
    return model


def mixed_precision_dtypes(cfg: JobConfig):
    """(param_dtype, reduce_dtype) for the parallelize plan: training.mixed_precision_param/_reduce, or None
    where they equal the parameters' own dtype (training.dtype), i.e. where there is nothing to cast."""
    own = torch_dtype(cfg.training.dtype)
    param, reduce = (torch_dtype(cfg.training.mixed_precision_param), torch_dtype(cfg.training.mixed_precision_reduce))
    return (None if param == own else param), (None if reduce == own else reduce)


_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


def torch_dtype(name: str):
    import torch

    return getattr(torch, _DTYPES[name])


def ac_settings(cfg: JobConfig) -> tuple[str, int]:
    """(mode, every) for apply_activation_checkpointing and the families' parallelize plans:
    "none", "full", "selective" with every N-th block ([activation_checkpoint] selective_ac_option
    = "N"), or "op" (selective_ac_option = "op": every block, keeping the outputs of torchtitan's
    per-op policy, activation_checkpoint.OpPolicy)."""
    ac = cfg.activation_checkpoint
    if ac.mode != "selective":
        return ac.mode, 1
    if ac.selective_ac_option == "op":
        return "op", 1
    return "selective", int(ac.selective_ac_option)
