"""vLLM's scheduler on the tpu device: a load larger than the KV cache is preempted and recomputed,
chunked prefill splits the long prompts, and every output is still transformers' greedy output."""

from __future__ import annotations

from .harness import MIN_MARGIN, NEW_TOKENS, PROMPTS, counter, engine, greedy, write_model

BLOCK_BYTES = 32 * 2 * (2 * 4 * 16 * 4)  # llama: 32 tokens x 2 layers x (k and v x 4 kv heads x 16 x fp32)


def test_preemption_recomputes_and_keeps_greedy_tokens(tmp_path):
    from vllm import SamplingParams

    model = write_model("llama", tmp_path)
    # 6 blocks of 32 tokens (5 hold one max_model_len) for 8 requests that need 22 at their end;
    # 32 tokens a step
    with engine(
        tmp_path,
        max_model_len=160,
        kv_cache_memory_bytes=6 * BLOCK_BYTES,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    ) as llm:
        preemptions = counter(llm, "vllm:num_preemptions")
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        preempted = counter(llm, "vllm:num_preemptions") - preemptions
    assert preempted > 0, "the load fit in the KV cache: nothing was preempted"
    for prompt, out in zip(PROMPTS, outs):
        want, margin = greedy(model, prompt)
        assert margin > MIN_MARGIN
        assert list(out.outputs[0].token_ids) == want, f"prompt of {len(prompt)} tokens after {preempted} preemptions"
