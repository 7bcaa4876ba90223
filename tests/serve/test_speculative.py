"""Speculative decoding on the tpu device: vLLM's n-gram proposer drafts tokens from the
sequence itself, or a draft model (a smaller model of the same vocabulary, on tpu too) drafts
them; the step scores them (one logits row per draft token), and vLLM's rejection sampler keeps
the target model's greedy tokens exactly: the output is transformers' greedy output, whatever was
drafted, accepted or rejected."""

from __future__ import annotations

import pytest
import torch

from .harness import MIN_MARGIN, PROMPTS, counter, engine, greedy, write_model

NEW = 48  # long enough for the random model's continuations to repeat n-grams the proposer finds


def drafts(llm) -> tuple[int, int]:
    """vLLM's counts of draft tokens proposed and accepted."""
    return counter(llm, "vllm:spec_decode_num_draft_tokens"), counter(llm, "vllm:spec_decode_num_accepted_tokens")


def oracle(model, prompts, n) -> list[tuple[list[int], float]]:
    # on one host thread: on a loaded machine PyTorch's threads spin and make these small forwards
    # a hundred times slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [greedy(model, prompt, n) for prompt in prompts]
    finally:
        torch.set_num_threads(threads)


def test_ngram_speculation_gives_the_greedy_tokens(tmp_path):
    from vllm import SamplingParams

    model = write_model("llama", tmp_path)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    greedy_params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=NEW, temperature=0.8, seed=0, ignore_eos=True)
    with engine(tmp_path, speculative_config=spec) as llm:
        # a sampled request beside the greedy ones: the greedy rows keep the target's tokens
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in [*PROMPTS, PROMPTS[2]]],
            [greedy_params] * len(PROMPTS) + [sampled],
            use_tqdm=False,
        )
        drafted, accepted = drafts(llm)
    wants = oracle(model, PROMPTS, NEW)
    print(f"n-gram drafts: {accepted} of {drafted} draft tokens accepted ({accepted / max(drafted, 1):.0%})")
    for prompt, out, (want, margin) in zip(PROMPTS, outs, wants):
        assert margin > MIN_MARGIN, f"the oracle has a near-tie ({margin:.2e}); choose another seed"
        assert list(out.outputs[0].token_ids) == want, f"prompt of {len(prompt)} tokens"
    # both of the rejection sampler's ways were taken: some drafts accepted, some rejected
    assert 0 < accepted < drafted


# a 1-token prompt, and two whose prefills (with the first's decodes) overflow one step's 128 tokens:
# chunked prefill, where the draft model runs over a request's partial prompt too
DRAFT_PROMPTS = [PROMPTS[0], PROMPTS[3], PROMPTS[7]]
DRAFT_NEW = 16


def _draft_layout(worker) -> dict:
    """On the worker: how many devices each of the draft model's parameters lies on."""
    from torchtpu import to_jax

    draft = worker.model_runner.drafter.model.model
    return {name: len(to_jax(p).sharding.device_set) for name, p in draft.named_parameters()}


@pytest.mark.parametrize(("draft", "tp"), [("first-layer", 1), ("target", 1), ("first-layer", 2)])
def test_draft_model_speculation_gives_the_greedy_tokens(tmp_path, draft, tp):
    """A draft model on tpu drafts 3 tokens a step: the target's first layer with its embedding and
    head (some drafts accepted, many rejected), or the target itself, which predicts what the
    target then samples (every draft accepted); under tensor parallelism the draft is laid out over
    the same devices."""
    from vllm import SamplingParams

    model = write_model("llama", tmp_path / "target")
    folder = tmp_path / "target"
    if draft == "first-layer":
        folder = tmp_path / "draft"
        write_model("llama", folder, layers=1)
    spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}
    params = [SamplingParams(max_tokens=DRAFT_NEW, temperature=0, ignore_eos=True)] * len(DRAFT_PROMPTS)
    prompts = list(DRAFT_PROMPTS)
    if draft == "first-layer":  # and a sampled request beside the greedy ones (its drafts mostly rejected)
        params.append(SamplingParams(max_tokens=DRAFT_NEW, temperature=0.8, seed=0, ignore_eos=True))
        prompts.append(PROMPTS[5])
    with engine(tmp_path / "target", speculative_config=spec, tensor_parallel_size=tp) as llm:
        (before,) = llm.collective_rpc("torchtpu_cache_stats")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        (after,) = llm.collective_rpc("torchtpu_cache_stats")
        drafted, accepted = drafts(llm)
        (layout,) = llm.collective_rpc(_draft_layout)
    # the draft model's step programs, like the target's, were all compiled at start-up
    assert after["xla_compiles"] == before["xla_compiles"]
    assert set(layout.values()) == {tp}, layout
    assert len(outs[-1].outputs[0].token_ids) == DRAFT_NEW
    wants = oracle(model, DRAFT_PROMPTS, DRAFT_NEW)
    print(f"draft model ({draft}, tp={tp}): {accepted} of {drafted} draft tokens accepted ({accepted / drafted:.0%})")
    for prompt, out, (want, margin) in zip(DRAFT_PROMPTS, outs, wants):
        assert margin > MIN_MARGIN, f"the oracle has a near-tie ({margin:.2e}); choose another seed"
        assert list(out.outputs[0].token_ids) == want, f"prompt of {len(prompt)} tokens"
    assert drafted > 0
    if draft == "first-layer":
        assert 0 < accepted < drafted  # both of the rejection sampler's ways were taken
    else:
        assert accepted >= 0.9 * drafted


def test_other_speculative_methods_are_refused_with_the_fix(tmp_path):
    write_model("llama", tmp_path)
    spec = {"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"method='eagle' is not supported on tpu: use method='draft_model'"):
        with engine(tmp_path, speculative_config=spec):
            pass
