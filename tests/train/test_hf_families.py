"""Hugging Face weights in and out for Qwen3, dense and Mixture-of-Experts, through torchtitan's
`Qwen3StateDictAdapter` (the registry's hf_adapter).

The oracle is code nobody here wrote: transformers' `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` on
the CPU write the folders (save_pretrained: one tensor per expert, a tied lm_head left out) and read
the exports. The models are the debug flavors made narrow and 2 layers deep (as
tests/train/test_families.py trains them); the HF models get random weights, norms included, so a
swapped or misplaced tensor shows in the logits.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from torchtpu.train.config.manager import load_config

from .debug_run import REPO

pytestmark = pytest.mark.usefixtures("keep_current_mesh")

STEPS = 3
NARROW = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "hidden_dim": 128, "n_layers": 2}
TOKENS = torch.randint(0, 2048, (8, 16), generator=torch.Generator().manual_seed(5))


def _overrides(flavor):
    if flavor == "debugmodel":
        return dict(NARROW)
    from torchtpu.models.registry import get_family

    moe = get_family("qwen3").model_args("debugmodel_moe").moe_args
    return {**NARROW, "moe_inter_dim": 32, "moe_args": dataclasses.replace(moe, num_experts=8, top_k=2)}


def _args(flavor):
    from torchtpu.models.registry import get_family

    return dataclasses.replace(get_family("qwen3").model_args(flavor), **_overrides(flavor))


def _hf_model(flavor, seed=0):
    """A random transformers Qwen3 of the narrow flavor's sizes (its own config classes, from the
    values a user reads off the Qwen3 model card, not from torchtpu's config writer)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    o = _overrides(flavor)
    common = dict(
        vocab_size=2048,
        hidden_size=o["dim"],
        intermediate_size=o["hidden_dim"],
        num_hidden_layers=o["n_layers"],
        num_attention_heads=o["n_heads"],
        num_key_value_heads=o["n_kv_heads"],
        head_dim=o["head_dim"],
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=4096,
    )
    if flavor == "debugmodel":
        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True))
    else:
        cfg = Qwen3MoeConfig(
            **common,
            moe_intermediate_size=o["moe_inter_dim"],
            num_experts=o["moe_args"].num_experts,
            num_experts_per_tok=o["moe_args"].top_k,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        )
        model = Qwen3MoeForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.08 * noise)
    return model.eval()


def _hf_logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


def _tpu_logits(trainer):
    from torchtpu.distributed import distribute_tensor
    from torchtpu.models.llama3.parallelize import batch_placements

    x = distribute_tensor(TOKENS, trainer.mesh, batch_placements(trainer.mesh))
    with torch.no_grad():
        return trainer.model(x).cpu()


# Experts run in bfloat16 in torchtitan's grouped matmul (transformers' in float32): the MoE
# logits agree to bfloat16 rounding; the dense model computes in float32 throughout.
TOL = {"debugmodel": 1e-4, "debugmodel_moe": 2e-2}


@pytest.fixture(scope="module", params=["debugmodel", "debugmodel_moe"])
def round_trip(request, tmp_path_factory):
    """transformers writes a folder; a Trainer loads it (initial_load_in_hf), computes logits, trains
    STEPS steps and exports (last_save_in_hf)."""
    from torchtpu.train.trainer import Trainer

    flavor = request.param
    tmp = tmp_path_factory.mktemp(f"hf_{flavor}")
    hf = _hf_model(flavor)
    hf.save_pretrained(tmp / "hf")
    argv = [
        "--config",
        os.path.join(REPO, "train_configs", "qwen3_debug.toml"),
        "--model.flavor",
        flavor,
        "--job.dump_folder",
        str(tmp / "run"),
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "1",
        "--training.steps",
        str(STEPS),
        "--lr_scheduler.warmup_steps",
        "1",
        "--validation.enable",
        "false",
        "--checkpoint.initial_load_path",
        str(tmp / "hf"),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "100",
        "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf",
    ]
    t = Trainer(load_config(argv), model_overrides=_overrides(flavor))
    t.maybe_resume()
    loaded = _tpu_logits(t)
    hist = t.train()
    return {
        "flavor": flavor,
        "hf": hf,
        "folder": tmp / "hf",
        "loaded": loaded,
        "trained": _tpu_logits(t),
        "losses": [h["loss"] for h in hist],
        "export": os.path.join(tmp / "run", "checkpoint", f"hf_step_{STEPS}"),
        "tmp": tmp,
    }


def test_hf_weights_load_to_transformers_logits(round_trip):
    ref = _hf_logits(round_trip["hf"])
    got = round_trip["loaded"]
    diff = (got - ref).abs().max().item()
    print(
        f"{round_trip['flavor']}: max |torchtpu - transformers| logits {diff:.2e} (logits up to {ref.abs().max():.1f})"
    )
    assert got.shape == ref.shape == (8, 16, 2048)
    assert diff <= TOL[round_trip["flavor"]] * ref.abs().max().item()


def test_trained_export_loads_in_transformers_with_torchtpus_logits(round_trip):
    from transformers import AutoModelForCausalLM

    flavor = round_trip["flavor"]
    folder = round_trip["export"]
    config = json.load(open(os.path.join(folder, "config.json")))
    want = "Qwen3MoeForCausalLM" if flavor == "debugmodel_moe" else "Qwen3ForCausalLM"
    assert config["architectures"] == [want]
    assert config["tie_word_embeddings"] is (flavor == "debugmodel")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf).__name__ == want
    ref = _hf_logits(hf)
    got = round_trip["trained"]
    diff = (got - ref).abs().max().item()
    moved = (got - round_trip["loaded"]).abs().max().item()
    print(
        f"{flavor}: losses {round_trip['losses']}; export vs torchtpu logits {diff:.2e}; training moved them {moved:.2e}"
    )
    assert moved > 100 * diff  # the export holds the trained weights, not the loaded ones
    assert diff <= TOL[flavor] * ref.abs().max().item()
    # every tensor transformers holds came from the file (none left at its initial values)
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    if flavor == "debugmodel_moe":
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and "lm_head.weight" in names
    else:
        assert "lm_head.weight" not in names  # tied: written once, as transformers writes it
    assert config["eos_token_id"] == json.load(open(os.path.join(folder, "generation_config.json")))["eos_token_id"]


def test_convert_both_ways_is_bit_exact(round_trip):
    """Hugging Face -> torchtpu checkpoint -> Hugging Face, and Hugging Face -> DCP -> Hugging Face:
    every tensor of transformers' own file comes back bit-identical."""
    from safetensors.torch import load_file

    from torchtpu.convert import open_source, write_output

    args = _args(round_trip["flavor"])
    tmp, src = round_trip["tmp"], round_trip["folder"]
    ref = load_file(os.path.join(src, "model.safetensors"))
    for mid in ("torchtpu", "dcp"):
        out = write_output(open_source(str(src), "hf", args), str(tmp / mid), mid, args, torch.float32)
        back = write_output(open_source(out, mid, args), str(tmp / f"{mid}_hf"), "hf", args, torch.float32)
        got = load_file(os.path.join(back, "model.safetensors"))
        assert sorted(got) == sorted(ref), mid
        for k, v in ref.items():
            assert torch.equal(got[k], v), (mid, k)


def test_hf_config_mismatch_and_missing_adapter_are_one_line_errors(round_trip, tmp_path):
    from torchtpu.models.hf_adapter import HFLayout, HFLayoutError
    from torchtpu.models.registry import get_family
    from torchtpu.train.checkpoint.hf import HFCheckpointError, load_hf_arrays

    folder = round_trip["folder"]
    args = dataclasses.replace(_args(round_trip["flavor"]), rope_theta=10000.0)
    with pytest.raises(HFCheckpointError) as e:
        load_hf_arrays(str(folder), {}, args)
    print(e.value)
    assert "\n" not in str(e.value) and "rope_theta" in str(e.value)
    with pytest.raises(HFLayoutError, match="has no Hugging Face state-dict adapter"):
        HFLayout(args, family=dataclasses.replace(get_family("qwen3"), hf_adapter=None))


def test_convert_cli_wrong_flavor_or_family_is_one_line(tmp_path, capsys):
    """A Qwen3 folder that fits no family's --flavor, or an unknown --model, is one line."""
    from torchtpu.convert import main

    _hf_model("debugmodel").save_pretrained(tmp_path / "hf")  # narrow: fits no shipped flavor
    assert main([str(tmp_path / "hf"), str(tmp_path / "x"), "--to", "dcp", "--flavor", "debugmodel"]) == 2
    assert main([str(tmp_path / "hf"), str(tmp_path / "x"), "--to", "dcp", "--flavor", "8B", "--model", "mixtral"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("torchtpu-convert:")]
    print("\n".join(err))
    assert len(err) == 2
    assert "[2048, 64]" in err[0] and "[2048, 256]" in err[0] and "--model" in err[0]
    assert "no model family 'mixtral'" in err[1] and "qwen3" in err[1]


def test_family_without_hf_weights_is_a_one_line_config_error(tmp_path):
    """DeepSeek-V3 names torchtitan's adapter but has no config.json writer here: asked for Hugging
    Face weights, it stops at start-up (not after training) with one line naming the families that
    have them."""
    from torchtpu.train.config.job_config import ConfigError
    from torchtpu.train.trainer import Trainer

    config = os.path.join(REPO, "train_configs", "deepseek_v3_debug.toml")
    argv = ["--config", config, "--job.dump_folder", str(tmp_path)]
    for option in ("--checkpoint.last_save_in_hf", "--checkpoint.initial_load_in_hf"):
        with pytest.raises(ConfigError) as e:
            Trainer(load_config([*argv, "--checkpoint.enable", option]))
        print(e.value)
        assert "\n" not in str(e.value)
        assert "'deepseek_v3' has no Hugging Face weights in torchtpu; families with them: llama3, qwen3" in str(
            e.value
        )
