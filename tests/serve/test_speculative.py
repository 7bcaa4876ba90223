"""Speculative decoding on the tpu device: vLLM's n-gram proposer drafts tokens from the
sequence itself, the step scores them (one logits row per draft token), and vLLM's rejection
sampler keeps the target model's greedy tokens exactly: the output is transformers' greedy output,
whatever was drafted, accepted or rejected."""

from __future__ import annotations

import pytest
import torch

from .harness import MIN_MARGIN, PROMPTS, counter, engine, greedy, write_model

NEW = 48  # long enough for the random model's continuations to repeat n-grams the proposer finds


def test_ngram_speculation_gives_the_greedy_tokens(tmp_path):
    from vllm import SamplingParams

    model = write_model("llama", tmp_path)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    with engine(tmp_path, speculative_config=spec) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        drafted = counter(llm, "vllm:spec_decode_num_draft_tokens")
        accepted = counter(llm, "vllm:spec_decode_num_accepted_tokens")
    # the oracle on one host thread: on a loaded machine PyTorch's threads spin and make these
    # 384 small forwards a hundred times slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        wants = [greedy(model, prompt, NEW) for prompt in PROMPTS]
    finally:
        torch.set_num_threads(threads)
    print(f"n-gram drafts: {accepted} of {drafted} draft tokens accepted ({accepted / max(drafted, 1):.0%})")
    for prompt, out, (want, margin) in zip(PROMPTS, outs, wants):
        assert margin > MIN_MARGIN, f"the oracle has a near-tie ({margin:.2e}); choose another seed"
        assert list(out.outputs[0].token_ids) == want, f"prompt of {len(prompt)} tokens"
    # both of the rejection sampler's ways were taken: some drafts accepted, some rejected
    assert 0 < accepted < drafted


def test_a_draft_model_is_refused_with_the_fix(tmp_path):
    write_model("llama", tmp_path)
    spec = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"method='draft_model' is not supported on tpu: use method='ngram'"):
        with engine(tmp_path, speculative_config=spec):
            pass
