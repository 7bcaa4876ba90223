"""The Mixture-of-Experts ops on the tpu device: `torch._grouped_mm` (megablox's kernels on TPU,
grouped_mm_blocked's loops over row tiles elsewhere) and `torch.histc` of integer expert ids, with
PyTorch on CPU as the oracle.

The grouped matmul is checked against a Python loop over the groups on the CPU (one matmul per
expert over the rows it received), forward and gradients, in bfloat16, with empty
groups and rows past the last group; and torchtitan's own expert function
(`_run_experts_grouped_mm`, what its MoE layer calls) against the same loop.
"""

from __future__ import annotations

import contextlib

import jax
import pytest
import torch

import torchtpu  # noqa: F401
from tests.conftest import assert_close_to_cpu

# (M, K) x (G, K, N) with groups of 5, 0, 25, 8 rows and 2 rows past the last group
ENDS = [5, 5, 30, 38]
M, K, N = 40, 16, 32


def _loop(x, w, ends):
    """The oracle: one CPU matmul per group, rows past the last group left out."""
    starts = [0] + ends[:-1]
    return torch.cat([x[s:e] @ w[g] for g, (s, e) in enumerate(zip(starts, ends))])


def test_grouped_mm_matches_a_loop_over_groups():
    """bfloat16 (the dtype PyTorch's grouped matmul takes on accelerators) against a float32 loop."""
    dtype = torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(M, K, dtype=dtype, requires_grad=True)
    w = torch.randn(len(ENDS), N, K, dtype=dtype, requires_grad=True)  # stored as torchtitan's experts are
    grad = torch.randn(ENDS[-1], N, dtype=dtype)
    ref = _loop(x.float(), w.float().transpose(-2, -1), ENDS)
    ref.backward(grad.float())

    xt = x.detach().to("tpu").requires_grad_()
    wt = w.detach().to("tpu").requires_grad_()
    offs = torch.tensor(ENDS, dtype=torch.int32).to("tpu")
    out = torch._grouped_mm(xt, wt.transpose(-2, -1), offs=offs)
    assert out.shape == (M, N) and out.dtype == dtype
    out[: ENDS[-1]].backward(grad.to("tpu"))
    tol = dict(rtol=1e-2, atol=1e-2)  # float32 accumulation, one bfloat16 rounding of each output
    assert_close_to_cpu(out[: ENDS[-1]].float(), ref.detach(), "output", **tol)
    assert_close_to_cpu(out[ENDS[-1] :].float(), torch.zeros(M - ENDS[-1], N), "rows past the last group", **tol)
    assert_close_to_cpu(xt.grad[: ENDS[-1]].float(), x.grad[: ENDS[-1]].float(), "grad x", **tol)
    assert_close_to_cpu(xt.grad[ENDS[-1] :].float(), torch.zeros(M - ENDS[-1], K), "grad x past the groups", **tol)
    assert_close_to_cpu(wt.grad.float(), w.grad.float(), "grad w", **tol)
    assert torch.count_nonzero(wt.grad[1].cpu()) == 0  # the empty group's expert gets no gradient


def test_bfloat16_grouped_mm_equals_pytorch_cpu_kernel():
    """bfloat16 in, bfloat16 out: the same numbers as PyTorch's own CPU _grouped_mm, gradients included."""
    torch.manual_seed(1)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(len(ENDS), N, K, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    ref = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    grad = torch.randn(M, N, dtype=torch.bfloat16)
    grad[ENDS[-1] :] = 0
    ref.backward(grad)
    xt, wt = (t.detach().to("tpu").requires_grad_() for t in (x, w))
    out = torch._grouped_mm(xt, wt.transpose(-2, -1), offs=offs.to("tpu"))
    out.backward(grad.to("tpu"))
    exact = dict(rtol=0, atol=0)
    assert_close_to_cpu(out[: ENDS[-1]], ref[: ENDS[-1]].detach(), "output", **exact)
    assert_close_to_cpu(xt.grad[: ENDS[-1]], x.grad[: ENDS[-1]], "grad x", **exact)
    assert_close_to_cpu(wt.grad, w.grad, "grad w", **exact)


def test_torchtitan_experts_match_a_loop_over_experts():
    """torchtitan's grouped-matmul experts (SwiGLU over each expert's tokens, bfloat16) on tpu equal
    the same SwiGLU computed expert by expert on the CPU, forward and gradients."""
    from torchtitan.models.moe.moe import _run_experts_grouped_mm

    torch.manual_seed(2)
    E, H = 4, 24
    counts = torch.tensor([7, 0, 20, 13])
    x = torch.randn(int(counts.sum()), K, requires_grad=True)
    ws = [torch.randn(E, H, K) * 0.2, torch.randn(E, K, H) * 0.2, torch.randn(E, H, K) * 0.2]
    ws = [w.requires_grad_() for w in ws]
    grad = torch.randn(int(counts.sum()), K)

    def loop(x, w1, w2, w3):
        ends = counts.cumsum(0).tolist()
        starts = [0] + ends[:-1]
        outs = []
        for e, (s, t) in enumerate(zip(starts, ends)):
            xe = x[s:t].bfloat16()
            h = torch.nn.functional.silu(xe @ w1[e].bfloat16().T) * (xe @ w3[e].bfloat16().T)
            outs.append(h @ w2[e].bfloat16().T)
        return torch.cat(outs).float()

    ref = loop(x, *ws)
    ref.backward(grad)
    xt = x.detach().to("tpu").requires_grad_()
    wt = [w.detach().to("tpu").requires_grad_() for w in ws]
    out = _run_experts_grouped_mm(wt[0], wt[1], wt[2], xt, counts.to("tpu"))
    out.backward(grad.to("tpu"))
    tol = dict(rtol=2e-2, atol=2e-2)  # bfloat16 products, rounded where each implementation rounds
    assert_close_to_cpu(out, ref.detach(), "output", **tol)
    assert_close_to_cpu(xt.grad, x.grad, "grad x", **tol)
    for i, (a, b) in enumerate(zip(wt, ws)):
        assert_close_to_cpu(a.grad, b.grad, f"grad w{i + 1}", **tol)


def test_histc_of_integers():
    """histc of integer ids counts them in the input's dtype (as CUDA does; the CPU kernel refuses
    integers, so the oracle counts the same values as floats): the router's call (bins = max, min 0),
    a range that does not divide evenly, and min == max (the data's own range)."""
    torch.manual_seed(3)
    for dtype, bins, lo, hi in [(torch.int64, 64, 0, 64), (torch.int64, 10, -3, 69), (torch.int32, 5, 0, 0)]:
        ids = torch.randint(-3, 70, (500,), dtype=dtype)
        got = torch.histc(ids.to("tpu"), bins=bins, min=lo, max=hi)
        want = torch.histc(ids.float(), bins=bins, min=lo, max=hi)
        assert got.dtype == dtype
        assert torch.equal(got.cpu(), want.to(dtype)), (bins, lo, hi, got.cpu(), want)


# ----------------------------------------------------------------------------- TPU kernels (megablox)

# rows 256 = 2 tiles of 128; groups of 40, 0, 160 and 50 rows (boundaries inside tiles), 6 rows past the end
MB_ENDS = [40, 40, 200, 250]
MB_M, MB_K, MB_N = 256, 128, 256


def _pytorch_grouped_mm_and_grads(x, w, ends, grad):
    """The oracle: PyTorch's CPU _grouped_mm, forward and gradients."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor(ends, dtype=torch.int32))
    out.backward(grad)
    return out.detach(), x.grad, w.grad


def _assert_grouped(out, gx, gw, want, end, **tol):
    """Output, input and weight gradients against PyTorch's; rows past the last group zero (PyTorch's
    CPU kernel leaves those rows of the output and of the input gradient unwritten: whatever the
    allocator held, so they are not compared)."""
    assert_close_to_cpu(out[:end].float(), want[0][:end].float(), "output", **tol)
    assert_close_to_cpu(gx[:end].float(), want[1][:end].float(), "grad x", **tol)
    assert_close_to_cpu(gw.float(), want[2].float(), "grad w", **tol)
    assert torch.count_nonzero(out[end:].cpu()) == 0 and torch.count_nonzero(gx[end:].cpu()) == 0


def _megablox_case(seed):
    """bfloat16 tokens, experts' weights and an output gradient of the megablox shapes (rows past the
    last group zero in the gradient), with PyTorch's CPU kernel's output and gradients for them."""
    torch.manual_seed(seed)
    x = torch.randn(MB_M, MB_K, dtype=torch.bfloat16)
    w = torch.randn(len(MB_ENDS), MB_N, MB_K, dtype=torch.bfloat16)
    grad = torch.randn(MB_M, MB_N, dtype=torch.bfloat16)
    grad[MB_ENDS[-1] :] = 0
    want = _pytorch_grouped_mm_and_grads(x, w, MB_ENDS, grad)
    return x, w, grad, want


def test_megablox_kernels_equal_pytorch_cpu_grouped_mm():
    """On TPU `_grouped_mm` runs megablox's gmm (experts, input gradient) and tgmm (weight
    gradient); here they run in Pallas interpret mode on the CPU and give PyTorch's CPU kernel's
    numbers, rows past the last group zero."""
    from torchtpu.backend.ops import attention_tpu, grouped_mm_tpu

    assert grouped_mm_tpu.unsupported_reason((MB_M, MB_K), (4, MB_K, MB_N), "bfloat16", "bfloat16") is None
    assert grouped_mm_tpu.unsupported_reason((MB_K, MB_M), (MB_M, MB_N), "bfloat16", "bfloat16") is None
    x, w, grad, want = _megablox_case(seed=4)
    xt, wt = (t.to("tpu").requires_grad_() for t in (x, w))
    with attention_tpu.interpret_kernels():
        out = torch._grouped_mm(xt, wt.transpose(-2, -1), offs=torch.tensor(MB_ENDS, dtype=torch.int32).to("tpu"))
        out.backward(grad.to("tpu"))
    tol = dict(rtol=1e-2, atol=1e-2)  # float32 accumulation in 128-wide tiles, one bfloat16 rounding
    _assert_grouped(out, xt.grad, wt.grad, want, MB_ENDS[-1], **tol)
    assert torch.count_nonzero(wt.grad[1].cpu()) == 0  # the empty group's expert


def test_megablox_forward_differentiated_by_jax_gives_pytorch_gradients():
    """Expert dispatch under `jax.vjp` (distributed.expert_parallel) differentiates the megablox
    forward with JAX's autodiff: its rule (gmm against the transposed weights, tgmm) gives PyTorch's
    CPU kernel's output and gradients, rows past the last group zero (Pallas interpret mode)."""
    import jax.numpy as jnp

    from torchtpu.backend.ops import attention_tpu, grouped_mm_tpu

    x, w, grad, want = _megablox_case(seed=5)
    as_jax = lambda t: jnp.asarray(t.float().numpy(), jnp.bfloat16)  # noqa: E731
    ends = jnp.asarray(MB_ENDS, jnp.int32)
    with attention_tpu.interpret_kernels():
        out, vjp = jax.vjp(
            lambda a, b: grouped_mm_tpu.forward_gmm(a, jnp.swapaxes(b, 1, 2), ends, jnp.bfloat16), as_jax(x), as_jax(w)
        )
        gx, gw = vjp(as_jax(grad))
    to_torch = lambda a: torch.from_numpy(jax.device_get(a.astype(jnp.float32)).copy()).to("tpu")  # noqa: E731
    _assert_grouped(to_torch(out), to_torch(gx), to_torch(gw), want, MB_ENDS[-1], rtol=1e-2, atol=1e-2)


def test_megablox_forward_with_every_row_grouped_skips_no_row():
    """Under `every_row_grouped` (the dispatch without expert parallelism, where the groups cover
    every row) the kernels' output and gradients, unmasked, are PyTorch's CPU kernel's."""
    import jax.numpy as jnp

    from torchtpu.backend.ops import attention_tpu, grouped_mm_tpu

    ends = [40, 40, 200, MB_M]
    torch.manual_seed(6)
    x = torch.randn(MB_M, MB_K, dtype=torch.bfloat16)
    w = torch.randn(len(ends), MB_N, MB_K, dtype=torch.bfloat16)
    grad = torch.randn(MB_M, MB_N, dtype=torch.bfloat16)
    want = _pytorch_grouped_mm_and_grads(x, w, ends, grad)
    as_jax = lambda t: jnp.asarray(t.float().numpy(), jnp.bfloat16)  # noqa: E731
    with attention_tpu.interpret_kernels(), grouped_mm_tpu.every_row_grouped():
        out, vjp = jax.vjp(
            lambda a, b: grouped_mm_tpu.forward_gmm(
                a, jnp.swapaxes(b, 1, 2), jnp.asarray(ends, jnp.int32), jnp.bfloat16
            ),
            as_jax(x),
            as_jax(w),
        )
        gx, gw = vjp(as_jax(grad))
    to_torch = lambda a: torch.from_numpy(jax.device_get(a.astype(jnp.float32)).copy()).to("tpu")  # noqa: E731
    _assert_grouped(to_torch(out), to_torch(gx), to_torch(gw), want, MB_M, rtol=1e-2, atol=1e-2)


def _pallas_costs(jaxpr):
    """The cost_estimate of every pallas_call in `jaxpr` and the jaxprs inside it, in order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn.params["cost_estimate"])
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _pallas_costs(inner)
    return found


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_megablox_kernels_declare_the_tiles_their_grid_runs(share):
    """The FLOPs the kernels declare to XLA (the dry run's cost model) are the work megablox's grid
    does: one (tm, K) x (K, N) product per visit of a row tile, counted by megablox's own tile
    bookkeeping (`make_group_metadata`), where a tile holding rows of two groups is visited twice.
    With groups whose ends all fall inside tiles (the dropless case), that is G - 1 tiles more than
    2 M K N; under `routed_share(0.5)` (expert parallelism: half the buffer's rows routed) the
    tiles of the routed rows only. Forward gmm, input-gradient gmm and weight-gradient tgmm."""
    import math

    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.megablox.gmm import make_group_metadata

    from torchtpu.backend.ops import attention_tpu, grouped_mm_tpu

    m, k, n = 512, 128, 256
    ends = [100, 300, 350, 512] if share == 1.0 else [60, 130, 200, 256]
    sizes = jnp.diff(jnp.asarray([0] + ends, jnp.int32))
    x = jnp.ones((m, k), jnp.bfloat16)
    w = jnp.ones((len(ends), k, n), jnp.bfloat16)

    def step(a, b, g):
        out, vjp = jax.vjp(lambda a, b: grouped_mm_tpu.forward_gmm(a, b, jnp.asarray(ends, jnp.int32), a.dtype), a, b)
        return out, vjp(g)

    with attention_tpu.interpret_kernels(), grouped_mm_tpu.routed_share(share):
        costs = _pallas_costs(jax.make_jaxpr(step)(x, w, jnp.ones((m, n), jnp.bfloat16)).jaxpr)
    # forward (m, k) x (k, n), input gradient (m, n) x (n, k), weight gradient (k, m) x (m, n)
    shapes = [("gmm", k, n), ("gmm", n, k), ("tgmm", k, n)]
    assert len(costs) == len(shapes), costs
    for cost, (kind, kk, nn) in zip(costs, shapes):
        tm = grouped_mm_tpu.tiling(m, kk, nn, len(ends), kind, 2, 2)[0]
        with jax.enable_x64(False):
            _, tiles = make_group_metadata(
                group_sizes=sizes,
                m=m,
                tm=tm,
                start_group=jnp.int32(0),
                num_nonzero_groups=len(ends),
                visit_empty_groups=kind == "tgmm",
            )
        assert int(tiles) > math.ceil(ends[-1] / tm)  # boundaries inside tiles: some tiles run twice
        assert cost.flops == 2 * int(tiles) * tm * kk * nn, (kind, cost.flops, int(tiles), tm)


def test_grouped_mm_with_stored_weights_gives_the_input_gradient_in_float32():
    """`linalg.grouped_mm_stored` (the expert dispatch's backward: the token gradients times the
    experts' weights as stored, float32 out) gives PyTorch's CPU input gradient of the experts,
    through megablox's gmm without a transpose (Pallas interpret mode, on TPU) and through the loop
    over row tiles (elsewhere); rows past the last group zero."""
    import jax.numpy as jnp

    from torchtpu.backend.ops import attention_tpu
    from torchtpu.backend.ops.linalg import grouped_mm_stored

    x, w, grad, want = _megablox_case(seed=6)
    as_jax = lambda t: jnp.asarray(t.float().numpy(), jnp.bfloat16)  # noqa: E731
    ends = jnp.asarray(MB_ENDS, jnp.int32)
    end = MB_ENDS[-1]
    for interpret in (True, False):
        with attention_tpu.interpret_kernels() if interpret else contextlib.nullcontext():
            gx = grouped_mm_stored(as_jax(grad), as_jax(w), ends, jnp.float32)
        assert gx.dtype == jnp.float32 and gx.shape == (MB_M, MB_K)
        gx = torch.from_numpy(jax.device_get(gx).copy()).to("tpu")
        # PyTorch rounds its gradient to bfloat16 once; this one is float32
        assert_close_to_cpu(gx[:end], want[1][:end].float(), "grad x", rtol=1e-2, atol=1e-2)
        assert torch.count_nonzero(gx[end:].cpu()) == 0


def test_megablox_kernels_per_shard_in_a_sharded_program():
    """In a compiled program over 4 CPU devices the kernels run per shard of the routed rows
    (group boundaries cross shards; each shard counts its own rows of each group, the weight
    gradient's partial sums are added over the shards) and give PyTorch's CPU numbers."""
    from torchtpu.backend.ops import attention_tpu
    from torchtpu.distributed import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("tpu", (4,), mesh_dim_names=("dp_shard",), devices=jax.devices("cpu")[:4])
    ends = [100, 100, 300, 500]  # 512 rows: 128 per shard, 12 past the end
    torch.manual_seed(5)
    x = torch.randn(512, MB_K, dtype=torch.bfloat16)
    w = torch.randn(len(ends), MB_N, MB_K, dtype=torch.bfloat16)
    grad = torch.randn(512, MB_N, dtype=torch.bfloat16)
    grad[ends[-1] :] = 0
    want = _pytorch_grouped_mm_and_grads(x, w, ends, grad)

    def step(x, w, offs, g):
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        gx, gw = torch.autograd.grad(out, (x, w), g)
        return out.detach(), gx, gw

    xt = distribute_tensor(x, mesh, (Shard(0),)).requires_grad_()
    wt = distribute_tensor(w, mesh, (Replicate(),)).requires_grad_()
    offs = distribute_tensor(torch.tensor(ends, dtype=torch.int32), mesh, (Replicate(),))
    gt = distribute_tensor(grad, mesh, (Shard(0),))
    compiled = torchtpu.compile(step)
    with attention_tpu.interpret_kernels():
        compiled(xt, wt, offs, gt)  # eager warm-up
        got = compiled(xt, wt, offs, gt)  # traced over the mesh
    assert "shard_map" in compiled.as_text(optimized=False) or "manual_computation" in compiled.as_text(optimized=False)
    _assert_grouped(*got, want, ends[-1], rtol=1e-2, atol=1e-2)


_TINY_MOE = {"experts": 8, "top_k": 2, "dim": 256, "hidden": 384, "batch": 4, "seq": 256}


def _tiny_moe_step_for_v5p(ep: int = 1, ac_mode: str = "none"):
    """(compiled step, its compile report, the optimized HLO) of torchtitan's Qwen3 MoE (1 layer, 8
    experts, top-2, bfloat16 experts) trained one step under FSDP over v5p:2x2x1, compiled ahead of
    time for TPU; with `ep` > 1 the experts are split over `ep` expert-parallel ranks; `ac_mode`
    torchtitan's activation checkpointing mode."""
    import dataclasses

    import pytest
    import torch.nn.functional as F

    from torchtpu.distributed import empty, init_device_mesh, materialize
    from torchtpu.distributed import topology as topo
    from torchtpu.distributed.batch import batch_placements
    from torchtpu.distributed.mesh import expert_parallel_mesh
    from torchtpu.models.registry import get_family

    if not topo.libtpu_available():
        pytest.skip("libtpu is not installed (pip install 'torchtpu[tpu]')")
    mesh = init_device_mesh("tpu", (4,), mesh_dim_names=("dp_shard",), devices=topo.topology_devices("v5p:2x2x1"))
    if ep > 1:
        mesh = expert_parallel_mesh(mesh, ep)
    t = _TINY_MOE
    family = get_family("qwen3")
    base = family.model_args("debugmodel_moe")
    args = dataclasses.replace(
        base,
        dim=t["dim"],
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=128,
        hidden_dim=512,
        moe_inter_dim=t["hidden"],
        vocab_size=512,
        max_seq_len=t["seq"],
        moe_args=dataclasses.replace(base.moe_args, num_experts=t["experts"], top_k=t["top_k"]),
    )
    with torch.device("meta"):
        model = family.build_model(args)
    family.parallelize(
        model,
        mesh,
        sequence_parallel=False,
        loss_parallel=False,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        ac_mode=ac_mode,
        ac_every=1,
        scan_layers=False,
    )
    materialize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), capturable=True, foreach=True)

    def step(inp, lab):
        loss = F.cross_entropy(model(inp).flatten(0, 1).float(), lab.flatten(0, 1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    ids = [empty((t["batch"], t["seq"]), torch.int32, mesh=mesh, placements=batch_placements(mesh)) for _ in range(2)]
    compiled = torchtpu.compile(step).compile_for(*ids)
    return compiled, topo.compile_report(compiled, mesh.jax_mesh), compiled.as_text()


def test_tpu_moe_step_runs_megablox_kernels_and_is_costed():
    """The tiny MoE step under FSDP over v5p:2x2x1 (`_tiny_moe_step_for_v5p`): the experts run
    megablox's gmm (forward and input gradient, two each: w1 and w3 as one, then w2) and tgmm
    (weight gradients, two: w1|w3's and w2's) per shard, with no ragged dot and no dense masked
    product over all experts x routed rows; XLA's cost model gives the program a time (no
    scatter-add of scalars, no 64-bit gather indices)."""
    import re

    _, report, hlo = _tiny_moe_step_for_v5p()
    experts, dim, hidden = _TINY_MOE["experts"], _TINY_MOE["dim"], _TINY_MOE["hidden"]
    kernels = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    gmm = [k for k in kernels if "jit(gmm)/pallas_call" in k]
    tgmm = [k for k in kernels if "jit(tgmm)/pallas_call" in k]
    assert len(gmm) == 4 and len(tgmm) == 2, (len(gmm), len(tgmm))
    rows = _TINY_MOE["batch"] * _TINY_MOE["seq"] * _TINY_MOE["top_k"] // 4  # routed rows per shard
    assert all(f"[{rows}," in k.split(" custom-call(")[0] for k in gmm), gmm
    assert all(
        f"[{experts},{dim},{hidden}]" in k.split(" custom-call(")[0]
        or f"[{experts},{2 * hidden},{dim}]" in k.split(" custom-call(")[0]
        for k in tgmm
    )
    assert "ragged-dot" not in hlo and "ragged_dot" not in hlo
    # no masked dense product: nothing in the program spans all experts x all routed rows
    assert not re.search(rf"\[{experts},{rows * 4}[,\]]|\[{experts},{rows}[,\]]", hlo)
    # each chip dispatches its own routed rows (models.moe.use_local_dispatch): no collective
    # carries the routed rows of the whole batch (torchtitan's global reordering, partitioned by
    # XLA, all-gathers them onto every chip)
    assert not re.search(rf"= \w+\[{rows * 4},{dim}\]\S* (all-gather|all-reduce)(-start)?\(", hlo)
    assert report["estimated_step_seconds"], report
    assert not any(report["wide_types"].values()), report["wide_types"]


def test_tpu_expert_parallel_moe_step_is_costed():
    """The tiny MoE step with its 8 experts split over 2 expert-parallel ranks
    (`[parallelism] expert_parallel_degree = 2`): the routed rows travel by all-to-all, the experts
    run megablox's gmm on each rank's 4 experts, and XLA's cost model gives the program a time
    (the dispatch counts rows per rank and per expert with compares and sums: a scatter-add of
    scalars would leave the dry run without a step-time estimate for every expert-parallel job)."""
    import math
    import re

    from torchtpu.backend.ops import grouped_mm_tpu as G

    _, report, hlo = _tiny_moe_step_for_v5p(ep=2)
    assert report["collectives"]["all-to-all"] > 0, report["collectives"]
    kernels = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert any("jit(gmm)/pallas_call" in k for k in kernels)
    assert report["estimated_step_seconds"], report
    # each rank's buffer holds room for both ranks' rows; the experts' first gmm (w1|w3) declares the
    # row tiles of one rank's rows, as balanced routing sends it (`routed_share`), not the buffer's
    t = _TINY_MOE
    buffer = 2 * t["batch"] * t["seq"] * t["top_k"] // 4
    dim, wide, experts = t["dim"], 2 * t["hidden"], t["experts"] // 2
    first = [
        k for k in kernels if "jit(gmm)/pallas_call" in k and f" bf16[{buffer},{wide}]" in k.split("custom-call(")[0]
    ]
    assert first, kernels
    tm = G.tiling(buffer, dim, wide, experts, "gmm", 2, 2)[0]
    tiles = min(buffer // tm, math.ceil(buffer / 2 / tm)) + experts - 1
    assert all(int(re.search(r'"flops":\s*"?(\d+)', k).group(1)) == 2 * tiles * tm * dim * wide for k in first)


@pytest.mark.parametrize("ep", [1, 2])
def test_recomputed_moe_layer_stops_before_the_last_expert_matmul(ep):
    """Under full activation checkpointing the backward recomputes the MoE layer's forward up to the
    experts' hidden states only: the scores' gradients come from the rows' gradient through w2 and
    the hidden states (distributed.expert_parallel._combined_outputs), so w2's grouped matmul, the
    outputs' way back and the combine do not run again. Five gmm kernels (forward: w1|w3 and w2;
    recomputation: w1|w3; backward: through w2 and through w1|w3) and two tgmm, with and without
    expert parallelism."""
    _, report, hlo = _tiny_moe_step_for_v5p(ep=ep, ac_mode="full")
    kernels = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    gmm = [k for k in kernels if "jit(gmm)/pallas_call" in k]
    tgmm = [k for k in kernels if "jit(tgmm)/pallas_call" in k]
    assert len(gmm) == 5 and len(tgmm) == 2, (len(gmm), len(tgmm))
    assert report["estimated_step_seconds"], report


def test_router_gather_gradient_and_short_scatter_add_match_cpu():
    """The router's top-k scores (`gather` along the experts) and their gradient (a scatter-add
    along that short dimension, computed by compare-and-sum on tpu), with repeated indices too."""
    torch.manual_seed(6)
    scores = torch.randn(64, 8, requires_grad=True)
    ids = torch.topk(scores.detach(), 2, dim=1).indices
    grad = torch.randn(64, 2)
    scores.gather(1, ids).backward(grad)
    st = scores.detach().to("tpu").requires_grad_()
    st.gather(1, ids.to("tpu")).backward(grad.to("tpu"))
    assert_close_to_cpu(st.grad, scores.grad, "gather gradient", rtol=0, atol=0)
    base = torch.randn(5, 6)
    idx = torch.tensor([[0, 0, 3], [5, 1, 1], [2, 2, 2], [4, 0, 5], [1, 3, 3]])
    src = torch.randn(5, 3)
    got = torch.scatter_add(base.to("tpu"), 1, idx.to("tpu"), src.to("tpu"))
    assert_close_to_cpu(got, torch.scatter_add(base, 1, idx, src), "scatter_add with repeats", rtol=1e-6, atol=1e-6)


def test_megablox_tiles_fit_scoped_vmem_and_compile_for_v5p():
    """The tiles `tiling` picks keep the kernels' blocks within VMEM_BUDGET for the expert shapes
    of Qwen3 30B-A3B and DeepSeek-V3 671B (7168 x 2048 experts, 32 per chip under expert
    parallelism 8, whose tgmm at 512 x 1024 x 1024 tiles and float32 output asks 17 MiB of v5p's 16),
    and those kernels compile ahead of time for a v5p chip."""
    import jax.numpy as jnp
    import pytest
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm

    from torchtpu.backend.ops import grouped_mm_tpu as G
    from torchtpu.distributed import topology as topo

    shapes = [(262144, 2048, 768, 128), (262144, 768, 2048, 128), (262144, 7168, 2048, 32), (8192, 2048, 7168, 32)]
    for m, k, n, groups in shapes:
        for kind in ("gmm", "tgmm"):
            for out_bytes in (2, 4):
                tile = G.tiling(m, k, n, groups, kind, 2, out_bytes)
                assert G.vmem_bytes(kind, tile, 2, out_bytes) <= G.VMEM_BUDGET, (m, k, n, kind, tile)
    if not topo.libtpu_available():
        pytest.skip("libtpu is not installed (pip install 'torchtpu[tpu]')")
    dev = jax.sharding.SingleDeviceSharding(topo.topology_devices("v5p:2x2x1")[0])
    m, k, n, groups = 8192, 7168, 2048, 32

    def spec(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=dev)

    for out in (jnp.float32, jnp.bfloat16):
        tile = G.tiling(m, k, n, groups, "tgmm", 2, jnp.dtype(out).itemsize)

        def weight_grad(a, b, sizes, tile=tile, out=out):
            with jax.enable_x64(False), G.costable_kernels():
                return tgmm(a, b, sizes, out, tile, num_actual_groups=groups)

        jax.jit(weight_grad).lower(spec(k, m), spec(m, n), spec(groups, dtype=jnp.int32)).compile()
        tile = G.tiling(m, k, n, groups, "gmm", 2, jnp.dtype(out).itemsize)

        def experts(x, w_t, sizes, tile=tile, out=out):
            with jax.enable_x64(False), G.costable_kernels():
                return gmm(x, w_t, sizes, out, tile, transpose_rhs=True)

        jax.jit(experts).lower(spec(m, k), spec(groups, n, k), spec(groups, dtype=jnp.int32)).compile()


# Off TPU (grouped_mm_blocked.py): groups of 0, 9, 0, 21 and 8 rows over 40 rows, 2 past the last
# group; the row tile for 40 rows in 5 groups is 8, so groups start and end inside tiles and span
# several of them
BLOCKED_ENDS = [0, 9, 9, 30, 38]


def test_grouped_mm_off_tpu_equals_pytorch_cpu_kernel_in_every_form():
    """Off TPU the three forms of `_grouped_mm` (bfloat16, the dtype PyTorch's checks let through)
    run as grouped_mm_blocked's loops over row tiles:
    the experts' (M, K) x (G, K, N), the weight gradient's (K, M) x (M, N) -> (G, K, N), and
    (G, P, K) x (K, M) -> (P, M) with the groups over M. Each gives PyTorch's CPU `_grouped_mm`,
    forward and gradients (PyTorch's autograd reaching the other forms through `_grouped_mm`'s
    backward formulas), with empty groups, groups across tiles and rows past the last group (zero
    here; PyTorch's CPU kernel leaves them unwritten, so they are not compared)."""
    from torchtpu.backend.ops import grouped_mm_blocked

    assert grouped_mm_blocked.tile_rows(40, len(BLOCKED_ENDS)) == 8
    torch.manual_seed(7)
    m, k, n, p, end = 40, 16, 24, 32, BLOCKED_ENDS[-1]
    offs = torch.tensor(BLOCKED_ENDS, dtype=torch.int32)
    cases = {
        "(M, K) x (G, K, N)": ((m, k), (len(BLOCKED_ENDS), k, n), (m, n)),
        "(K, M) x (M, N)": ((k, m), (m, n), (len(BLOCKED_ENDS), k, n)),
        "(G, P, K) x (K, M)": ((len(BLOCKED_ENDS), p, k), (k, m), (p, m)),
    }
    dtype = torch.bfloat16
    tol = dict(rtol=1e-2, atol=1e-2)  # float32 accumulation, one bfloat16 rounding, sums in another order
    for form, (a_shape, b_shape, out_shape) in cases.items():
        a = torch.randn(a_shape, dtype=dtype, requires_grad=True)
        b = torch.randn(b_shape, dtype=dtype, requires_grad=True)
        grad = torch.randn(out_shape, dtype=dtype)
        ref = torch._grouped_mm(a, b, offs=offs)
        ref.backward(grad)
        at, bt = (t.detach().to("tpu").requires_grad_() for t in (a, b))
        out = torch._grouped_mm(at, bt, offs=offs.to("tpu"))
        assert out.shape == out_shape and out.dtype == dtype, form
        out.backward(grad.to("tpu"))
        # the rows (columns, in the last form) of no group: not compared, zero here
        part = {"(M, K) x (G, K, N)": (slice(0, end),), "(G, P, K) x (K, M)": (slice(None), slice(0, end))}
        keep = part.get(form, (slice(None),))
        assert_close_to_cpu(out[keep].float(), ref.detach()[keep].float(), f"{form} output", **tol)
        if form == "(M, K) x (G, K, N)":
            assert torch.count_nonzero(out[end:].cpu()) == 0 and torch.count_nonzero(at.grad[end:].cpu()) == 0
            assert torch.count_nonzero(bt.grad[0].cpu()) == 0 and torch.count_nonzero(bt.grad[2].cpu()) == 0
            assert_close_to_cpu(at.grad[:end].float(), a.grad[:end].float(), f"{form} grad a", **tol)
            assert_close_to_cpu(bt.grad.float(), b.grad.float(), f"{form} grad b", **tol)
        elif form == "(K, M) x (M, N)":
            assert_close_to_cpu(at.grad[:, :end].float(), a.grad[:, :end].float(), f"{form} grad a", **tol)
            assert_close_to_cpu(bt.grad[:end].float(), b.grad[:end].float(), f"{form} grad b", **tol)
        else:
            assert_close_to_cpu(at.grad.float(), a.grad.float(), f"{form} grad a", **tol)
            assert_close_to_cpu(bt.grad[:, :end].float(), b.grad[:, :end].float(), f"{form} grad b", **tol)


def test_grouped_mm_off_tpu_under_jax_autodiff_gives_pytorch_gradients():
    """The expert dispatch differentiates the experts with `jax.vjp` (distributed.expert_parallel):
    off TPU the grouped matmuls' own rules (grouped_mm_blocked: a loop over row tiles again, never
    JAX's transpose of the loop) give PyTorch's CPU gradients in bfloat16, for the experts' form
    and for the weight gradient's form differentiated once more; an empty group's weight gets zero."""
    import jax.numpy as jnp

    from torchtpu.backend.ops.linalg import grouped_mm

    torch.manual_seed(8)
    m, k, n, end = 40, 16, 24, BLOCKED_ENDS[-1]
    ends = jnp.asarray(BLOCKED_ENDS, jnp.int32)
    as_jax = lambda t: jnp.asarray(t.detach().float().numpy(), jnp.bfloat16)  # noqa: E731
    to_torch = lambda a: torch.from_numpy(jax.device_get(a.astype(jnp.float32)).copy()).to("tpu")  # noqa: E731
    tol = dict(rtol=1e-2, atol=1e-2)
    for a_shape, b_shape, out_shape in (((m, k), (len(BLOCKED_ENDS), k, n), (m, n)), ((k, m), (m, n), (5, k, n))):
        a = torch.randn(a_shape, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(b_shape, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(out_shape, dtype=torch.bfloat16)
        ref = torch._grouped_mm(a, b, offs=torch.tensor(BLOCKED_ENDS, dtype=torch.int32))
        ref.backward(grad)
        out, vjp = jax.vjp(lambda x, y: grouped_mm(x, y, ends), as_jax(a), as_jax(b))
        ga, gb = vjp(as_jax(grad))
        if len(a_shape) == 2 and len(b_shape) == 3:
            assert_close_to_cpu(to_torch(out)[:end], ref.detach()[:end].float(), "output", **tol)
            assert_close_to_cpu(to_torch(ga)[:end], a.grad[:end].float(), "grad x", **tol)
            assert_close_to_cpu(to_torch(gb), b.grad.float(), "grad w", **tol)
            assert not jnp.any(gb[0]) and not jnp.any(gb[2]) and not jnp.any(ga[end:])
        else:
            assert_close_to_cpu(to_torch(out), ref.detach().float(), "weight-gradient form", **tol)
            assert_close_to_cpu(to_torch(ga)[:, :end], a.grad[:, :end].float(), "its grad a", **tol)
            assert_close_to_cpu(to_torch(gb)[:end], b.grad[:end].float(), "its grad b", **tol)


def test_grouped_mm_off_tpu_memory_is_bounded_at_debugmodel_moe_shapes():
    """One of Qwen3 debugmodel_moe's expert matmuls with its gradients under `jax.vjp`, compiled for
    XLA's CPU backend: 16,384 routed rows of 256 through 64 experts of 256 x 768, bfloat16 (56 MiB
    of operands). XLA's temporaries stay under 256 MiB (measured 208.5 MiB); `jax.lax.ragged_dot`,
    which XLA:CPU computes densely over every expert, needed 7,776 MiB for the same program."""
    import jax.numpy as jnp

    from torchtpu.backend.ops.linalg import grouped_mm

    m, k, n, groups = 16384, 256, 768, 64

    def experts_and_grads(x, w, ends, gy):
        y, vjp = jax.vjp(lambda a, b: grouped_mm(a, b, ends), x, w)
        return y, vjp(gy)

    args = [
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((groups,), jnp.int32),
        jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
    ]
    compiled = jax.jit(experts_and_grads).lower(*args).compile()
    assert "ragged" not in compiled.as_text()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 256 * 2**20, f"{temp / 2**20:.1f} MiB of temporaries"
