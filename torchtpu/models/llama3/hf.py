"""Llama 3 weights in Hugging Face's layout, through torchtitan's own state-dict adapter.

torchtitan's `Llama3StateDictAdapter` owns the two facts that matter: the names
("layers.0.attention.wq.weight" <-> "model.layers.0.self_attn.q_proj.weight") and the row
permutation of wq/wk that turns torchtitan's interleaved RoPE pairs into Hugging Face's
rotate-half layout. This module only asks the adapter; it derives neither.

    names = HFNames(model_args)
    names.to_hf("layers.0.attention.wq.weight")    # "model.layers.0.self_attn.q_proj.weight"
    names.from_hf("model.norm.weight")               # "norm.weight"
    names.rows_from_hf("model.layers.0.self_attn.q_proj.weight", 256)  # torchtitan row i = HF row perm[i]
    hf_tensor = names.tensor_to_hf("layers.0.attention.wk.weight", tensor)
    hf_config(model_args, intermediate_size, "float32")          # config.json for LlamaForCausalLM
    check_hf_config(config, model_args)                          # a mismatch that changes the maths -> ValueError
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

__all__ = ["HFNames", "hf_config", "check_hf_config", "head_dim"]


def head_dim(model_args) -> int:
    return model_args.dim // model_args.n_heads


class HFNames:
    """Name and layout mapping between torchtitan's Llama 3 state dict and Hugging Face's."""

    def __init__(self, model_args):
        from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

        self.model_args = model_args
        self.adapter = Llama3StateDictAdapter(model_args, None)
        # The adapter permutes whole heads independently (it views the rows as
        # (heads, 2, head_dim // 2) or back), so the permutation of one head, asked of an
        # adapter for a one-head model, repeated per head, is the whole permutation; asking it
        # about the full matrix would build an index as large as the weight (16384^2 for 405B).
        hd = head_dim(model_args)
        one_head = dataclasses.replace(model_args, dim=hd, n_heads=1, n_kv_heads=1)
        self._one_head = Llama3StateDictAdapter(one_head, None)
        self._head_perm: dict[str, np.ndarray] = {}

    # -- names (the adapter maps values; meta tensors give its names without touching data)

    def _probe(self):
        # Names do not depend on the sizes; a one-head-sized meta tensor passes the adapter's q/k
        # permutation whatever the real (possibly mismatched) shape is, and touches no data.
        hd = self._one_head.model_args.dim
        return torch.empty((hd, hd), device="meta")

    def to_hf(self, name: str) -> str:
        out = self._one_head.to_hf({name: self._probe()})
        if len(out) != 1:
            raise KeyError(f"torchtitan's Llama 3 adapter has no Hugging Face name for {name!r}")
        return next(iter(out))

    def from_hf(self, hf_name: str) -> str | None:
        """The torchtitan name of a Hugging Face tensor; None for tensors the model does not keep
        (rotary inv_freq); KeyError for names the adapter does not know."""
        out = self._one_head.from_hf({hf_name: self._probe()})
        return next(iter(out)) if out else None

    # -- values

    def tensor_to_hf(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """(Hugging Face name, value in Hugging Face's layout) of one full torchtitan tensor."""
        ((hf_name, value),) = self.adapter.to_hf({name: tensor}).items()
        return hf_name, value

    def tensor_from_hf(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        out = self.adapter.from_hf({hf_name: tensor})
        return next(iter(out.items())) if out else None

    def rows_from_hf(self, hf_name: str, rows: int) -> np.ndarray | None:
        """For a tensor whose rows the adapter permutes (q_proj, k_proj): `perm` with torchtitan
        row i = Hugging Face row perm[i], each head's rows staying inside that head. None when
        the tensor is not permuted."""
        hd = head_dim(self.model_args)
        generic = "model.layers.0." + hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
        if generic not in self._head_perm:
            index = torch.arange(hd, dtype=torch.int64)[:, None].expand(hd, hd).contiguous()
            got = self._one_head.from_hf({generic: index})
            perm = next(iter(got.values()))[:, 0].numpy() if got else np.arange(hd)
            self._head_perm[generic] = perm
        perm = self._head_perm[generic]
        if np.array_equal(perm, np.arange(hd)):
            return None
        if rows % hd:
            raise ValueError(f"{hf_name}: {rows} rows is not a whole number of {hd}-row heads")
        return (np.arange(rows // hd)[:, None] * hd + perm[None, :]).reshape(-1)


def _ffn_hidden(model_args) -> int:
    """The feed-forward width torchtitan's FeedForward computes for these arguments."""
    hidden = int(2 * 4 * model_args.dim / 3)
    if model_args.ffn_dim_multiplier is not None:
        hidden = int(model_args.ffn_dim_multiplier * hidden)
    m = model_args.multiple_of
    return m * ((hidden + m - 1) // m)


def hf_config(model_args, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for `LlamaForCausalLM` computing what torchtitan's `Transformer` computes.

    torchtitan always applies Llama 3.1's RoPE frequency scaling (its RoPEScalingArgs), so the
    config always carries the matching "llama3" rope_scaling."""
    a = model_args
    rs = a.rope_scaling_args
    rope_scaling = {
        "rope_type": "llama3",
        "factor": float(rs.scaling_factor),
        "low_freq_factor": float(rs.low_freq_factor),
        "high_freq_factor": float(rs.high_freq_factor),
        "original_max_position_embeddings": int(rs.original_max_position_embeddings),
    }
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": a.dim,
        "intermediate_size": _ffn_hidden(a),
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads or a.n_heads,
        "head_dim": head_dim(a),
        "vocab_size": a.vocab_size,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": float(a.rope_theta),
        "rope_scaling": rope_scaling,
        # transformers 5 reads RoPE settings from rope_parameters; older versions from the two above
        "rope_parameters": {**rope_scaling, "rope_theta": float(a.rope_theta)},
        "max_position_embeddings": max(int(a.max_seq_len), int(rs.original_max_position_embeddings)),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if bos_id is not None:
        cfg["bos_token_id"] = int(bos_id)
    if eos_id is not None:
        cfg["eos_token_id"] = int(eos_id)
    return cfg


def check_hf_config(config: dict, model_args) -> None:
    """Raise ValueError (one line) when a Hugging Face config.json describes a model that computes
    differently from `model_args` in a way the tensor shapes do not show (RoPE, norm epsilon,
    activation, tied embeddings). Shape differences are reported per tensor by the loader."""
    a = model_args
    problems = []
    if config.get("model_type", "llama") != "llama":
        problems.append(f"model_type = {config.get('model_type')!r} (torchtpu loads Llama weights)")
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", rope.get("rope_theta"))
    if theta is not None and not math.isclose(float(theta), float(a.rope_theta)):
        problems.append(f"rope_theta = {theta} but the model's is {a.rope_theta}")
    eps = config.get("rms_norm_eps")
    if eps is not None and not math.isclose(float(eps), float(a.norm_eps)):
        problems.append(f"rms_norm_eps = {eps} but the model's is {a.norm_eps}")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {config['hidden_act']!r} but the model uses silu")
    if config.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings = true but the model has a separate output projection")
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    rs = a.rope_scaling_args
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        want = {
            "factor": rs.scaling_factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
        if kind != "llama3":
            problems.append(f"rope_scaling type {kind!r} but the model uses Llama 3.1 ('llama3') RoPE scaling")
        else:
            for k, v in want.items():
                if k in scaling and not math.isclose(float(scaling[k]), float(v)):
                    problems.append(f"rope_scaling.{k} = {scaling[k]} but the model's is {v}")
    else:
        problems.append("no rope_scaling (plain RoPE) but the model applies Llama 3.1 ('llama3') RoPE scaling")
    if problems:
        raise ValueError("config.json: " + "; ".join(problems))
