"""Bad input stops with vLLM's own error or one line that names the fix."""

from __future__ import annotations

import pytest

from .harness import BOS, EOS, VOCAB, engine, write_model


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
    with pytest.raises(Exception, match=r"kv_cache_dtype") as info:
        with engine(llama, kv_cache_dtype="fp8"):
            pass
    assert "auto" in str(info.value), str(info.value)


def test_a_cache_that_cannot_hold_max_model_len_is_vllms_error(llama):
    # 4 blocks of 32 tokens (32 KiB each for this model) for max_model_len 512 (16 blocks)
    with pytest.raises(ValueError, match=r"max_model_len|max seq len") as info:
        with engine(llama, max_model_len=512, kv_cache_memory_bytes=4 * 32 * 1024):
            pass
    assert "KV cache" in str(info.value)


def test_an_architecture_without_a_tpu_attention_backend_names_it(tmp_path):
    """DeepSeek's multi-head latent attention (MLA) has no tpu backend: refused when the model is
    built, before any weight is read."""
    from transformers import DeepseekV3Config

    from torchtpu.train.tokenizer import BUNDLED_TOKENIZER

    DeepseekV3Config(
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
    ).save_pretrained(tmp_path)
    import shutil

    shutil.copy(BUNDLED_TOKENIZER, tmp_path / "tokenizer.json")
    with pytest.raises(NotImplementedError, match=r"MLA"):
        with engine(tmp_path, max_model_len=256):
            pass
