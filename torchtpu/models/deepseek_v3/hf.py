"""config.json for DeepSeek-V3 weights in Hugging Face's layout (`DeepseekV3ForCausalLM`).

Names and layouts (experts one tensor each, the expert bias as the router's
`e_score_correction_bias`) come from torchtitan's `DeepSeekV3StateDictAdapter`, through
torchtpu.models.hf_adapter (the registry's `hf_adapter`); this module writes and checks the
config.json that goes with them.

    hf_config(model_args, "bfloat16")     # config.json for transformers' DeepseekV3ForCausalLM
    check_hf_config(config, model_args)   # a difference that changes the maths -> ValueError (one line)
    seq_len_dependent(model_args)         # why config.json needs the training length (torchtpu-convert)
    ignored_hf_tensors(config)            # the multi-token-prediction layers a loader leaves out

What transformers' DeepSeek-V3 computes, against torchtitan's `DeepSeekV3Model`:

* the router is a sigmoid, its group-limited choice the sum of each group's two best scores plus
  the bias, as torchtitan's; torchtitan's softmax router (the debugmodel, 16B and 236B flavors,
  DeepSeek-V2's), a gate bias and scores applied before the experts have no DeepSeek-V3
  equivalent and are refused. No groups is one group of all experts (n_group = topk_group = 1);
* the rotary part of each head rotates interleaved pairs (`rope_interleave`, as torchtitan's
  complex rotation); a checkpoint with `rope_interleave = false` is refused;
* YaRN: torchtitan applies it only when the model is built for more than `original_seq_len`
  positions (max_seq_len: the training sequence length), and then also scales the softmax by
  (0.1 mscale ln(rope_factor) + 1)^2; transformers applies what `rope_parameters` says at every
  length. A model built at most `original_seq_len` long is written with plain RoPE and
  max_position_embeddings = original_seq_len; a longer one with YaRN (mscale = mscale_all_dim =
  torchtitan's mscale, so the cos/sin stay unscaled and the softmax scale matches), and a
  checkpoint whose RoPE differs from what the model computes at its length is refused;
* normalization epsilons: transformers normalizes the query and key-value latents with 1e-6 and the
  final hidden state with rms_norm_eps, torchtitan the latents with norm_eps and the final hidden
  state with its dtype's machine epsilon (float32: 1.2e-7). Each changes a normalized vector by a
  factor sqrt(ms / (ms + eps)) (ms: its mean square), i.e. by less than eps / (2 ms) relative:
  below float32 rounding for the final state, about 1e-5 for the latents of the debug models.
"""

from __future__ import annotations

import math

__all__ = ["FLOAT32_TENSORS", "hf_config", "check_hf_config", "ignored_hf_tensors", "seq_len_dependent"]

# Hugging Face tensors written in float32 whatever the export's dtype: transformers keeps the expert
# bias in float32 (it moves the choice of experts by small steps that bfloat16 would round away)
FLOAT32_TENSORS = ("e_score_correction_bias",)


def _yarn(a) -> bool:
    """Whether torchtitan's DeepSeek-V3 built for `a.max_seq_len` positions applies YaRN."""
    return int(a.max_seq_len) > int(a.original_seq_len)


def seq_len_dependent(model_args) -> str | None:
    """Why config.json depends on the length the model was built for (None when it does not):
    torchtpu-convert asks for that length before writing one from weights alone."""
    a = model_args
    return (
        f"DeepSeek-V3's RoPE is plain up to original_seq_len = {a.original_seq_len} positions and YaRN "
        f"(factor {a.rope_factor}) above"
    )


def ignored_hf_tensors(config: dict) -> tuple[str, ...]:
    """Name prefixes of the tensors a loader leaves out: the multi-token-prediction layers DeepSeek's
    checkpoints append after the last layer (num_nextn_predict_layers; transformers skips them too)."""
    n, extra = config.get("num_hidden_layers"), config.get("num_nextn_predict_layers") or 0
    return tuple(f"model.layers.{i}." for i in range(n, n + extra)) if n is not None else ()


def _groups(m) -> tuple[int, int]:
    """(groups, groups kept) of the routing; no group limit is one group kept of one."""
    if m.num_expert_groups is None:
        return 1, 1
    return int(m.num_expert_groups), int(m.num_limited_groups)


def _unwritable(a) -> list[str]:
    """What transformers' DeepSeek-V3 cannot compute of this torchtitan DeepSeek-V3."""
    m = a.moe_args
    out = []
    if a.n_dense_layers < a.n_layers:
        if m.score_func != "sigmoid":
            out.append(
                f"router score_func = {m.score_func!r} (transformers' DeepSeek-V3 router is a sigmoid; "
                "the softmax router is DeepSeek-V2's)"
            )
        if m.gate_bias:
            out.append("a router gate bias (DeepSeek-V3's gate has none)")
        if m.score_before_experts:
            out.append("score_before_experts = True (DeepSeek-V3 weights the experts' outputs)")
        if not m.num_shared_experts:
            out.append("no shared experts (DeepSeek-V3's MoE layers always have them)")
    return out


def _rope(a) -> tuple[dict, int]:
    """(rope_parameters, max_position_embeddings) computing torchtitan's rotary embedding and
    softmax scale at the model's length."""
    theta = float(a.rope_theta)
    if not _yarn(a):
        return {"rope_type": "default", "rope_theta": theta}, int(a.original_seq_len)
    return (
        {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": float(a.rope_factor),
            "original_max_position_embeddings": int(a.original_seq_len),
            "beta_fast": float(a.beta_fast),
            "beta_slow": float(a.beta_slow),
            # mscale over mscale_all_dim scales cos/sin (1 here, as torchtitan's); mscale_all_dim the softmax
            "mscale": float(a.mscale),
            "mscale_all_dim": float(a.mscale),
            "attention_factor": 1.0,
        },
        max(int(a.max_seq_len), int(a.original_seq_len * a.rope_factor)),
    )


def hf_config(model_args, dtype: str = "float32") -> dict:
    """config.json for transformers' `DeepseekV3ForCausalLM` computing what torchtitan's
    `DeepSeekV3Model` computes (ValueError, one line, for arguments it cannot express)."""
    a = model_args
    bad = _unwritable(a)
    if bad:
        raise ValueError(f"this DeepSeek-V3 model has no Hugging Face DeepSeek-V3 equivalent: {'; '.join(bad)}")
    m = a.moe_args
    groups, kept = _groups(m)
    rope, positions = _rope(a)
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": a.vocab_size,
        "hidden_size": a.dim,
        "intermediate_size": a.inter_dim,
        "moe_intermediate_size": a.moe_inter_dim,
        "num_hidden_layers": a.n_layers,
        "first_k_dense_replace": a.n_dense_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_heads,
        "q_lora_rank": a.q_lora_rank or None,
        "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        "n_routed_experts": m.num_experts,
        "n_shared_experts": m.num_shared_experts,
        "num_experts_per_tok": m.top_k,
        "n_group": groups,
        "topk_group": kept,
        "norm_topk_prob": bool(m.route_norm),
        "routed_scaling_factor": float(m.route_scale),
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "rms_norm_eps": a.norm_eps,
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        # transformers before 5 read the scaling from rope_scaling
        "rope_scaling": None
        if rope["rope_type"] == "default"
        else {k: v for k, v in rope.items() if k != "rope_theta"},
        "rope_interleave": True,
        "max_position_embeddings": positions,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": 0,  # no multi-token-prediction module: torchtitan's model has none
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def _close(x, y) -> bool:
    return math.isclose(float(x), float(y), rel_tol=1e-6)


def _rope_problems(config: dict, a) -> list[str]:
    rope = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type")
    if kind in (None, "default") and scaling:
        rope, kind = {**scaling, **rope}, scaling.get("rope_type", scaling.get("type"))
    theta = config.get("rope_theta", rope.get("rope_theta"))
    out = []
    if theta is not None and not _close(theta, a.rope_theta):
        out.append(f"rope_theta = {theta} but the model's is {a.rope_theta}")
    here = f"the model is built for {a.max_seq_len} positions (training.seq_len)"
    if kind in (None, "default"):
        if _yarn(a):
            out.append(
                f"plain RoPE but {here}, above original_seq_len = {a.original_seq_len}, where torchtitan's "
                f"DeepSeek-V3 applies YaRN; train at most {a.original_seq_len} long"
            )
        return out
    if kind != "yarn":
        return [*out, f"rope type {kind!r} but torchtitan's DeepSeek-V3 computes plain RoPE or YaRN"]
    if not _yarn(a):
        return [
            *out,
            f"YaRN RoPE (factor {rope.get('factor')}) but {here}, at most original_seq_len = "
            f"{a.original_seq_len}, where torchtitan's DeepSeek-V3 applies plain RoPE; set training.seq_len "
            f"above {a.original_seq_len}",
        ]
    factor = float(rope.get("factor") or 0)
    want = {
        "factor": (factor, a.rope_factor),
        "original_max_position_embeddings": (rope.get("original_max_position_embeddings"), a.original_seq_len),
        "beta_fast": (rope.get("beta_fast") or 32, a.beta_fast),
        "beta_slow": (rope.get("beta_slow") or 1, a.beta_slow),
        "mscale_all_dim": (rope.get("mscale_all_dim") or 0, a.mscale),
    }
    for k, (got, model) in want.items():
        if got is None or not _close(got, model):
            out.append(f"rope_parameters.{k} = {got} but the model's is {model}")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = rope.get("attention_factor")
    if att is None:
        ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
        att = get_mscale(factor, ms) / get_mscale(factor, ms_all) if ms and ms_all else get_mscale(factor)
    if not _close(att, 1.0):
        out.append(f"YaRN scales cos/sin by {att:.6g} (mscale/mscale_all_dim) but torchtitan's DeepSeek-V3 does not")
    if rope.get("truncate", True) is False:
        out.append("rope_parameters.truncate = false but torchtitan rounds the YaRN correction range")
    return out


def check_hf_config(config: dict, model_args) -> None:
    """Raise ValueError (one line) when a Hugging Face config.json describes a model that computes
    differently from `model_args` in a way the tensor shapes do not show. Shape differences are
    reported per tensor by the loader."""
    a = model_args
    m = a.moe_args
    problems = []
    if config.get("model_type", "deepseek_v3") != "deepseek_v3":
        problems.append(f"model_type = {config.get('model_type')!r} but the model is 'deepseek_v3'")
    problems += _rope_problems(config, a)
    eps = config.get("rms_norm_eps")
    if eps is not None and not _close(eps, a.norm_eps):
        problems.append(f"rms_norm_eps = {eps} but the model's is {a.norm_eps}")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {config['hidden_act']!r} but the model uses silu")
    if config.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings = true but the model has a separate output projection")
    if config.get("attention_bias"):
        problems.append("attention_bias = true but the model's projections have no bias")
    if config.get("rope_interleave", True) is False:
        problems.append(
            "rope_interleave = false (rotary dimensions in two halves) but torchtitan rotates interleaved pairs"
        )
    if config.get("first_k_dense_replace", a.n_dense_layers) != a.n_dense_layers:
        problems.append(
            f"first_k_dense_replace = {config['first_k_dense_replace']} but the model's is {a.n_dense_layers}"
        )
    if a.n_dense_layers < a.n_layers:
        if config.get("num_experts_per_tok", m.top_k) != m.top_k:
            problems.append(f"num_experts_per_tok = {config['num_experts_per_tok']} but the model's top_k is {m.top_k}")
        if bool(config.get("norm_topk_prob", True)) != bool(m.route_norm):
            problems.append(
                f"norm_topk_prob = {config.get('norm_topk_prob', True)} but the model's route_norm is {m.route_norm}"
            )
        scale = config.get("routed_scaling_factor", 2.5)
        if not _close(scale, m.route_scale):
            problems.append(f"routed_scaling_factor = {scale} but the model's route_scale is {m.route_scale}")
        groups, kept = config.get("n_group", 8), config.get("topk_group", 4)
        want = _groups(m)
        if (groups, kept) != want and not (groups == kept and want[0] == want[1]):  # all groups kept: no limit
            problems.append(
                f"n_group = {groups}, topk_group = {kept} but the model routes within {want[1]} of {want[0]} expert groups"
            )
        for key in ("scoring_func", "topk_method"):
            allowed = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)}[key]
            if config.get(key, allowed[0]) not in allowed:
                problems.append(f"{key} = {config[key]!r} but transformers' DeepSeek-V3 computes {allowed[0]!r}")
    problems += _unwritable(a)
    if problems:
        raise ValueError("config.json: " + "; ".join(problems))
