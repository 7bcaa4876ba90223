"""vLLM's engine on the tpu device, against transformers on CPU.

One engine per model family (module-scoped, built once): Llama (head_dim 16), Qwen2 (q/k/v
biases) and Qwen3 (q/k norms, head_dim 48). Every family: one `generate()` over 8 prompts of 1 to
120 tokens gives transformers' greedy tokens, and vLLM's logprobs along a long sequence (past
one 256-position attention chunk) are transformers' log_softmax; prefix caching hits with the same
tokens; the sampling parameters work; a steady load of 100 requests compiles nothing.
"""

from __future__ import annotations

import random

import pytest
import torch

from .harness import (
    MIN_MARGIN,
    NEW_TOKENS,
    PROMPTS,
    counter,
    engine,
    first_difference,
    greedy,
    log_softmax,
    random_prompts,
    write_model,
)

FAMILY_NAMES = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def served(request, tmp_path_factory):
    """(engine, transformers model, family) for the family in request.param."""
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    model = write_model(family, folder)
    with engine(folder, enable_prefix_caching=True) as llm:
        yield llm, model, family


def _requests(llm, prompts, **params):
    from vllm import SamplingParams

    return llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params), use_tqdm=False)


def _generate(llm, prompts, **params):
    return [r.outputs[0] for r in _requests(llm, prompts, **params)]


def test_platform_is_torchtpu(served):
    """The platform plugin chose torchtpu, and the general plugin (loaded by the engine's start) has
    vLLM inspect model classes in this process, not in a fresh one."""
    import vllm.platforms
    from vllm.model_executor.models import registry

    import torchtpu.serve
    from torchtpu.serve.platform import TpuPlatform

    assert isinstance(vllm.platforms.current_platform, TpuPlatform)
    assert registry._run_in_subprocess is torchtpu.serve._in_this_process


def test_the_default_kv_cache_holds_max_num_seqs_sequences_of_max_model_len(served):
    """On XLA's CPU devices the cache is what the engine can ever use, not a share of the host's
    memory: 8 sequences (max_num_seqs) of 512 tokens in blocks of 32, and the block pool's null block."""
    llm, _, _ = served
    config = llm.llm_engine.vllm_config
    assert (config.scheduler_config.max_num_seqs, config.model_config.max_model_len) == (8, 512)
    assert config.cache_config.block_size == 32
    assert config.cache_config.num_gpu_blocks == 8 * (512 // 32) + 1


def test_greedy_tokens_are_transformers(served):
    llm, model, family = served
    outs = _generate(llm, PROMPTS, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, outs):
        want, margin = greedy(model, prompt)
        assert margin > MIN_MARGIN, f"{family}: the oracle has a near-tie ({margin:.2e}); choose another seed"
        got = list(out.token_ids)
        at = first_difference(got, want)
        assert at is None, f"{family}, prompt of {len(prompt)} tokens: token {at} is {got[at]}, transformers {want[at]}"


def test_logprobs_are_transformers_log_softmax(served):
    """The top-5 logprobs at every generated position, for a short prompt and one whose context
    runs past the first 256 positions (the pure-JAX attention's chunk) and 8 cache blocks."""
    llm, model, family = served
    prompts = random_prompts([12, 300], seed=1)
    outs = _generate(llm, prompts, max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, outs):
        assert len(out.logprobs) == 12
        want = log_softmax(model, prompt + list(out.token_ids))
        for i, (token, top) in enumerate(zip(out.token_ids, out.logprobs)):
            row = want[len(prompt) - 1 + i]
            assert token == int(row.argmax()), f"{family}: position {len(prompt) + i} is not transformers' argmax"
            assert token in top and len(top) >= 5
            got = torch.tensor([lp.logprob for lp in top.values()])
            ids = torch.tensor(list(top))
            where = f"{family}, prompt of {len(prompt)}, new token {i}"
            torch.testing.assert_close(got, row[ids], atol=1e-4, rtol=0, msg=lambda m, where=where: f"{where}: {m}")


def test_prefix_cache_hits_and_same_tokens(served):
    llm, model, _ = served
    prefix = random_prompts([160], seed=2)[0]  # 5 full blocks of 32 tokens
    prompts = [prefix + tail for tail in ([5, 6, 7], [8, 9], [10, 11, 12, 13])]
    hits = counter(llm, "vllm:prefix_cache_hits")
    first = _requests(llm, prompts[:1], max_tokens=8, temperature=0, ignore_eos=True)
    rest = _requests(llm, prompts[1:], max_tokens=8, temperature=0, ignore_eos=True)
    new_hits = counter(llm, "vllm:prefix_cache_hits") - hits
    assert new_hits >= 2 * 160, f"vLLM counted {new_hits} prefix-cache hit tokens for two prompts sharing 160"
    assert [r.num_cached_tokens for r in rest] == [160, 160]
    for prompt, r in zip(prompts, first + rest):
        want, margin = greedy(model, prompt, 8)
        assert margin > MIN_MARGIN, f"the oracle has a near-tie ({margin:.2e})"
        assert list(r.outputs[0].token_ids) == want


def test_sampling_parameters(served):
    llm, model, _ = served
    prompt = PROMPTS[3]
    want = greedy(model, prompt, 16)[0]

    def tokens(**params):
        return list(_generate(llm, [prompt], ignore_eos=True, **params)[0].token_ids)

    # seeds: the same seed draws the same tokens, another seed others; top_k=1 is greedy
    a, b, c = (tokens(max_tokens=16, temperature=1.0, seed=s) for s in (7, 7, 8))
    assert a == b and a != c and a != want
    assert tokens(max_tokens=16, temperature=1.0, top_k=1, seed=3) == want
    assert tokens(max_tokens=16, temperature=0.7, top_p=1e-6, seed=4) == want

    # a seeded request draws the same tokens alone and beside others, its 200-token prompt
    # chunked differently (128 tokens a step)
    long = random_prompts([200], seed=4)[0]
    params = dict(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    alone = _generate(llm, [long], **params)[0].token_ids
    together = _generate(llm, [PROMPTS[7], PROMPTS[5], long], **params)[2].token_ids
    assert list(alone) == list(together)

    # max_tokens
    out = _generate(llm, [prompt], max_tokens=5, temperature=0, ignore_eos=True)[0]
    assert list(out.token_ids) == want[:5] and out.finish_reason == "length"

    # stop strings: the greedy text cut before the first occurrence of a piece of it
    full = _generate(llm, [prompt], max_tokens=16, temperature=0, ignore_eos=True)[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"no stop string in {full!r}"
    out = _generate(llm, [prompt], max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]


def test_prompt_logprobs_are_refused(served):
    """The step has logits only where vLLM samples: prompt log-probabilities would be wrong, so the
    request is refused with one line naming the parameter."""
    llm = served[0]
    with pytest.raises(ValueError, match="prompt_logprobs is not supported on tpu"):
        _generate(llm, [PROMPTS[2]], max_tokens=2, prompt_logprobs=1)


def test_steady_load_compiles_nothing(served):
    """100 requests of random lengths, greedy and sampled, after start-up: no XLA compile, no
    retrace of the step (vLLM's warm-up compiled every padding bucket)."""
    llm, _, _ = served
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(100)]
    prompts = random_prompts(lengths, seed=3)
    from vllm import SamplingParams

    params = [
        SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.8]), seed=i, ignore_eos=True)
        for i in range(100)
    ]
    (before,) = llm.collective_rpc("torchtpu_cache_stats")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    (after,) = llm.collective_rpc("torchtpu_cache_stats")
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert before["step_buckets"] > 0
    for key in ("xla_compiles", "compiled_step_traces", "compiled_step_retraces", "step_buckets"):
        assert after[key] == before[key], f"{key}: {before[key]} -> {after[key]} under a steady load"
