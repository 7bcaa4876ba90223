"""Bad input stops with vLLM's own error or one line that names the fix."""

from __future__ import annotations

import pytest

from .harness import BOS, EOS, VOCAB, assert_refused_at_start, engine, write_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    write_model("llama", folder)
    return folder


def test_quantization_is_refused_with_the_fix(llama):
    with pytest.raises(ValueError, match=r"quantization='fp8' is not supported on tpu.*serve the unquantized model"):
        with engine(llama, quantization="fp8"):
            pass


def test_quantized_kv_cache_is_refused_with_the_fix(llama):
    """A quantized cache other than fp8 (which serves: test_kv_cache_dtype.py)."""
    with pytest.raises(Exception, match=r"kv_cache_dtype") as info:
        with engine(llama, kv_cache_dtype="int8_per_token_head"):
            pass
    assert "auto" in str(info.value), str(info.value)


def _one_line_start_error(folder, **options) -> str:
    with pytest.raises(ValueError) as info:
        with engine(folder, **options):
            pass
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_a_cache_that_cannot_hold_max_model_len_is_one_line_naming_the_fixes(llama):
    # 4 blocks of 32 tokens (32 KiB each for this model in float32) for max_model_len 512 (16 blocks)
    message = _one_line_start_error(llama, max_model_len=512, kv_cache_memory_bytes=4 * 32 * 1024)
    assert "cannot hold one sequence of max_model_len=512 tokens" in message
    assert "(kv_cache_memory_bytes)" in message
    assert "lower max_model_len" in message and "--kv-cache-memory-bytes" in message


def test_vllm_cpu_kvcache_space_sizes_the_cache_on_xla_cpu_devices(llama, monkeypatch):
    """vLLM-CPU's variable (GiB) is read where the tpu device runs on XLA's CPU devices: 0 GiB
    holds nothing, which the start-up says."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
    message = _one_line_start_error(llama)
    assert "(VLLM_CPU_KVCACHE_SPACE=0) cannot hold one sequence" in message


def test_gpu_memory_utilization_is_a_share_of_memory_for_the_whole_instance(llama):
    """The share covers what the process already holds (its weights and runtime): a share smaller
    than that leaves the cache nothing."""
    import psutil

    share = 64 << 20  # 64 MiB of the host's memory, less than this process holds (torch, jax, vLLM)
    assert psutil.Process().memory_info().rss > share
    util = share / psutil.virtual_memory().total
    message = _one_line_start_error(llama, gpu_memory_utilization=util)
    assert f"(gpu_memory_utilization={util} of the host's memory less this process's" in message


def test_a_cache_larger_than_the_hosts_available_memory_is_refused(llama):
    import psutil

    too_big = psutil.virtual_memory().total * 2
    message = _one_line_start_error(llama, kv_cache_memory_bytes=too_big)
    assert "is more than the host's available memory" in message and "--kv-cache-memory-bytes" in message


def test_an_architecture_without_a_tpu_attention_backend_names_it(tmp_path):
    """DeepSeek's multi-head latent attention (MLA) has no tpu backend: refused when the model is
    built, before any weight is read."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    assert_refused_at_start(config, tmp_path, r"MLA")
