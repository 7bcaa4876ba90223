"""An fp8 KV cache on tpu: vLLM's `kv_cache_dtype="fp8"` ("fp8_e4m3") and "fp8_e5m2".

- The cache ops (torchtpu::paged_kv_write, torchtpu::ragged_paged_attention; the pure JAX form on
  XLA's CPU devices): the bytes written are PyTorch's on CPU, `(x / scale).clamp(+-max)` in the
  fp8 type, saturated; attention equals PyTorch's on CPU over the fp8-rounded keys and values
  (times their scales) to float32 rounding, and unquantized attention within fp8's rounding.
- vLLM end to end, one engine (a random Llama, float32): logprobs are transformers' with its keys
  and values rounded to fp8 to float32 rounding, and transformers' unquantized log_softmax within
  a stated tolerance; the cache is uint8, one byte per element, so `kv_cache_memory_bytes` holds
  four times the blocks of the model's float32 (twice bfloat16's).
- The Pallas kernel with an fp8 cache, compiled ahead of time for a v6e (compile only: no TPU).
- Other quantized caches are refused at start-up in one line.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.backend.test_paged_attention import MIXED, _batch, _oracle

from .harness import MIN_MARGIN, PROMPTS, engine, log_softmax, random_prompts, write_model

# vLLM's name -> (torch dtype, largest finite value, unit roundoff 2^-(mantissa bits + 1))
FP8 = {
    "fp8": (torch.float8_e4m3fn, 448.0, 2.0**-4),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0, 2.0**-4),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0, 2.0**-3),
}


def _fp8(x: torch.Tensor, scale: float, name: str) -> torch.Tensor:
    """x quantized as vLLM's GPU kernels do: x / scale, saturated, in the fp8 type."""
    dtype, top, _ = FP8[name]
    return (x / scale).clamp(-top, top).to(dtype)


def _interleaved(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[..., kv_heads, d] keys and values -> [..., 2 * kv_heads, d], key at even slots."""
    return torch.stack([k, v], dim=-2).flatten(-3, -2)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_ops_against_torch_on_cpu(name):
    """Every slot of a 40-block cache written in a random order (plus padding tokens, slot -1,
    which write nothing), then a mixed batch (prefills, a chunked prefill, decodes) attends."""
    q, cache, lens, tables, cu, n = _batch(**MIXED, kv_heads=2, group=2, head_dim=16)
    k_scale, v_scale = 0.05, 0.5
    _, top, u = FP8[name]
    k, v = cache[:, :, 0::2].clone(), cache[:, :, 1::2]
    k[3, 1, 0, :4] = torch.tensor([1e4, -1e4, 2 * top * k_scale, 0.0])  # past the fp8 range: saturated
    slots = torch.randperm(k.shape[0] * k.shape[1], generator=torch.Generator().manual_seed(1)).int()
    rows = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731  (one row per slot)
    order = slots.long()
    pad = torch.full((3, 2, 16), 1e6)
    on = torch.zeros(cache.shape, dtype=torch.uint8, device="tpu")
    torch.ops.torchtpu.paged_kv_write(
        on,
        torch.cat([rows(k)[order], pad]).to("tpu"),
        torch.cat([rows(v)[order], pad]).to("tpu"),
        torch.cat([slots, torch.full((3,), -1, dtype=torch.int32)]).to("tpu"),
        name,
        k_scale,
        v_scale,
    )
    qk, qv = _fp8(k, k_scale, name), _fp8(v, v_scale, name)
    assert torch.equal(on.cpu(), _interleaved(qk, qv).view(torch.uint8)), "the cache's bytes are not PyTorch's fp8"
    assert float(qk[3, 1, 0, 0].float()) == top and float(qk[3, 1, 0, 1].float()) == -top

    scale = 1 / math.sqrt(16)
    meta = [t.to("tpu") for t in (lens, tables, cu, n)]
    got = torch.ops.torchtpu.ragged_paged_attention(q.to("tpu"), on, *meta, scale, None, None, name, k_scale, v_scale)
    got = got.cpu()
    real = int(cu[int(n[0])])
    assert torch.all(got[real:] == 0), "padding tokens must give zeros"
    dequantized = _interleaved(qk.float() * k_scale, qv.float() * v_scale)
    want = _oracle(q, dequantized, lens, tables, cu, n, scale=scale)
    torch.testing.assert_close(got[:real], want[:real], atol=1e-5, rtol=1e-5)

    # against unquantized attention over the same (in-range) values: within fp8's rounding
    clamped = _interleaved(k.clamp(-top * k_scale, top * k_scale), v)
    exact = _oracle(q, clamped, lens, tables, cu, n, scale=scale)[:real]
    err = (got[:real] - exact).abs()
    # measured: e4m3 mean 0.036, max 0.086 (of the largest output); e5m2 0.069, 0.115
    assert err.mean() <= u * exact.abs().mean(), f"{name}: mean error {err.mean() / exact.abs().mean():.3f}"
    assert err.max() <= 2 * u * exact.abs().max(), f"{name}: max error {err.max() / exact.abs().max():.3f}"


# ----------------------------------------------------------------------------- the TPU kernel


def test_the_kernel_compiles_with_an_fp8_cache_for_a_v6e():
    """The write and the Pallas kernel on a uint8 cache of e4m3 bytes, compiled ahead of time for
    one v6e chip: the kernel (which dequantizes each block it loads) is the attention, and the cache
    is updated in place at one byte per element, with no copy of it."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from torchtpu.backend import aot
    from torchtpu.backend.ops import paged_attention as pa
    from torchtpu.distributed import topology

    if not topology.libtpu_available():
        pytest.skip("needs libtpu")
    chip = topology.topology_devices("v6e:2x2")[0]
    tokens, heads, kv_heads, dim, blocks, block, seqs, pages = 16, 8, 4, 128, 16, 16, 4, 4

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(chip))

    fp8 = dict(kv_dtype=jnp.float8_e4m3fn, k_scale=0.5, v_scale=2.0)

    def step(cache, k, v, slots, q, *meta):
        cache = pa.write_kv_cache(cache, k, v, slots, **fp8)
        return cache, pa.ragged_paged_attention(q, cache, *meta, sm_scale=0.1, **fp8)

    new = sds((tokens, kv_heads, dim), jnp.bfloat16)
    meta = (sds((seqs,), jnp.int32), sds((seqs, pages), jnp.int32), sds((seqs + 1,), jnp.int32), sds((1,), jnp.int32))
    cache = sds((blocks, block, 2 * kv_heads, dim), jnp.uint8)
    # Mosaic reads the chip generation from JAX's default device while lowering the kernel
    with jax.default_device(chip):
        lowered = jax.jit(step, donate_argnums=0).lower(
            cache, new, new, sds((tokens,), jnp.int32), sds((tokens, heads, dim), jnp.bfloat16), *meta
        )
        compiled = aot.aot_compile(lowered)
    hlo = compiled.as_text()
    assert "ragged_paged_attention_kernel" in hlo and "tpu_custom_call" in hlo
    cache_bytes = blocks * block * 2 * kv_heads * dim
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes == cache_bytes, mem
    assert mem.temp_size_in_bytes < cache_bytes, f"a temporary as large as the cache: {mem}"
    # one kv head per shard: the kernel cannot load an 8-bit cache of it; the pure JAX form runs
    reason = pa.unsupported_reason((tokens, 2, dim), (blocks, block, 2, dim), jnp.bfloat16, jnp.float8_e4m3fn)
    assert reason is not None and "odd number of kv heads" in reason


# ----------------------------------------------------------------------------- refused


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The harness's Llama (2 layers, 4 kv heads of 16): (folder, transformers model)."""
    folder = tmp_path_factory.mktemp("llama")
    return folder, write_model("llama", folder)


def test_other_quantized_caches_are_refused_at_start_in_one_line(llama):
    """Refused while vLLM builds its configuration (the platform's check), before any engine starts."""
    from vllm import LLM

    with pytest.raises(NotImplementedError) as info:
        LLM(model=str(llama[0]), dtype="float32", max_model_len=512, kv_cache_dtype="fp8_inc")
    message = str(info.value)
    assert "\n" not in message and message.startswith("kv_cache_dtype='fp8_inc' is not supported on tpu"), message
    assert "'fp8'" in message and "'auto'" in message


# ----------------------------------------------------------------------------- vLLM end to end

CACHE_BYTES = 1 << 21  # 2 MiB: 256 blocks of 32 tokens of this model in fp8


@pytest.fixture(scope="module")
def served(llama):
    """An fp8-cache engine on the harness's Llama, one padding bucket (16 tokens)."""
    folder, model = llama
    with engine(folder, kv_cache_dtype="fp8", kv_cache_memory_bytes=CACHE_BYTES, max_num_batched_tokens=16) as llm:
        yield llm, model


def _caches(worker) -> tuple:
    """On the worker: vLLM's KV-cache spec per layer (dtype, page bytes) and the cache tensors."""
    runner = worker.model_runner
    specs = {name: (str(spec.dtype), spec.page_size_bytes) for name, spec in runner.get_kv_cache_spec().items()}
    return specs, [(str(t.dtype), tuple(t.shape), t.nbytes) for t in runner.kv_caches]


def test_the_cache_is_one_byte_per_element(served):
    """vLLM's spec pages count one byte per element, so 2 MiB hold 256 blocks of 32 tokens (64 in
    the model's float32, 128 in bfloat16), and the cache tensors are uint8 of that size."""
    llm, _ = served
    layers, block, kv_heads, head_dim = 2, 32, 4, 16
    page = block * 2 * kv_heads * head_dim  # one layer's block, one byte per element
    (specs, caches) = llm.collective_rpc(_caches)[0]
    assert sorted(specs.values()) == [("torch.uint8", page)] * layers, specs
    assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == CACHE_BYTES // (layers * page) == 256
    assert caches == [("torch.uint8", (256, block, 2 * kv_heads, head_dim), CACHE_BYTES // layers)] * layers


def _fp8_sdpa(module, query, key, value, *args, **kwargs):
    """transformers' sdpa attention over keys and values rounded to e4m3 (scale 1.0, the
    layer's), after the rotary embedding, as vLLM writes them to its cache."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(x):
        return _fp8(x, 1.0, "fp8").to(x.dtype)

    return sdpa_attention_forward(module, query, rounded(key), rounded(value), *args, **kwargs)


def test_logprobs_are_fp8_attentions_and_near_transformers(served):
    """4 prompts (12, 300, 1, 7 tokens; the 300 runs past one 256-position attention chunk) x 12
    greedy tokens with their top-5 logprobs, scored by transformers on vLLM's tokens."""
    from transformers import AttentionInterface
    from vllm import SamplingParams

    llm, model = served
    AttentionInterface.register("torchtpu_fp8_sdpa", _fp8_sdpa)
    rounded = copy.deepcopy(model)
    rounded.set_attn_implementation("torchtpu_fp8_sdpa")
    prompts = random_prompts([12, 300], seed=1) + PROMPTS[:2]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5),
        use_tqdm=False,
    )
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        want = log_softmax(rounded, prompt + tokens)
        plain = log_softmax(model, prompt + tokens)
        for i, (token, top) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            ids = torch.tensor(list(top))
            got = torch.tensor([lp.logprob for lp in top.values()])
            row, plain_row = want[len(prompt) - 1 + i], plain[len(prompt) - 1 + i]
            where = f"prompt of {len(prompt)}, new token {i}"
            # fp8-rounded keys and values in transformers: the same up to float32 rounding (measured 3.4e-5)
            torch.testing.assert_close(got, row[ids], atol=1e-4, rtol=0, msg=lambda m, w=where: f"{w}: {m}")
            margin = row.topk(2).values
            if margin[0] - margin[1] > MIN_MARGIN:
                assert token == int(row.argmax()), f"{where}: not the fp8 oracle's argmax"
            # unquantized transformers: within fp8's effect on these logits (measured 0.29), and
            # the greedy token is its argmax wherever its top two are further apart than that
            worst = max(worst, float((got - plain_row[ids]).abs().max()))
            assert float(plain_row.max() - plain_row[token]) <= 0.5, f"{where}: far from transformers' argmax"
    assert worst <= 0.5, f"logprobs {worst:.3f} from transformers' unquantized log_softmax"
