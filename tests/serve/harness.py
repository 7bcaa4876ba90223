"""The vLLM serving tests' harness: small random Hugging Face models, the oracle, engines.

- `write_model(family, folder)`: a random 2-layer model of a family (Llama, Qwen2, Qwen3, Qwen3-MoE) saved as
  a Hugging Face folder with torchtpu's bundled tokenizer (876 tokens; the vocabulary is 1024);
  `layers=1` writes its first layer only, with the same embedding and head (a draft model).
  Each family's seed was chosen so that the greedy continuations of `PROMPTS` have no near-tie:
  `greedy` reports the smallest top-1/top-2 logit gap it met, and the tests assert it stays far
  above float32 rounding, so a wrong token means a wrong result, not a coin flip.
- `greedy(model, prompt, n)`: transformers on CPU, the oracle: the argmax of the full forward
  at every step (no KV cache, no EOS handling, as vLLM's `ignore_eos=True`).
- `engine(folder, **kw)`: a `vllm.LLM` with torchtpu's platform, run in the test's process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: one engine per test process; the default forked engine
  process is tested in test_processes.py), shut down and its distributed state torn down after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import re

import torch

VOCAB = 1024  # the bundled tokenizer has 876 tokens
BOS, EOS = 0, 1  # <|begin_of_text|>, <|end_of_text|> of the bundled tokenizer
NEW_TOKENS = 24
# 8 prompts of mixed lengths (1..120 tokens), random token ids after BOS
PROMPT_LENGTHS = (1, 7, 19, 33, 58, 87, 104, 120)
MIN_MARGIN = 1e-3  # logits of about unit scale; float32 differences between the two are ~1e-6


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[BOS] + torch.randint(2, 876, (n - 1,), generator=g).tolist() for n in lengths]


PROMPTS = random_prompts(PROMPT_LENGTHS)


@dataclasses.dataclass(frozen=True)
class Family:
    config_class: str
    seed: int
    extra: dict


_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    max_position_embeddings=512,
    bos_token_id=BOS,
    eos_token_id=EOS,
    tie_word_embeddings=False,
    initializer_range=0.1,  # logits of about unit scale: no greedy near-ties for the chosen seeds
)

FAMILIES = {
    # head_dim 16: 8 query heads over 4 kv heads (tensor parallelism up to 4 splits the kv heads)
    "llama": Family("LlamaConfig", 5, dict(num_attention_heads=8, num_key_value_heads=4)),
    # q/k/v biases; head_dim 32
    "qwen2": Family("Qwen2Config", 0, dict(num_attention_heads=4, num_key_value_heads=2)),
    # q/k RMSNorm and a head_dim (48) that is not hidden / heads
    "qwen3": Family("Qwen3Config", 2, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=48)),
    # 8 experts of 64 (top-2, renormalised as Qwen3-30B-A3B's config says), every layer sparse
    "qwen3_moe": Family(
        "Qwen3MoeConfig",
        0,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
        ),
    ),
}


def write_model(family: str, folder, layers: int | None = None) -> torch.nn.Module:
    """Save a random model of `family` with the bundled tokenizer in `folder`; returns the model
    (transformers, CPU, float32, eval mode). `layers` keeps the first `layers` decoder layers of
    that model and its embedding, final norm and head: a smaller model of the same vocabulary that
    predicts much as the whole one does (a draft model for speculative decoding)."""
    import transformers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from torchtpu.train.tokenizer import BUNDLED_TOKENIZER

    spec = FAMILIES[family]
    config = getattr(transformers, spec.config_class)(**_COMMON, **spec.extra)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if layers is not None:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=BUNDLED_TOKENIZER, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )
    tokenizer.save_pretrained(folder)
    return model


@torch.no_grad()
def greedy(model, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], float]:
    """transformers' greedy continuation of `prompt` (n tokens) and the smallest gap between the
    top two logits on the way."""
    seq = list(prompt)
    margin = float("inf")
    for _ in range(n):
        logits = model(torch.tensor([seq])).logits[0, -1]
        top = logits.topk(2).values
        margin = min(margin, float(top[0] - top[1]))
        seq.append(int(logits.argmax()))
    return seq[len(prompt) :], margin


@torch.no_grad()
def log_softmax(model, tokens: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of the next token at every position of `tokens`."""
    return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)


def first_difference(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None if len(got) == len(want) else 0)


@contextlib.contextmanager
def engine(folder, **kwargs):
    """A `vllm.LLM` on `folder` with torchtpu's platform, in this process; torn down on exit.
    Small defaults: float32, max_model_len 512, 8 sequences, 128 tokens a step (longer batches
    are chunked), and the platform's default KV cache on XLA's CPU devices: what 8 sequences of
    512 tokens use (4 to 6 MiB for these models)."""
    multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from torchtpu.distributed import mesh

    options = dict(
        dtype="float32",
        seed=0,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        disable_log_stats=False,
    )
    options.update(kwargs)
    before = mesh.current_mesh()
    llm = None
    try:
        llm = LLM(model=str(folder), **options)
        yield llm
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        cleanup_dist_env_and_memory()
        mesh.set_mesh(before)
        if multiprocessing is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing
        gc.collect()


def assert_refused_at_start(config, folder, match: str) -> None:
    """Save a transformers `config` (no weights) with the bundled tokenizer in `folder` and check that
    starting an engine on it raises NotImplementedError matching `match`: an architecture torchtpu
    refuses when the model is built, before any weight is read."""
    import shutil

    from torchtpu.train.tokenizer import BUNDLED_TOKENIZER

    config.save_pretrained(folder)
    shutil.copy(BUNDLED_TOKENIZER, os.path.join(folder, "tokenizer.json"))
    try:
        with engine(folder, max_model_len=256):
            pass
    except NotImplementedError as e:
        assert re.search(match, str(e)), f"refused, but not naming {match!r}: {e}"
        return
    raise AssertionError(f"an engine started on {config.architectures or type(config).__name__}; expected a refusal")


def counter(llm, name: str) -> int:
    """A vLLM Prometheus counter's value (summed over its labels)."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)
