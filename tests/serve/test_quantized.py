"""Int8 weight-only (w8a16) checkpoints on tpu: a compressed-tensors checkpoint written here from a
random Llama (every decoder linear weight int8 per output channel, symmetric, pack-quantized)
serves through vLLM's own `CompressedTensorsWNA16` scheme with torchtpu's kernel, and its tokens
and logprobs are those of the dequantized model (int8 x scale, float32) in transformers on CPU.
The kernel alone, per channel and per group, against the dequantized product on CPU; its product
compiled for a TPU reads the int8 weight in the dot. The same under tensor parallelism (TP 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from .harness import MIN_MARGIN, PROMPTS, engine, greedy, log_softmax, write_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (int8 [out, in], float32 scale [out, 1])."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


def _pack(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized words: four (value + 128) bytes per int32, the first lowest."""
    return torch.from_numpy((q.numpy().astype(np.int16) + 128).astype(np.uint8).view("<i4").copy())


def write_w8a16(folder) -> torch.nn.Module:
    """A compressed-tensors w8a16 checkpoint of the harness's Llama in `folder`; returns the
    dequantized transformers model (the oracle)."""
    from safetensors.torch import load_file, save_file

    model = write_model("llama", folder)
    tensors = load_file(folder / "model.safetensors")
    params = dict(model.named_parameters())
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        q, scale = _quantize(tensors.pop(name))
        base = name[: -len(".weight")]
        tensors[f"{base}.weight_packed"] = _pack(q)
        tensors[f"{base}.weight_scale"] = scale
        tensors[f"{base}.weight_shape"] = torch.tensor(q.shape, dtype=torch.int32)
        with torch.no_grad():
            params[name].copy_(q.float() * scale)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
                "input_activations": None,
                "output_activations": None,
            }
        },
    }
    (folder / "config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def w8a16(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_w8a16")
    return folder, write_w8a16(folder)


def _weights(worker) -> dict:
    """On the worker: the dtype and shape of every quantized layer's weight."""
    return {
        name: (str(m.weight_packed.dtype), tuple(m.weight_packed.shape))
        for name, m in worker.model_runner.model.named_modules()
        if hasattr(m, "weight_packed")
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_w8a16_checkpoint_gives_the_dequantized_models_tokens_and_logprobs(w8a16, tp):
    """On one device, and under TP 2 (the packed weights and scales split as plain weights are,
    the fused QKV and gate-up rows in shard-major order)."""
    from vllm import SamplingParams

    folder, model = w8a16
    prompts = PROMPTS[:4]
    with engine(folder, tensor_parallel_size=tp, max_num_batched_tokens=32) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5),
            use_tqdm=False,
        )
        (weights,) = llm.collective_rpc(_weights)
    # qkv, o, gate_up, down in each of 2 layers, held as int8 on tpu
    assert len(weights) == 8 and all(dtype == "torch.int8" for dtype, _ in weights.values()), weights
    for prompt, out in zip(prompts, outs):
        want, margin = greedy(model, prompt, 12)
        assert margin > MIN_MARGIN
        assert list(out.outputs[0].token_ids) == want
        rows = log_softmax(model, prompt + want)
        for i, top in enumerate(out.outputs[0].logprobs):
            ids = torch.tensor(list(top))
            got = torch.tensor([lp.logprob for lp in top.values()])
            # the dequantized weights are exact in float32: the tolerance is float32 rounding
            torch.testing.assert_close(got, rows[len(prompt) - 1 + i][ids], atol=1e-4, rtol=0)


def test_other_quantization_schemes_are_refused_in_one_line(w8a16, tmp_path):
    """An activation-quantized (w8a8) scheme of the same checkpoint: refused at start-up."""
    folder, _ = w8a16
    import shutil

    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"compressed-tensors group 'group_0' with quantized activations is not supported on tpu"
    ):
        with engine(tmp_path):
            pass


def test_the_int8_matmul_reads_int8_weights_on_tpu():
    """The per-channel product compiled ahead of time for a TPU (v6e): the dot's weight operand is
    the int8 array itself (the convert is fused into the MXU's product, not a bfloat16 copy)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from torchtpu.distributed.topology import topology_devices
    from torchtpu.serve.quant import int8_matmul

    on = SingleDeviceSharding(topology_devices("v6e:2x2")[0])
    args = [
        jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16, sharding=on),
        jax.ShapeDtypeStruct((2048, 1024), jnp.int8, sharding=on),
        jax.ShapeDtypeStruct((2048, 1), jnp.bfloat16, sharding=on),
    ]
    compiled = jax.jit(int8_matmul).lower(*args).compile()
    dots = [line for line in compiled.as_text().splitlines() if " convolution(" in line or " dot(" in line]
    assert len(dots) == 1, dots
    operands = dots[0].split("(", 2)[-1]
    names = [name.strip(" %)") for name in operands.split(")")[0].split(",")]
    text = compiled.as_text()
    # the dot's second operand is an s8 value (the weight, relaid out), not a bf16 conversion of it
    weight = next(line for line in text.splitlines() if line.strip().startswith(f"%{names[1]} ="))
    assert "= s8[2048,1024]" in weight, weight
    # the weight is read once, as int8: its bytes, not bfloat16's
    assert compiled.cost_analysis()["bytes accessed1{}"] <= 2048 * 1024 * 1.01


@pytest.mark.parametrize("group_size", [-1, 32])
def test_the_kernel_per_channel_and_per_group_against_dequantized_weights(group_size):
    """TpuW8A16LinearKernel on tpu tensors (unpacking included) against x @ (q x scale).T on CPU."""
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    from vllm.scalar_type import scalar_types

    from torchtpu.serve.quant import TpuW8A16LinearKernel

    g = torch.Generator().manual_seed(0)
    out, cols = 48, 128
    q = torch.randint(-127, 128, (out, cols), generator=g, dtype=torch.int8)
    groups = 1 if group_size == -1 else cols // group_size
    scale = torch.rand(out, groups, generator=g) / 100
    x = torch.randn(5, cols, generator=g)
    config = MPLinearLayerConfig((cols, out), (cols, out), scalar_types.uint8b128, torch.float32, group_size, False)
    kernel = TpuW8A16LinearKernel(config, "weight_packed", "weight_scale")
    layer = torch.nn.Module()
    layer.register_parameter("weight_packed", torch.nn.Parameter(_pack(q).to("tpu"), requires_grad=False))
    layer.register_parameter("weight_scale", torch.nn.Parameter(scale.to("tpu"), requires_grad=False))
    kernel.process_weights_after_loading(layer)
    assert torch.equal(layer.weight_packed.cpu(), q)
    got = kernel.apply_weights(layer, x.to("tpu")).cpu()
    want = x @ (q.float().reshape(out, groups, -1) * scale.unsqueeze(-1)).reshape(out, cols).T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
