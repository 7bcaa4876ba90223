"""No 64-bit integer and no complex arithmetic in the trainer's TPU step (docs/DESIGN_NOTES.md).

TPUs emulate both; a program input of either kind makes the TPU compiler add X64 split/combine
calls, after which its cost model gives no step-time estimate. The trainer feeds int32 token ids
and does RoPE in real arithmetic; these tests hold the numbers to PyTorch's and scan the
compiled TPU HLO.
"""

import copy
import dataclasses

import numpy as np
import pytest
import torch

from torchtpu.costing import wide_types
from torchtpu.distributed.topology import libtpu_available

needs_libtpu = pytest.mark.skipif(not libtpu_available(), reason="libtpu is not installed")


def _debug_args(**kw):
    from torchtitan.models.llama3 import llama3_args

    return dataclasses.replace(llama3_args["debugmodel"], max_seq_len=64, **kw)


def test_real_rope_equals_torchtitan_complex_rope_on_cpu():
    """use_real_rope changes the arithmetic, not the model: same outputs, gradients and state_dict."""
    from torchtitan.models.llama3 import Transformer

    from torchtpu.models.llama3.rope import RealRopeAttention, use_real_rope

    torch.manual_seed(0)
    ref = Transformer(_debug_args(n_layers=2))
    with torch.no_grad():
        ref.init_weights()
    real = use_real_rope(copy.deepcopy(ref))
    # float32 (cos, sin) pairs kept as int32 bits, so mixed precision does not round them to bf16
    assert real.freqs_cis.dtype == torch.int32 and real.freqs_cis.shape == (*ref.freqs_cis.shape, 2)
    assert all(isinstance(layer.attention, RealRopeAttention) for layer in real.layers.values())
    sd_ref, sd_real = ref.state_dict(), real.state_dict()
    assert list(sd_ref) == list(sd_real) and "freqs_cis" not in sd_real
    tokens = torch.randint(0, ref.vocab_size, (2, 64))
    out_ref, out_real = ref(tokens), real(tokens)
    torch.testing.assert_close(out_real, out_ref, rtol=1e-5, atol=1e-5)
    out_ref.square().mean().backward()
    out_real.square().mean().backward()
    for (name, a), b in zip(ref.named_parameters(), real.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    # init_weights rebuilds the table real, with torchtitan's values
    with torch.no_grad():
        real.init_weights()
    torch.testing.assert_close(real.freqs_cis.view(torch.float32), torch.view_as_real(ref.freqs_cis))
    # a table cast to bf16 (model.to(torch.bfloat16) casts floating buffers) is refused, not used
    with pytest.raises(ValueError, match="bfloat16, not float32"):
        real.layers["0"].attention(torch.randn(1, 8, real.model_args.dim), torch.view_as_real(ref.freqs_cis).bfloat16())


def test_real_rope_refuses_what_it_does_not_implement():
    from torchtitan.models.llama3 import Transformer

    from torchtpu.models.llama3.rope import use_real_rope

    model = use_real_rope(Transformer(_debug_args(n_layers=1)))
    x = torch.randn(1, 8, model.model_args.dim)
    with pytest.raises(NotImplementedError, match="positions"):
        model.layers["0"].attention(x, model.freqs_cis, None, positions=torch.arange(8)[None])
    with pytest.raises(TypeError, match="freqs_cis"):
        use_real_rope(torch.nn.Linear(2, 2))


def test_token_ids_are_int32_and_checked():
    from torchtpu.train.data import token_ids_int32

    ids = np.array([[0, 5, 2047]], dtype=np.int64)
    out = token_ids_int32(ids, 2048)
    assert out.dtype == np.int32 and (out == ids).all()
    with pytest.raises(ValueError, match="token id 2048 is outside"):
        token_ids_int32(np.array([2048]), 2048)
    with pytest.raises(ValueError, match="token id -1 is outside"):
        token_ids_int32(np.array([-1]), 2048)


def test_wide_types_counts_shapes_and_emulation_calls():
    text = (
        "%p = s64[2,128]{1,0} parameter(0)\n%c = c64[8]{0} parameter(1)\n"
        '%x = u32[2,128]{1,0} custom-call(%p), custom_call_target="X64SplitLow"\n%y = f32[] constant(0)'
    )
    counts = wide_types(text)
    assert counts["s64"] == 1 and counts["c64"] == 1 and counts["u64"] == 0 and counts["x64_emulation_calls"] == 1


def _compiled_step_text(tmp_path, *extra, n_layers=None):
    from torchtpu.train.config.manager import load_config
    from torchtpu.train.dry_run.estimate import compile_step
    from torchtpu.train.trainer import Trainer

    cfg = load_config(["--job.dump_folder", str(tmp_path), "--dry-run", "--tpu.topology", "v5p:2x2x1", *extra])
    t = Trainer(cfg, n_layers=n_layers)
    compiled = compile_step(t.built_step())
    return compiled, t


@needs_libtpu
def test_debug_step_for_v5p_has_no_64bit_or_complex_and_gets_an_estimate(tmp_path):
    """The debug model's step for v5p:2x2x1 with what the 8B job (llama3_8b.toml) adds to it: bf16
    parameters, full recomputation, gradient accumulation (4 micro-batches of 1 sequence per chip), 2
    of its 6 blocks under the trainer's layer scan (every block is the same code). The 8B job's own
    32-layer program is compiled by its dry run, whose cost model gives no estimate where the TPU
    compiler emulates 64-bit types."""
    compiled, _ = _compiled_step_text(
        tmp_path,
        "--config",
        "train_configs/debug_model.toml",
        "--activation_checkpoint.mode",
        "full",
        "--training.mixed_precision_param",
        "bfloat16",
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "16",
        n_layers=2,
    )
    text = compiled.as_text()
    assert not any(wide_types(text).values()), wide_types(text)
    assert float(compiled.cost_analysis()["optimal_seconds"]) > 0  # XLA's TPU cost model times the program
