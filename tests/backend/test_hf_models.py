"""Hugging Face `transformers` models, code nobody here wrote, on tpu: eager and
`torch.compile(backend="tpu")`, against PyTorch on CPU.

Models are built from tiny configs (hidden 32, 2 layers; no downloads) in their default
configuration otherwise (KV cache objects, tied embeddings), with attention through
`attn_implementation="sdpa"` (T5 has only its eager attention) and dropout 0 so that train
mode is deterministic. Tolerances (float32): logits and every parameter's gradient within
rtol 1e-5 / atol 1e-5 of CPU; greedy tokens exactly equal.
"""

import copy

import pytest
import torch

import torchtpu

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

RTOL = ATOL = 1e-5
VOCAB = 64


def _gpt2():
    cfg = transformers.GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=1,
        attn_implementation="sdpa",
    )
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(3, VOCAB, (2, 8))
    return model, {"input_ids": ids, "labels": ids}, ("lm_head.weight", "transformer.wte.weight")


def _llama_config(eos_token_id=1):
    """Llama with grouped-query attention: 4 query heads share 2 key/value heads."""
    return transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=eos_token_id,
        pad_token_id=2,
        attn_implementation="sdpa",
    )


def _llama_gqa():
    model = transformers.LlamaForCausalLM(_llama_config())
    ids = torch.randint(3, VOCAB, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on the second row
    return model, {"input_ids": ids, "attention_mask": mask, "labels": ids}, None


def _bert():
    cfg = transformers.BertConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    model = transformers.BertForMaskedLM(cfg)
    ids = torch.randint(3, VOCAB, (2, 8))
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    labels[0, 5] = ids[0, 5]
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return (
        model,
        {"input_ids": ids, "attention_mask": mask, "labels": labels},
        ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
    )


def _t5():
    cfg = transformers.T5Config(
        d_model=32,
        d_ff=64,
        d_kv=16,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        vocab_size=VOCAB,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = transformers.T5ForConditionalGeneration(cfg)
    ids = torch.randint(3, VOCAB, (2, 8))
    return (
        model,
        {"input_ids": ids, "labels": torch.randint(3, VOCAB, (2, 5))},
        ("shared.weight", "encoder.embed_tokens.weight"),
    )


MODELS = {"gpt2_tied": _gpt2, "llama_gqa": _llama_gqa, "bert_mlm": _bert, "t5": _t5}


def _step(model, inputs):
    out = model(**inputs)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach()


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_every_gradient_match_cpu(name, mode):
    torch.manual_seed(0)
    cpu, inputs, tied = MODELS[name]()
    cpu.train()
    tpu = copy.deepcopy(cpu).to("tpu")
    if tied is not None:  # the tie survives the move: one Parameter object, one gradient
        a, b = (tpu.get_parameter(n) for n in tied)
        assert a is b
    ref_logits, ref_loss = _step(cpu, inputs)
    run = tpu
    if mode == "compile":
        torch._dynamo.reset()
        run = torch.compile(tpu, backend="tpu")
    logits, loss = _step(run, {k: v.to("tpu") for k, v in inputs.items()})
    assert logits.device.type == "tpu"
    torch.testing.assert_close(logits.cpu(), ref_logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss.cpu(), ref_loss, rtol=RTOL, atol=ATOL)
    cpu_params = dict(cpu.named_parameters())
    checked = 0
    for n, p in tpu.named_parameters():
        q = cpu_params[n]
        assert (p.grad is None) == (q.grad is None), (
            f"{n}: tpu grad {p.grad is not None}, cpu grad {q.grad is not None}"
        )
        if q.grad is not None:
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
            checked += 1
    assert checked == len(cpu_params) or name == "bert_mlm"  # BERT's pooler is unused by the MLM loss
    if mode == "compile":
        assert torchtpu.cache_stats()["dynamo_graph_calls"] > 0


def _generation_model():
    torch.manual_seed(1)
    # no end-of-sequence token: every row generates all its new tokens
    model = transformers.LlamaForCausalLM(_llama_config(eos_token_id=None)).eval()
    prompt = torch.randint(3, VOCAB, (2, 6))
    return model, prompt


GREEDY = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)


def test_greedy_generate_with_kv_cache_eager():
    cpu, prompt = _generation_model()
    expected = cpu.generate(prompt, **GREEDY)
    tpu = copy.deepcopy(cpu).to("tpu")
    tokens = tpu.generate(prompt.to("tpu"), **GREEDY)  # default DynamicCache
    assert tokens.shape == (2, 6 + 16)
    assert torch.equal(tokens.cpu(), expected)


def test_greedy_generate_compiled_static_cache():
    cpu, prompt = _generation_model()
    expected = cpu.generate(prompt, **GREEDY)
    tpu = copy.deepcopy(cpu).to("tpu")
    torch._dynamo.reset()
    before = torchtpu.cache_stats()
    tpu.forward = torch.compile(tpu.forward, backend="tpu")
    tokens = tpu.generate(prompt.to("tpu"), cache_implementation="static", **GREEDY)
    after = torchtpu.cache_stats()
    assert torch.equal(tokens.cpu(), expected)
    # one graph for the prompt, one for every decode step (fixed shapes with a static cache)
    assert after["dynamo_compiles"] - before["dynamo_compiles"] == 2
    assert after["dynamo_graph_calls"] - before["dynamo_graph_calls"] == 16
