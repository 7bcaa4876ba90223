"""Tensor parallelism: `tensor_parallel_size=N` is one SPMD program over N tpu devices (the CPU
devices here). The tokens are transformers' greedy tokens, which test_engine.py shows are the
tokens of one device, and the weights and caches really lie split over the mesh's "tp" axis."""

from __future__ import annotations

import pytest

from .harness import MIN_MARGIN, NEW_TOKENS, PROMPTS, engine, greedy, write_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, write_model("llama", folder)


def _layout(worker) -> dict:
    """On the worker: each parameter's and cache's partition spec and device count."""
    from torchtpu import to_jax

    runner = worker.model_runner
    out = {}
    for name, p in runner.model.named_parameters():
        s = to_jax(p).sharding
        out[name] = (tuple(getattr(s, "spec", ())), len(s.device_set))
    for i, cache in enumerate(runner.kv_caches):
        s = to_jax(cache).sharding
        out[f"kv_cache.{i}"] = (tuple(getattr(s, "spec", ())), len(s.device_set))
    # the fused layers whose rows are stored shard-major (device i holds q_i, k_i, v_i)
    out["shard-major"] = sorted(
        name
        for name, m in runner.model.named_modules()
        if type(m.__dict__.get("forward")).__name__ == "_ModelOrderForward"
    )
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_gives_the_tokens_of_one_device(llama, tp):
    from vllm import SamplingParams

    folder, model = llama
    with engine(folder, tensor_parallel_size=tp, max_num_batched_tokens=64) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        (layout,) = llm.collective_rpc(_layout)
    # 8 query heads and 4 kv heads divide over 2 and 4 devices: every parallel layer is split
    split = {"qkv_proj.weight": 0, "gate_up_proj.weight": 0, "o_proj.weight": 1, "down_proj.weight": 1}
    fused = layout.pop("shard-major")
    assert fused == [f"model.layers.{i}.{m}" for i in range(2) for m in ("mlp.gate_up_proj", "self_attn.qkv_proj")]
    for name, (spec, devices) in layout.items():
        assert devices == tp, f"{name} lies on {devices} devices, not the {tp} of the mesh"
        dim = next((d for suffix, d in split.items() if name.endswith(suffix)), None)
        if name.startswith("kv_cache"):
            dim = 2  # [blocks, block_size, 2 * kv heads, head_dim]: over the kv heads
        elif name.endswith(("embed_tokens.weight",)):
            dim = 1
        elif name.endswith("lm_head.weight"):
            dim = 0
        if dim is not None:
            assert len(spec) > dim and spec[dim] == "tp", f"{name}: {spec}, expected 'tp' on dim {dim}"
    assert sum(name.startswith("kv_cache") for name in layout) == 2
    for prompt, out in zip(PROMPTS, outs):
        want, margin = greedy(model, prompt)
        assert margin > MIN_MARGIN
        assert list(out.outputs[0].token_ids) == want, f"tp={tp}, prompt of {len(prompt)} tokens"
