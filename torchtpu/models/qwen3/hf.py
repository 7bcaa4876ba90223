"""config.json for Qwen3 weights in Hugging Face's layout (`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`).

Names and layouts (experts one tensor each, a tied output projection left out) come from
torchtitan's `Qwen3StateDictAdapter`, through torchtpu.models.hf_adapter (the registry's
`hf_adapter`); this module writes and checks the config.json that goes with them.

    hf_config(model_args, "bfloat16")     # config.json for transformers' Qwen3 / Qwen3-MoE class
    check_hf_config(config, model_args)   # a difference that changes the maths -> ValueError (one line)
"""

from __future__ import annotations

import math

__all__ = ["hf_config", "check_hf_config"]


def _unwritable(a) -> list[str]:
    """What transformers' Qwen3 classes cannot compute of this torchtitan Qwen3 (none for its flavors)."""
    out = []
    if not a.qk_norm:
        out.append("qk_norm = False (Hugging Face's Qwen3 always normalizes q and k)")
    if a.moe_enabled:
        m = a.moe_args
        if m.score_func != "softmax":
            out.append(f"router score_func = {m.score_func!r} (Qwen3-MoE's router is a softmax)")
        if m.num_shared_experts:
            out.append(f"{m.num_shared_experts} shared experts (Qwen3-MoE has none)")
        if not math.isclose(float(m.route_scale), 1.0):
            out.append(f"route_scale = {m.route_scale} (Qwen3-MoE has none)")
        if m.score_before_experts:
            out.append("score_before_experts = True (Qwen3-MoE weights the experts' outputs)")
        if m.gate_bias:
            out.append("a router bias (Qwen3-MoE's gate has none)")
        if m.num_expert_groups or m.num_limited_groups:
            out.append("group-limited routing (Qwen3-MoE routes over all experts)")
    return out


def hf_config(model_args, dtype: str = "float32") -> dict:
    """config.json for transformers' Qwen3 class computing what torchtitan's `Qwen3Model` computes
    (ValueError, one line, for arguments no Qwen3 checkpoint can express)."""
    a = model_args
    bad = _unwritable(a)
    if bad:
        raise ValueError(f"this Qwen3 model has no Hugging Face equivalent: {'; '.join(bad)}")
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM" if a.moe_enabled else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if a.moe_enabled else "qwen3",
        "hidden_size": a.dim,
        "intermediate_size": a.hidden_dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim,
        "vocab_size": a.vocab_size,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": float(a.rope_theta),
        # transformers 5 reads RoPE settings from rope_parameters; older versions from rope_theta
        "rope_parameters": {"rope_type": "default", "rope_theta": float(a.rope_theta)},
        "rope_scaling": None,
        # plain RoPE: no table limits the context; Qwen3's released checkpoints say 40960
        "max_position_embeddings": max(int(a.max_seq_len), 40960),
        "hidden_act": "silu",
        "tie_word_embeddings": bool(a.enable_weight_tying),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": a.n_layers,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if a.moe_enabled:
        m = a.moe_args
        cfg.update(
            {
                "moe_intermediate_size": a.moe_inter_dim,
                "num_experts": m.num_experts,
                "num_experts_per_tok": m.top_k,
                "norm_topk_prob": bool(m.route_norm),
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        )
    return cfg


def check_hf_config(config: dict, model_args) -> None:
    """Raise ValueError (one line) when a Hugging Face config.json describes a model that computes
    differently from `model_args` in a way the tensor shapes do not show. Shape differences are
    reported per tensor by the loader."""
    a = model_args
    problems = []
    want = "qwen3_moe" if a.moe_enabled else "qwen3"
    if config.get("model_type", want) != want:
        problems.append(f"model_type = {config.get('model_type')!r} but the model is {want!r}")
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", rope.get("rope_theta"))
    if theta is not None and not math.isclose(float(theta), float(a.rope_theta)):
        problems.append(f"rope_theta = {theta} but the model's is {a.rope_theta}")
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    if scaling:
        problems.append(f"rope_scaling {scaling.get('rope_type', scaling.get('type'))!r} but the model uses plain RoPE")
    eps = config.get("rms_norm_eps")
    if eps is not None and not math.isclose(float(eps), float(a.norm_eps)):
        problems.append(f"rms_norm_eps = {eps} but the model's is {a.norm_eps}")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {config['hidden_act']!r} but the model uses silu")
    if config.get("head_dim", a.head_dim) != a.head_dim:
        problems.append(f"head_dim = {config['head_dim']} but the model's is {a.head_dim}")
    if bool(config.get("tie_word_embeddings", False)) != bool(a.enable_weight_tying):
        problems.append(
            f"tie_word_embeddings = {bool(config.get('tie_word_embeddings', False))} but the model "
            f"{'ties' if a.enable_weight_tying else 'does not tie'} its output projection to the embedding"
        )
    if config.get("attention_bias"):
        problems.append("attention_bias = true but the model's projections have no bias")
    if config.get("use_sliding_window"):
        problems.append("use_sliding_window = true but the model attends to every earlier position")
    if a.moe_enabled:
        m = a.moe_args
        experts = config.get("num_experts", config.get("num_local_experts"))
        if experts is not None and experts != m.num_experts:
            problems.append(f"num_experts = {experts} but the model's is {m.num_experts}")
        if config.get("num_experts_per_tok", m.top_k) != m.top_k:
            problems.append(f"num_experts_per_tok = {config['num_experts_per_tok']} but the model's top_k is {m.top_k}")
        if bool(config.get("norm_topk_prob", False)) != bool(m.route_norm):
            problems.append(
                f"norm_topk_prob = {config.get('norm_topk_prob', False)} but the model's route_norm is {m.route_norm}"
            )
        if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
            problems.append(
                "dense layers among the experts (decoder_sparse_step/mlp_only_layers) but every model layer is MoE"
            )
    problems += _unwritable(a)
    if problems:
        raise ValueError("config.json: " + "; ".join(problems))
