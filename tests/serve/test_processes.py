"""vLLM's default engine process: `vllm.LLM` in a plain script (no `__main__` guard) forks its
engine core, which must not inherit a started XLA runtime from the front end."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from .harness import PROMPTS, greedy, write_model

SCRIPT = """
from vllm import LLM, SamplingParams
import vllm.platforms
llm = LLM(model={folder!r}, dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
          kv_cache_memory_bytes=1 << 22)
out = llm.generate([{{"prompt_token_ids": {prompt}}}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                   use_tqdm=False)
print("PLATFORM", type(vllm.platforms.current_platform).__name__)
print("TOKENS", list(out[0].outputs[0].token_ids))
"""


def test_a_plain_script_forks_its_engine_and_gets_greedy_tokens(tmp_path):
    model = write_model("llama", tmp_path)
    prompt = PROMPTS[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(folder=str(tmp_path), prompt=prompt)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    assert "PLATFORM TpuPlatform" in log
    assert "EngineCore pid=" in log, "the engine did not run in a process of its own"
    assert "spawned, not forked" not in log, "the front end started XLA before the engine's fork"
    tokens = next(line for line in log.splitlines() if line.startswith("TOKENS"))
    assert tokens == f"TOKENS {greedy(model, prompt, 8)[0]}"


def test_xla_started_in_the_front_end_switches_to_spawn(monkeypatch, caplog):
    """Where the user's code ran XLA before creating the engine, the engine process is spawned."""
    import torch

    from torchtpu.serve import platform

    (torch.ones(2).to("tpu") + 1).cpu()  # XLA runs in this process now
    monkeypatch.setattr(platform, "ENGINE_PROCESS", [False])  # as in a front end
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    with caplog.at_level(logging.WARNING, logger="torchtpu.serve.platform"):
        platform.spawn_if_xla_started()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert "spawned, not forked" in caplog.text
