"""F.scaled_dot_product_attention through JAX's Pallas TPU flash-attention kernels.

Numerics run the kernels in Pallas interpret mode on CPU against PyTorch's own SDPA on CPU
(forward and the gradients of q, k and v). Compilation for a TPU topology (libtpu, ahead of
time) checks that a train step really contains the kernels, and that their declared costs
reach XLA's cost analysis.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401
from torchtpu.backend.ops import attention_kernels, attention_tpu
from torchtpu.backend.ops import nn as nn_ops


def _inputs(b, h, hkv, lq, lk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in ((b, h, lq, d), (b, hkv, lk, d), (b, hkv, lk, d))]


def _run(device, q, k, v, **kw):
    leaves = [t.to(device).detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, **kw)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(device)
    (out * weights).sum().backward()
    return [t.detach().cpu() for t in (out, *(x.grad for x in leaves))]


def _masks(kind, b, h, lq, lk):
    g = torch.Generator().manual_seed(7)
    if kind is None:
        return None
    if kind == "bool":
        m = torch.rand(b, 1, lq, lk, generator=g) > 0.3
        m[:, :, :, 0] = True  # every row keeps a key (fully masked rows are tested on their own)
        return m
    bias = torch.randn(1, h, lq, lk, generator=g)  # additive float mask, with some -inf
    bias[..., 5:9] = float("-inf")
    return bias


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_kernels_match_torch_cpu(causal, heads, mask):
    h, hkv = heads
    b, lq, lk, d = 2, 128, 256, 64
    q, k, v = _inputs(b, h, hkv, lq, lk, d)
    kw = dict(is_causal=causal, enable_gqa=hkv != h)
    m = _masks(mask, b, h, lq, lk)
    if m is not None:
        kw["attn_mask"] = m
    want = _run("cpu", q, k, v, **kw)
    with attention_tpu.interpret_kernels():
        got = _run("tpu", q, k, v, **kw)
    for name, w, g in zip(("out", "dq", "dk", "dv"), want, got):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-4, msg=lambda s, name=name: f"{name}: {s}")


@pytest.mark.parametrize("mode", ["one-pass", "two-kernel"])
@pytest.mark.parametrize("lq, lk", [(384, 384), (512, 384), (384, 768)], ids=str)
def test_several_blocks_per_row_and_column_match_torch_cpu(lq, lk, mode, monkeypatch):
    """Several query and key blocks of different sizes (128 x 128, 512 x 128, 128 x 256), causal,
    four query heads on two key/value heads, with either backward: the one-pass kernel (dQ of a
    whole query head and dK/dV of a whole key/value head accumulated across the grid) or the dK/dV
    and dQ kernels. The key/value gradients sum each group's query heads over all their query
    blocks, and causally skipped block pairs are skipped in every kernel."""
    monkeypatch.setenv("TORCHTPU_FLASH_BACKWARD", mode)
    q, k, v = _inputs(1, 4, 2, lq, lk, 64, seed=17)
    kw = dict(is_causal=True, enable_gqa=True)
    want = _run("cpu", q, k, v, **kw)
    with attention_tpu.interpret_kernels():
        got = _run("tpu", q, k, v, **kw)
    for name, w, g in zip(("out", "dq", "dk", "dv"), want, got):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-4, msg=lambda s, name=name: f"{name}: {s}")


def test_bf16_kernels_match_torch_cpu():
    q, k, v = (t.bfloat16() for t in _inputs(1, 2, 2, 256, 256, 128, seed=3))
    want = _run("cpu", q, k, v, is_causal=True)
    with attention_tpu.interpret_kernels():
        got = _run("tpu", q, k, v, is_causal=True)
    for w, g in zip(want, got):
        torch.testing.assert_close(g.float(), w.float(), atol=3e-2, rtol=3e-2)


def test_padded_head_dims_match_torch_cpu():
    """DeepSeek-V3's multi-head latent attention (q/k head dim 192, v 128): the kernels run on
    operands zero-padded to 256, with the softmax scale of 192, and give PyTorch's output and
    gradients."""
    b, h, L, d, dv = 1, 2, 128, 192, 128
    g = torch.Generator().manual_seed(13)
    q, k = (torch.randn(b, h, L, d, generator=g) for _ in range(2))
    v = torch.randn(b, h, L, dv, generator=g)
    assert attention_tpu.unsupported_reason(q.shape, k.shape, v.shape, jnp.float32) is None
    assert attention_tpu.padded_head_dim(d, dv) == 256
    want = _run("cpu", q, k, v, is_causal=True)
    with attention_tpu.interpret_kernels():
        got = _run("tpu", q, k, v, is_causal=True)
    assert [t.shape for t in got] == [t.shape for t in want]
    for name, w, g in zip(("out", "dq", "dk", "dv"), want, got):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-4, msg=lambda s, name=name: f"{name}: {s}")


def test_fully_masked_rows_give_zeros_and_no_gradient():
    """A query row with no key to attend to gives 0 (not the mean of v), as the blocked path
    does, and passes no gradient on."""
    b, h, lq, lk, d = 1, 2, 128, 128, 64
    q, k, v = _inputs(b, h, h, lq, lk, d, seed=5)
    mask = torch.ones(lq, lk, dtype=torch.bool)
    mask[3] = False
    mask[70] = False
    blocked = _run("tpu", q, k, v, attn_mask=mask)
    with attention_tpu.interpret_kernels():
        got = _run("tpu", q, k, v, attn_mask=mask)
    assert torch.all(got[0][:, :, 3] == 0) and torch.all(got[0][:, :, 70] == 0)
    assert torch.all(got[1][:, :, 3] == 0)
    for w, g in zip(blocked, got):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-4)
    keep = mask.clone()
    keep[3] = keep[70] = True
    rows = [i for i in range(lq) if i not in (3, 70)]
    want = _run("cpu", q, k, v, attn_mask=keep)  # the other rows are PyTorch's
    torch.testing.assert_close(got[0][:, :, rows], want[0][:, :, rows], atol=2e-5, rtol=2e-4)


def _pallas_calls(fn, *args):
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


def test_lowering_uses_kernel_only_where_it_applies():
    q = jnp.zeros((1, 4, 256, 128), jnp.float32)
    kv = jnp.zeros((1, 2, 256, 128), jnp.float32)

    def fwd(q, k, v):
        return nn_ops._sdpa_overrideable(q, k, v, None, 0.0, True)[:2]

    # compiled for TPU: the kernel, selected per platform when the program is lowered
    jaxpr = str(jax.make_jaxpr(fwd)(q, kv, kv))
    assert "platform_index" in jaxpr and jaxpr.count("pallas_call") == 1
    # ... and lowered for CPU, the blocked JAX path only
    assert "tpu_custom_call" not in jax.jit(fwd).lower(q, kv, kv).as_text()
    # shapes the kernel does not take: no kernel at all
    odd = jnp.zeros((1, 4, 200, 128), jnp.float32)
    assert _pallas_calls(fwd, odd, odd, odd) == 0
    small_head = jnp.zeros((1, 4, 256, 16), jnp.float32)
    assert _pallas_calls(fwd, small_head, small_head, small_head) == 0
    # q/k head dim 192 and v 128 (multi-head latent attention): the kernel, at head dim 256
    qk, v = jnp.zeros((1, 4, 128, 192), jnp.float32), jnp.zeros((1, 4, 128, 128), jnp.float32)
    jaxpr = str(jax.make_jaxpr(fwd)(qk, qk, v))
    assert jaxpr.count("pallas_call") == 1 and "f32[1,4,128,256]" in jaxpr
    assert jax.eval_shape(fwd, qk, qk, v)[0].shape == (1, 4, 128, 128)
    assert attention_tpu.unsupported_reason((1, 4, 256, 512), (1, 4, 256, 512), (1, 4, 256, 512), jnp.float32)
    assert attention_tpu.unsupported_reason((1, 4, 200, 128), (1, 4, 200, 128), (1, 4, 200, 128), jnp.float32)
    assert attention_tpu.unsupported_reason((1, 4, 256, 128), (1, 4, 256, 128), (1, 4, 256, 128), jnp.float64)


def test_unsupported_shapes_fall_back_with_torch_numerics():
    q, k, v = _inputs(1, 2, 2, 100, 100, 64)
    want = _run("cpu", q, k, v, is_causal=True)
    with attention_tpu.interpret_kernels():
        got = _run("tpu", q, k, v, is_causal=True)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-4)


def test_declared_costs():
    c = attention_tpu.kernel_costs(4, 8, 2048, 2048, 128, causal=False)
    mm = 2 * 4 * 8 * 2048 * 2048 * 128
    assert c["forward"].flops == 2 * mm and c["backward_dkv"].flops == 4 * mm and c["backward_dq"].flops == 3 * mm
    assert c["backward"].flops == 5 * mm  # the scores and their gradient once for dQ, dK and dV
    causal = attention_tpu.kernel_costs(4, 8, 2048, 2048, 128, causal=True)
    # 512-blocks: 10 of the 16 block pairs are on or below the diagonal
    assert causal["forward"].flops == int(2 * mm * 10 / 16)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv_split", "kv_repeated"])
def test_sharded_program_runs_kernels_per_shard(kv_heads):
    """Inside a compiled program over a (dp_shard 4, tp 2) mesh of CPU devices the kernels run
    per shard (batch over dp_shard, heads over tp) and give the unsharded values; with one
    key/value head, which tp 2 cannot split, k and v are repeated per query head first."""
    from torchtpu.distributed import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("tpu", (4, 2), mesh_dim_names=("dp_shard", "tp"))
    q, k, v = _inputs(4, 4, kv_heads, 128, 128, 64, seed=11)
    kw = dict(is_causal=True, enable_gqa=True)
    want = _run("cpu", q, k, v, **kw)
    weights = torch.linspace(-1, 1, q.numel()).reshape(q.shape)

    def step(q, k, v, w):
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        grads = torch.autograd.grad((out * w).sum(), (q, k, v))
        return (out.detach(),) + grads

    heads = (Shard(0), Shard(1))
    kv = heads if kv_heads == 2 else (Shard(0), Replicate())
    placed = [distribute_tensor(t, mesh, p).requires_grad_() for t, p in ((q, heads), (k, kv), (v, kv))]
    w = distribute_tensor(weights, mesh, heads)
    compiled = torchtpu.compile(step)
    with attention_tpu.interpret_kernels():
        compiled(*placed, w)  # eager warm-up
        got = [t.cpu() for t in compiled(*placed, w)]  # traced over the mesh
    assert compiled.stats.traces == 1
    assert "shard_map" in compiled.as_text(optimized=False) or "manual_computation" in compiled.as_text(optimized=False)
    for name, a, b in zip(("out", "dq", "dk", "dv"), want, got):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=2e-4, msg=lambda m, name=name: f"{name}: {m}")


# ----------------------------------------------------------------------------- TPU compilation


def _topology_devices(name="v5p:2x2x1"):
    from torchtpu.distributed import topology as topo

    if not topo.libtpu_available():
        pytest.skip("libtpu is not installed (pip install 'torchtpu[tpu]')")
    return topo.topology_devices(name)


@pytest.mark.parametrize(
    "topology, d, dv, mode, backward",
    [
        ("v5p:2x2x1", 128, 128, "auto", ["backward"]),
        ("v6e:2x2", 128, 128, "auto", ["backward"]),
        ("v5p:2x2x1", 192, 128, "auto", ["backward"]),
        ("v5p:2x2x1", 128, 128, "two-kernel", ["backward_dkv", "backward_dq"]),
        ("v4:2x2x1", 128, 128, "auto", ["backward_dkv", "backward_dq"]),
    ],
    ids=str,
)
def test_declared_costs_reach_xla_cost_analysis(topology, d, dv, mode, backward, monkeypatch):
    """The forward and the backward kernels compile for v5p, v6e and v4 chips and are counted by
    XLA's TPU cost analysis; q/k head dim 192 with v 128 compiles zero-padded to 256, costed so.
    The backward is the one-pass kernel where the chip's VMEM holds its accumulators (v5p, v6e),
    the dK/dV and dQ kernels on v4 (16 MiB of VMEM) or when asked for."""
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from torchtpu.distributed import topology as topo

    monkeypatch.setenv("TORCHTPU_FLASH_BACKWARD", mode)
    mesh = jax.sharding.Mesh(np.array(_topology_devices(topology)[:1]), ("x",))  # one chip, its kind known
    b, h, L = 2, 4, 1024

    def sds(dim):
        return jax.ShapeDtypeStruct((b, h, L, dim), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

    def step(q, k, v, g):
        out, lse = attention_tpu.attention_forward(q, k, v, causal=True, scale=0.1)
        return attention_tpu.attention_backward(g, q, k, v, out, lse, causal=True, scale=0.1)

    compiled = topo.aot_compile(jax.jit(step).lower(sds(d), sds(d), sds(dv), sds(dv)))
    hlo = compiled.as_text()
    assert hlo.count('custom_call_target="tpu_custom_call"') == 1 + len(backward)
    assert _kernel_calls(hlo) == {"forward": 1, **{n.removeprefix("backward_") or n: 1 for n in backward}}
    c = attention_tpu.kernel_costs(b, h, L, L, attention_tpu.padded_head_dim(d, dv), causal=True)
    declared = sum(c[n].flops for n in ["forward", *backward])
    flops = compiled.cost_analysis()["flops"]
    assert declared <= flops <= 1.05 * declared, (flops, declared)


def _llama_step_for(mesh, seq=256):
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    from torchtpu.distributed import empty, materialize
    from torchtpu.models.llama3 import parallelize_llama
    from torchtpu.models.llama3.parallelize import batch_placements

    with torch.device("meta"):  # head_dim 128, 2 kv heads for 4 query heads (GQA)
        model = Transformer(
            TransformerModelArgs(dim=512, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=seq)
        )
    parallelize_llama(
        model,
        mesh,
        sequence_parallel=False,
        loss_parallel=False,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
    )
    materialize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), capturable=True, foreach=True)

    def step(inp, lab):
        loss = F.cross_entropy(model(inp).flatten(0, 1).float(), lab.flatten(0, 1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    inp = empty((4, seq), torch.int64, mesh=mesh, placements=batch_placements(mesh))
    lab = empty((4, seq), torch.int64, mesh=mesh, placements=batch_placements(mesh))
    return torchtpu.compile(step).compile_for(inp, lab)


_KERNEL = 'custom_call_target="tpu_custom_call"'


def _kernel_calls(hlo: str) -> dict:
    """How many of each flash kernel the program calls, by the instruction names XLA gives them."""
    kinds = {name: kind for kind, name in attention_kernels.KERNEL_NAMES.items()}
    counts = {}
    for line in hlo.splitlines():
        if _KERNEL in line:
            name = re.sub(r"\.\d+$", "", line.split("=")[0].split()[-1].lstrip("%"))
            counts[kinds[name]] = counts.get(kinds[name], 0) + 1
    return counts


def test_tpu_step_contains_kernels_and_cpu_step_does_not():
    """A small Llama (torchtitan's model, FSDP x TP over v5p:2x2x1) compiled ahead of time for
    TPU runs one forward and one (one-pass) backward kernel per layer, each on its shard (batch
    over dp_shard, heads over tp); the same step compiled for CPU has no kernel."""
    from torchtpu.distributed import init_device_mesh

    devices = _topology_devices()
    mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp_shard", "tp"), devices=devices)
    hlo = _llama_step_for(mesh).as_text()
    assert _kernel_calls(hlo) == {"forward": 2, "backward": 2}
    # per shard: batch 4 / dp_shard 2, query heads 4 / tp 2, key/value heads 2 / tp 2: the
    # backward gives the query heads' gradient and the key/value heads' (k and v are not
    # repeated per query head)
    results = [line.split(" custom-call(")[0] for line in hlo.splitlines() if _KERNEL in line]
    bwd = [r for r in results if attention_kernels.KERNEL_NAMES["backward"] in r]
    assert all(r.count("bf16[2,1,256,128]") == 2 and r.count("bf16[2,2,256,128]") == 1 for r in bwd), bwd
    assert all("bf16[2,2,256,128]" in r for r in results if r not in bwd), results
    fwd = [r for r in results if attention_kernels.KERNEL_NAMES["forward"] in r]
    assert len(fwd) == 2 and all("f32[2,2,1,256]" in r for r in fwd), fwd  # the log-sum-exp as one row

    cpu_mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp_shard", "tp"), devices=jax.devices("cpu")[:4])
    cpu_hlo = _llama_step_for(cpu_mesh).as_text()
    assert "tpu_custom_call" not in cpu_hlo and "torchtpu_flash" not in cpu_hlo


def test_kernels_split_by_the_mesh_of_their_inputs():
    """Outside torchtpu.compile (a plain jit over mesh-sharded arrays, as eager ops and
    torch.compile run), the mesh recorded in the inputs' types splits the kernels: a Mosaic
    kernel cannot be partitioned by XLA, so without it this would not compile."""
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from torchtpu.distributed import topology as topo

    mesh = jax.sharding.Mesh(np.array(_topology_devices()).reshape(2, 2), ("dp_shard", "tp"))
    x = jax.ShapeDtypeStruct((4, 4, 256, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("dp_shard", "tp")))

    def step(q, k, v, g):
        out, lse = attention_tpu.attention_forward(q, k, v, causal=True, scale=0.1)
        return attention_tpu.attention_backward(g, q, k, v, out, lse, causal=True, scale=0.1)

    hlo = topo.aot_compile(jax.jit(step).lower(x, x, x, x)).as_text()
    assert _kernel_calls(hlo) == {"forward": 1, "backward": 1}
    results = [line.split(" custom-call(")[0] for line in hlo.splitlines() if _KERNEL in line]
    assert all("bf16[2,2,256,128]" in r for r in results), results
    assert "all-gather" not in hlo
