"""`torch.autocast("tpu")` with CUDA's cast policy.

The per-op oracle is PyTorch's own autocast test lists and harness for CUDA
(torch.testing._internal.autocast_test_lists): each op's output dtype is the one CUDA's policy
gives, and its value is bitwise the op run on arguments cast by hand. CPU autocast keeps
softmax, log_softmax, layer_norm, exp/log and sums in bf16 where CUDA (and tpu) use float32, so
models are compared with CPU autocast module by module: equal dtypes wherever the two policies
agree, float32 on tpu exactly where CUDA's policy says so, and loss and gradients within bf16
tolerance.
"""

import pytest
import torch
from torch import nn
from torch.testing._internal.autocast_test_lists import AutocastTestLists, TestAutocast

import torchtpu

# The ops of PyTorch's lists this test runs (each list has more; each op costs an XLA compile or
# three): the families the cast policy is about.
CHECKED = {
    # lower precision
    "conv2d", "addmm", "matmul", "mm", "bmm", "baddbmm", "linear", "__matmul__", "lstm_cell",
    # float32
    "exp", "log", "pow", "softmax", "log_softmax", "layer_norm", "group_norm", "norm", "sum", "cumsum",
    "logsumexp", "mse_loss", "nll_loss", "binary_cross_entropy_with_logits", "__pow__",
    # promotion
    "addcmul", "atan2", "dot", "index_put", "scatter_add",
}  # fmt: skip


def _bf16(value):
    # the lists' float16 arguments become bfloat16: this is bf16 autocast
    if isinstance(value, torch.Tensor):
        return value.to(torch.bfloat16) if value.dtype == torch.float16 else value
    if isinstance(value, (list, tuple)):
        return type(value)(_bf16(v) for v in value)
    return value


def test_every_op_of_pytorchs_autocast_lists_casts_like_cuda():
    lists = AutocastTestLists("tpu")
    harness = TestAutocast("args_maybe_kwargs")
    plans = [
        ("torch_fp16", torch, torch.bfloat16),
        ("nn_fp16", torch._C._nn, torch.bfloat16),
        ("linalg_fp16", torch._C._linalg, torch.bfloat16),
        ("methods_fp16", None, torch.bfloat16),
        ("torch_fp32", torch, torch.float32),
        ("nn_fp32", torch._C._nn, torch.float32),
        ("methods_fp32", None, torch.float32),
        ("torch_need_autocast_promote", torch, torch.float32),
    ]
    checked = set()
    for list_name, module, run_as in plans:
        for entry in getattr(lists, list_name):
            op, args, kwargs = entry if len(entry) == 3 else (*entry, {})
            if op in CHECKED and op not in checked:
                harness._run_autocast_outofplace(
                    op, _bf16(args), run_as, "tpu", module=module, add_kwargs=kwargs, amp_dtype=torch.bfloat16
                )
                checked.add(op)
    assert checked == CHECKED
    ((op, args, module),) = lists.banned
    with torch.autocast("tpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        getattr(module, op)(*args)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _autocast_run(model, device, batch, dtype=torch.bfloat16):
    """Forward and backward under autocast: (output dtype per module, loss, gradients)."""
    model = model.to(device)
    dtypes = {}

    def record(name):
        def hook(module, args, out):
            dtypes.setdefault(name, _dtype(out))

        return hook

    for name, mod in model.named_modules():
        if name:
            mod.register_forward_hook(record(name))
    with torch.autocast(device, dtype=dtype):
        loss = batch(model, device)
    loss.backward()
    return dtypes, loss.detach().cpu(), [p.grad.cpu() for p in model.parameters()]


def _dtype(out):
    return out.dtype if isinstance(out, torch.Tensor) else _dtype(out[0])


def _mlp_batch(model, device):
    torch.manual_seed(1)
    x, y = torch.randn(8, 16).to(device), torch.randint(0, 4, (8,)).to(device)
    out = model(x)
    assert out.dtype == torch.bfloat16
    assert torch.log_softmax(out, -1).dtype == (torch.bfloat16 if device == "cpu" else torch.float32)
    with torch.autocast(device, enabled=False):
        assert (out.float() @ out.float().T).dtype == torch.float32
    return nn.functional.cross_entropy(out, y)


def _compare(cpu, tpu, float32_on_tpu):
    (cpu_dtypes, cpu_loss, cpu_grads), (tpu_dtypes, tpu_loss, tpu_grads) = cpu, tpu
    differ = {n for n in cpu_dtypes if cpu_dtypes[n] != tpu_dtypes[n]}
    assert differ == float32_on_tpu
    assert all(tpu_dtypes[n] == torch.float32 and cpu_dtypes[n] == torch.bfloat16 for n in differ)
    assert torch.bfloat16 in tpu_dtypes.values()
    torch.testing.assert_close(tpu_loss, cpu_loss, rtol=1e-2, atol=1e-2)
    for g_tpu, g_cpu in zip(tpu_grads, cpu_grads):
        torch.testing.assert_close(g_tpu, g_cpu, rtol=2e-2, atol=2e-2 * g_cpu.abs().max().item())


def test_mlp_under_autocast_matches_cpu_autocast():
    cpu = _autocast_run(_mlp(), "cpu", _mlp_batch)
    tpu = _autocast_run(_mlp(), "tpu", _mlp_batch)
    assert tpu[0] == {"0": torch.bfloat16, "1": torch.bfloat16, "2": torch.float32, "3": torch.bfloat16}
    _compare(cpu, tpu, float32_on_tpu={"2"})  # CUDA runs layer_norm in float32, CPU in bf16


def test_transformers_causal_lm_under_autocast_matches_cpu_autocast():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=16,
        attn_implementation="sdpa",
    )

    def model():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg)

    def batch(model, device):
        ids = torch.arange(16).reshape(2, 8).to(device) % 64
        return model(input_ids=ids, labels=ids).loss

    cpu, tpu = _autocast_run(model(), "cpu", batch), _autocast_run(model(), "tpu", batch)
    assert tpu[0]["model.layers.0.self_attn.q_proj"] == tpu[0]["lm_head"] == torch.bfloat16
    # every module's output dtype agrees: Llama's RMSNorm casts to float32 itself, and attention is
    # SDPA, lower precision under both policies
    _compare(cpu, tpu, float32_on_tpu=set())


def test_fp16_grad_scaler_trains_and_skips_overflowing_steps():
    model = _mlp().to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("tpu", init_scale=2.0**20)  # overflows float16 at first
    torch.manual_seed(1)
    x, y = torch.randn(8, 16).to("tpu"), torch.randint(0, 4, (8,)).to("tpu")
    losses, scales = [], []
    for _ in range(10):
        opt.zero_grad()
        with torch.autocast("tpu", dtype=torch.float16):
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
        assert out.dtype == torch.float16 and loss.dtype == torch.float32
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert scales[0] < 2.0**30  # the first step overflowed: skipped, scale backed off
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("compiler", ["torchtpu", "torch"])
def test_autocast_inside_compiled_steps(compiler):
    model = _mlp().to("tpu")
    torch.manual_seed(1)
    x = torch.randn(8, 16).to("tpu")

    def step(x):
        with torch.autocast("tpu", dtype=torch.bfloat16):
            out = model(x)
            return out, torch.softmax(out, -1)

    compiled = torchtpu.compile(step) if compiler == "torchtpu" else torch.compile(step, backend="tpu")
    want = step(x)
    for _ in range(2):
        got = compiled(x)
    assert [t.dtype for t in got] == [torch.bfloat16, torch.float32]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1e-2, atol=1e-2)
