"""config.json for Llama 3 weights in Hugging Face's layout (`LlamaForCausalLM`).

Names and the q/k row permutation come from torchtitan's `Llama3StateDictAdapter`, through
torchtpu.models.hf_adapter (the registry's `hf_adapter`); this module writes and checks the
config.json that goes with them.

    hf_config(model_args, "float32")            # config.json for LlamaForCausalLM
    check_hf_config(config, model_args)         # a mismatch that changes the maths -> ValueError
"""

from __future__ import annotations

import math

__all__ = ["hf_config", "check_hf_config", "head_dim"]


def head_dim(model_args) -> int:
    return model_args.dim // model_args.n_heads


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
