"""The model families torchtpu trains, by torchtitan model name: the role torchtitan's TrainSpec plays.

    family = get_family("qwen3")                    # UnknownModel (one line, the choices) if not registered
    args = family.model_args("debugmodel_moe")      # a fresh copy of torchtitan's flavor arguments
    with torch.device("meta"):
        model = family.build_model(args)            # torchtitan's model class, ready for the tpu device
    family.parallelize(model, mesh, ...)            # its plan: TP, activation checkpointing, FSDP, scan
    n_params, flops = family.flops_per_token(model, args, seq_len)

The trainer, the dry run and generation read this table and never name a family. It is data: each
piece of code a family runs is named by a "module:attribute" string, resolved when it is first
called. So this module imports the standard library only (an import-linter contract keeps it so),
and the configuration reads its model names and flavors from here (`model_flavors`) without
importing torch, torchtitan or any model code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["FAMILIES", "ModelFamily", "UnknownModel", "family_of", "get_family", "model_flavors", "register_family"]


class UnknownModel(ValueError):
    """A model name or flavor that no registered family has; str(error) is one line with the choices."""


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One torchtitan model family as torchtpu trains it.

    name: torchtitan's name ([model] name).
    flavors: the flavors torchtpu trains, by torchtitan's names ([model] flavor).
    args_table: "module:attribute" of torchtitan's flavor table (flavor -> model arguments).
    model_class: "module:attribute" of torchtitan's model class.
    preparer: "module:attribute" of `prepare(model) -> model`: the changes the model needs on the
        tpu device (same parameters, same numbers), applied to a freshly built model, on any device.
    parallelizer: "module:attribute" of `parallelize(model, mesh, *, sequence_parallel,
        loss_parallel, param_dtype, reduce_dtype, ac_mode, ac_every, scan_layers)`, which shards the
        model over the job's mesh.
    flops_counter: "module:attribute" of `(model, args, seq_len) -> (parameters, training FLOPs per
        token)`; a Mixture-of-Experts model counts only the experts a token runs through.
    hf_adapter: "module:attribute" of torchtitan's state-dict adapter class (Hugging Face names and layouts), or None.
    decode: "module" with the KV-cache decoding `torchtpu-generate` uses, or None.
    moe_load_balancing: torchtitan's optimizer for the family moves every MoE layer's expert_bias
        before each step (auxiliary-loss-free load balancing); the trainer does the same.
    runtime_args: (name, value) of the attributes torchtitan's `update_from_config` sets on the
        arguments that are no dataclass fields, which the model reads (DeepSeek-V3: moe_impl).
    """

    name: str
    flavors: tuple[str, ...]
    args_table: str
    model_class: str
    preparer: str
    parallelizer: str
    flops_counter: str
    hf_adapter: str | None = None
    decode: str | None = None
    moe_load_balancing: bool = False
    runtime_args: tuple[tuple[str, Any], ...] = ()

    def model_args(self, flavor: str):
        """A copy of torchtitan's arguments for `flavor` (UnknownModel if this family has no such flavor)."""
        if flavor not in self.flavors:
            raise UnknownModel(f"{self.name} has no flavor {flavor!r}; flavors: {', '.join(self.flavors)}")
        return dataclasses.replace(resolve(self.args_table)[flavor])

    def has_hf_weights(self) -> bool:
        """Hugging Face weights load and export: a state-dict adapter and a config.json writer
        (`torchtpu.models.<name>.hf`, found without importing it)."""
        import importlib.util

        if not self.hf_adapter:
            return False
        try:
            return importlib.util.find_spec(f"torchtpu.models.{self.name}.hf") is not None
        except ModuleNotFoundError:  # a family registered from outside torchtpu has no folder here
            return False

    def prepare(self, model):
        """`model` (freshly built, on any device) with the changes it needs on the tpu device."""
        return resolve(self.preparer)(model)

    def parallelize(self, model, mesh, **kw):
        """Shard `model` over the job's `mesh` with the family's plan (keywords: see `parallelizer`)."""
        return resolve(self.parallelizer)(model, mesh, **kw)

    def flops_per_token(self, model, args, seq_len: int) -> tuple[int, int]:
        """(parameters, training FLOPs per token) of `model` at `seq_len`."""
        return resolve(self.flops_counter)(model, args, seq_len)

    def model_cls(self):
        """torchtitan's model class (imports torchtitan)."""
        return resolve(self.model_class)

    def torchtitan_model(self, args):
        """torchtitan's model for `args` as torchtitan builds it, on the current default device (the
        attributes torchtitan's `update_from_config` adds to the arguments filled in where missing)."""
        for name, value in self.runtime_args:
            if not hasattr(args, name):
                setattr(args, name, value)
        return self.model_cls()(args)

    def build_model(self, args):
        """torchtitan's model for `args` on the current default device, prepared for tpu."""
        return self.prepare(self.torchtitan_model(args))


def resolve(path: str):
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


# ----------------------------------------------------------------------------------- families

FAMILIES: dict[str, ModelFamily] = {
    f.name: f
    for f in (
        ModelFamily(
            name="llama3",
            flavors=("debugmodel", "8B", "70B", "405B"),
            args_table="torchtitan.models.llama3:llama3_args",
            model_class="torchtitan.models.llama3:Transformer",
            preparer="torchtpu.models.llama3.rope:use_real_rope",
            parallelizer="torchtpu.models.llama3.parallelize:parallelize_llama",
            flops_counter="torchtpu.models.flops:model_flops_per_token",
            hf_adapter="torchtitan.models.llama3.model.state_dict_adapter:Llama3StateDictAdapter",
            decode="torchtpu.models.llama3.decode",
        ),
        ModelFamily(
            name="qwen3",
            flavors=(
                "debugmodel",
                "0.6B",
                "1.7B",
                "4B",
                "8B",
                "14B",
                "32B",
                "debugmodel_moe",
                "30B-A3B",
                "235B-A22B",
            ),
            args_table="torchtitan.models.qwen3:qwen3_args",
            model_class="torchtitan.models.qwen3:Qwen3Model",
            preparer="torchtpu.models.qwen3:prepare_qwen3",
            parallelizer="torchtpu.models.qwen3:parallelize_qwen3",
            flops_counter="torchtpu.models.flops:torchtitan_flops_per_token",
            hf_adapter="torchtitan.models.qwen3.model.state_dict_adapter:Qwen3StateDictAdapter",
        ),
        ModelFamily(
            name="deepseek_v3",
            flavors=("debugmodel", "debugmodel_flex_attn", "16B", "236B", "671B"),
            args_table="torchtitan.models.deepseek_v3:deepseekv3_args",
            model_class="torchtitan.models.deepseek_v3:DeepSeekV3Model",
            preparer="torchtpu.models.deepseek_v3:prepare_deepseek_v3",
            parallelizer="torchtpu.models.deepseek_v3:parallelize_deepseek_v3",
            flops_counter="torchtpu.models.flops:torchtitan_flops_per_token",
            hf_adapter="torchtitan.models.deepseek_v3.model.state_dict_adapter:DeepSeekV3StateDictAdapter",
            moe_load_balancing=True,
            runtime_args=(("moe_impl", "standard"),),  # torchtitan's MoE, not DeepEP
        ),
        ModelFamily(
            name="llama4",
            flavors=("debugmodel", "17bx16e", "17bx128e", "debugmodel_irope", "17bx16e_irope", "17bx128e_irope"),
            args_table="torchtitan.models.llama4:llama4_args",
            model_class="torchtitan.models.llama4:Transformer",
            preparer="torchtpu.models.llama4:prepare_llama4",
            parallelizer="torchtpu.models.llama4:parallelize_llama4",
            flops_counter="torchtpu.models.flops:torchtitan_flops_per_token",
            hf_adapter="torchtitan.models.llama4.model.state_dict_adapter:Llama4StateDictAdapter",
            moe_load_balancing=True,
        ),
    )
}


def get_family(name: str) -> ModelFamily:
    """The registered family `name` (UnknownModel, naming the choices, if none)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownModel(f"no model family {name!r}; families: {', '.join(FAMILIES)}") from None


def register_family(family: ModelFamily) -> ModelFamily:
    """Add a model family the trainer, the dry run and generation then build by its name, as they
    build the families above. A job's `[experimental] custom_import` module calls this when the
    configuration is read, so `[model] name` and `flavor` may name it:

        register_family(dataclasses.replace(get_family("llama3"), name="llama3_my_norm",
                                            preparer="my_kernels:use_my_norm"))

    Registering the same definition again (a module imported twice) is allowed; another family
    under a registered name is a ValueError."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_family takes a ModelFamily, got {type(family).__name__}")
    for field in ("args_table", "model_class", "preparer", "parallelizer", "flops_counter"):
        value = getattr(family, field)
        if not isinstance(value, str) or ":" not in value:
            raise ValueError(
                f"model family {family.name!r}: {field} must be a 'module:attribute' string, got {value!r}"
            )
    if not family.flavors:
        raise ValueError(f"model family {family.name!r} has no flavors")
    known = FAMILIES.get(family.name)
    if known is not None and known != family:
        raise ValueError(
            f"a model family named {family.name!r} is already registered; register yours under another name"
        )
    FAMILIES[family.name] = family
    return family


def family_of(model) -> ModelFamily:
    """The registered family whose torchtitan model class `model` is an instance of."""
    for family in FAMILIES.values():
        if isinstance(model, family.model_cls()):
            return family
    raise UnknownModel(f"{type(model).__name__} is no registered family's model; families: {', '.join(FAMILIES)}")


def model_flavors() -> dict[str, tuple[str, ...]]:
    """Each family's flavors, by family name."""
    return {name: f.flavors for name, f in FAMILIES.items()}
