"""Mixture-of-experts models served by vLLM's own model code on tpu: Qwen3-MoE (vLLM's
`Qwen3MoeForCausalLM` and its `FusedMoE` layer, 8 experts, top-2, renormalised) gives
transformers' greedy tokens on one device and under tensor parallelism, where its experts lie
split on their intermediate dim as vLLM's FusedMoE splits them over its ranks. Expert parallelism and
gpt-oss (attention sinks) are refused at start-up. The counting sort that groups the rows by expert
equals a stable argsort and has a time in XLA's TPU cost model."""

from __future__ import annotations

import pytest
import torch

from .harness import MIN_MARGIN, NEW_TOKENS, PROMPTS, assert_refused_at_start, engine, greedy, write_model


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_moe")
    return folder, write_model("qwen3_moe", folder)


def _experts_layout(worker) -> dict:
    """On the worker: each MoE layer's method and its experts' partition specs and device counts."""
    from torchtpu import to_jax

    out = {}
    for name, module in worker.model_runner.model.named_modules():
        if hasattr(module, "w13_weight"):
            specs = {}
            for p in ("w13_weight", "w2_weight"):
                s = to_jax(getattr(module, p)).sharding
                spec = tuple(getattr(s, "spec", ()))
                specs[p] = (spec + (None,) * (3 - len(spec)), len(s.device_set))
            out[name] = (type(module.quant_method).__name__, specs)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_moe_gives_transformers_greedy_tokens(qwen3_moe, tp):
    from vllm import SamplingParams

    folder, model = qwen3_moe
    with engine(folder, tensor_parallel_size=tp, max_num_batched_tokens=32) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        (layout,) = llm.collective_rpc(_experts_layout)
    assert len(layout) == 2, layout  # one FusedMoE layer per decoder layer
    for name, (method, specs) in layout.items():
        assert method == "TpuFusedMoEMethod", (name, method)
        if tp > 1:  # w13 [experts, 2 x inter, hidden] and w2 [experts, hidden, inter] split on inter
            assert specs["w13_weight"] == ((None, "tp", None), tp), (name, specs)
            assert specs["w2_weight"] == ((None, None, "tp"), tp), (name, specs)
    for prompt, out in zip(PROMPTS, outs):
        want, margin = greedy(model, prompt)
        assert margin > MIN_MARGIN
        assert list(out.outputs[0].token_ids) == want, f"tp={tp}, prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_is_vllms(renormalize):
    """The tpu method's top-k routing against vLLM's plain-torch router (its CPU router, the
    reference of its fused top-k softmax kernels): the same experts with the same weights."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk

    from torchtpu.serve.moe import route

    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(0))
    want_w, want_ids = _softmax_topk(logits, 2, renormalize)
    got_w, got_ids = route(logits.to("tpu"), 2, renormalize)
    got_w, got_ids = got_w.cpu(), got_ids.cpu()
    # vLLM's reference returns the top k unsorted: compare each token's (expert, weight) pairs
    want = sorted(zip(want_ids.flatten().tolist(), want_w.flatten().tolist()))
    got = sorted(zip(got_ids.flatten().tolist(), got_w.flatten().tolist()))
    assert [i for i, _ in got] == [i for i, _ in want]
    torch.testing.assert_close(torch.tensor([w for _, w in got]), torch.tensor([w for _, w in want]))


def test_expert_parallelism_is_refused_naming_it(qwen3_moe):
    """Refused when vLLM checks its configuration, before any model is built."""
    folder, _ = qwen3_moe
    with pytest.raises(ValueError, match=r"expert parallelism \(enable_expert_parallel / --enable-expert-parallel\)"):
        with engine(folder, tensor_parallel_size=2, enable_expert_parallel=True):
            pass


def test_gpt_oss_is_refused_naming_its_attention_sinks(tmp_path):
    """gpt-oss's attention has sinks, which the tpu attention backend does not compute: refused
    when the model is built, before any weight is read."""
    from transformers import GptOssConfig

    from .harness import BOS, EOS, VOCAB

    config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    assert_refused_at_start(config, tmp_path, r"paged attention does not support sinks")


def test_expert_order_is_a_stable_sort_by_expert_that_xla_can_time_on_tpu():
    """`_expert_order` (the counting sort of the (token, k) rows by expert) equals PyTorch's stable
    argsort on CPU, on tpu, and compiled ahead of time for v6e its program has a time in XLA's cost
    model, which PyTorch's 64-bit argsort and scatter-add indices left without one (the MoE serving
    dry run's step estimate depends on it)."""
    from torch.distributed.tensor import Replicate

    import torchtpu
    from torchtpu.distributed import empty, init_device_mesh, topology
    from torchtpu.serve.moe import _expert_order

    gen = torch.Generator().manual_seed(0)
    flat = torch.randint(0, 16, (300,), generator=gen, dtype=torch.int32)
    want = flat.long().argsort(stable=True)
    for device in ("cpu", "tpu"):
        pos, order, ends = (t.cpu() for t in _expert_order(flat.to(device), 16))
        assert torch.equal(order.long(), want) and torch.equal(pos.long(), want.argsort()), device
        assert torch.equal(ends.long(), torch.bincount(flat.long(), minlength=16).cumsum(0)), device

    if not topology.libtpu_available():
        pytest.skip("libtpu is not installed (pip install 'torchtpu[tpu]')")
    mesh = init_device_mesh("tpu", (1,), mesh_dim_names=("tp",), devices=topology.topology_devices("v6e:2x2")[:1])
    ids = empty((64 * 8,), torch.int32, mesh=mesh, placements=[Replicate()])
    with topology.costing_compiles(mesh.jax_mesh):
        compiled = torchtpu.compile(lambda f: _expert_order(f, 128)).compile_for(ids)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert float(cost["optimal_seconds"]) > 0, cost
