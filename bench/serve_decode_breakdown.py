"""Where the serving dry run's decode step goes above its HBM roofline, per layer, by XLA's cost model.

    python -m bench.serve_decode_breakdown --model llama3-70b --topology v5p:2x2x2 --tensor-parallel-size 8 \\
        --max-model-len 8192 --batch 64 --context 2048

XLA gives one time per program, not per op. This compiles the dry run's decode program
(`torchtpu.serve.dry_run`: the runner's step, costing options) at 2 and 4 layers three ways: as it
is, with the cache write left out, and with attention (the cache write and the Pallas kernel) left
out; the per-layer slope of each, and their differences, are the layer's time and the part of it
that the cache write and the attention take. Beside them, XLA's cost of each piece compiled alone
for one chip of the topology: each linear layer's weight shard times the batch's activations, the
attention kernel on one shard's heads at the decode bucket, the all-reduce and all-gather of the
hidden state over the tensor-parallel mesh, and a large elementwise op against its bytes (the
bandwidth XLA's model reads HBM at). The roofline of a layer is its weight shards plus its
sequences' KV cache per chip over the chip's HBM bandwidth. Dense Llama-style models only (the
linear shapes come from the config's hidden, head and intermediate sizes). The ablated programs
compute something else than the model: they are for this accounting only.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile


@contextlib.contextmanager
def _ablated(what: str):
    """The dry run's program with the KV-cache write ("write") or the whole attention ("attention":
    write and kernel; the kernel's output replaced by its query) left out."""
    from torchtpu.backend.ops import paged_attention as pa

    saved = pa.write_kv_cache, pa.ragged_paged_attention
    if what in ("write", "attention"):
        pa.write_kv_cache = lambda cache, k, v, slots, **kw: cache
    if what == "attention":
        pa.ragged_paged_attention = lambda q, cache, *meta, **kw: q
    try:
        yield
    finally:
        pa.write_kv_cache, pa.ragged_paged_attention = saved


def _decode_per_layer(a, mesh, what: str) -> tuple[float, float]:
    """(per-layer seconds, intercept seconds) of the decode program, XLA's estimates at 2 and 4 layers."""
    from torchtpu.serve import dry_run

    est = {}
    with tempfile.TemporaryDirectory(prefix="torchtpu-decode-breakdown-") as work:
        folder = dry_run.model_folder(a.model, work)
        dry = dry_run.ServingDryRun(a, folder, mesh, work)
        blocks = -(-(a.context or a.max_model_len) // a.block_size)
        for depth in (2, 4):
            p = dry_run.Program("decode", a.batch, a.batch, blocks, {})
            with _ablated(what):
                dry.compile_programs(depth, [p])
            est[depth] = p.reports[depth]["estimated_step_seconds"]
    per = (est[4] - est[2]) / 2
    return per, est[2] - 2 * per


def _alone(fn, args, mesh, donate=()):
    """XLA's estimated seconds for `fn` compiled alone (costing options) on `mesh`."""
    import jax

    from torchtpu.distributed.topology import aot_compile, compile_report, costing_compiles

    lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
    with costing_compiles(mesh, memory_space_assignment=False):
        compiled = aot_compile(lowered)
    seconds = compile_report(compiled, mesh)["estimated_step_seconds"]
    if seconds is None:
        raise RuntimeError(f"XLA's cost model gives no time for {getattr(fn, '__name__', fn)} compiled alone")
    return seconds


def main(argv=None) -> int:
    from torchtpu.serve import dry_run

    a = dry_run.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(8, a.tensor_parallel_size)}"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import transformers
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from torchtpu.backend.ops import paged_attention as pa
    from torchtpu.distributed import init_device_mesh
    from torchtpu.distributed.topology import topology_devices
    from torchtpu.hardware import TP_AXIS, chip_of

    tp, batch = a.tensor_parallel_size, a.batch
    context = a.context or a.max_model_len
    devices = topology_devices(a.topology)
    chip = chip_of(devices[0].device_kind)
    bw = chip.hbm_bandwidth
    mesh = init_device_mesh("tpu", (tp,), mesh_dim_names=(TP_AXIS,), devices=devices[:tp])

    per, icpt = {}, {}
    for what in ("", "write", "attention"):
        per[what], icpt[what] = _decode_per_layer(a, mesh, what)

    with tempfile.TemporaryDirectory() as work:
        config = transformers.AutoConfig.from_pretrained(dry_run.model_folder(a.model, work))
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    bf = jnp.bfloat16
    one = Mesh(np.array(devices[:1]), ("x",))
    tp_mesh = Mesh(np.array(devices[:tp]), (TP_AXIS,))

    def sds(shape, dtype=bf, mesh=one, spec=None):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec or P()))

    linears = {  # name: (in, out) of one chip's shard
        "qkv": (hidden, (heads + 2 * kv_heads) * head_dim // tp),
        "o": (heads * head_dim // tp, hidden),
        "gate_up": (hidden, 2 * inter // tp),
        "down": (inter // tp, hidden),
    }
    rows = []
    weights_roof = 0.0
    for name, (k, n) in linears.items():
        t = _alone(lambda x, w: x @ w.T, (sds((batch, k)), sds((n, k))), one)
        roof = k * n * 2 / bw
        weights_roof += roof
        rows.append((f"matmul {name} [{batch},{k}] x [{n},{k}]^T", t, roof))
    matmuls = sum(r[1] for r in rows)

    # the kernel on one shard's heads, as the decode program calls it
    local_heads, local_kv = heads // tp, max(1, kv_heads // tp)
    blocks = -(-context // a.block_size)
    cache = (batch * blocks + 1, a.block_size, 2 * local_kv, pa.cache_head_dim(head_dim))
    i32 = jnp.int32
    meta = (sds((batch,), i32), sds((batch, blocks), i32), sds((batch + 1,), i32), sds((1,), i32))

    def kernel(q, c, *m):
        return pa._pallas_attention(q, c, *m, sm_scale=head_dim**-0.5, sliding_window=None, soft_cap=None)

    with jax.default_device(devices[0]):
        attn = _alone(kernel, (sds((batch, local_heads, head_dim)), sds(cache), *meta), one)
    kv_roof = batch * context * 2 * local_kv * head_dim * 2 / bw
    rows.append((f"attention kernel alone ({local_heads} q heads, {local_kv} kv heads per chip)", attn, kv_roof))

    def collective(fn, spec_in, spec_out):
        f = jax.shard_map(fn, mesh=tp_mesh, in_specs=(spec_in,), out_specs=spec_out, check_vma=False)
        return _alone(f, (sds((batch, hidden), mesh=tp_mesh, spec=spec_in),), tp_mesh)

    ar = collective(lambda x: jax.lax.psum(x, TP_AXIS), P(), P())
    ag = collective(lambda x: jax.lax.all_gather(x, TP_AXIS, axis=1, tiled=True), P(None, TP_AXIS), P())
    rows.append((f"all-reduce bf16[{batch},{hidden}] (x2 a layer)", 2 * ar, 0.0))
    rows.append((f"all-gather bf16[{batch},{hidden}] (x2 a layer)", 2 * ag, 0.0))
    n = 64 * 1024 * 1024
    scale = _alone(lambda x: x * 2, (sds((n,)),), one) / (2 * n * 2 / bw)

    roof = weights_roof + kv_roof
    us = lambda s: f"{s * 1e6:8.1f} us"  # noqa: E731
    out = [
        f"decode step, {a.model} on {a.topology}, TP {tp}, batch {batch} at {context} context, per layer "
        f"(XLA's estimates at 2 and 4 layers; {chip.name}, {bw / 1e9:.0f} GB/s)",
        f"  the layer                                  {us(per[''])}  roofline {us(roof)} "
        f"({per[''] / roof:.2f}x): weights {us(weights_roof)}, KV {us(kv_roof)}",
        f"  of it, the KV-cache write                  {us(per[''] - per['write'])}",
        f"  of it, attention (write and kernel)        {us(per[''] - per['attention'])}",
        f"  the rest (matmuls, collectives, elementwise) {us(per['attention'])}",
        "pieces compiled alone (one chip; collectives over the mesh)",
    ]
    out += [f"  {name:<60} {us(t)}" + (f"  ({t / r:.2f}x its bytes at bandwidth)" if r else "") for name, t, r in rows]
    out.append(f"  matmuls together {us(matmuls)}; other ops in the layer about {us(per['attention'] - matmuls)}")
    out.append(f"  an elementwise op on 128 MiB: {scale:.2f}x its bytes at bandwidth (XLA's model of HBM traffic)")
    out.append(f"the step's intercept (embedding, final norm, LM head): {us(icpt[''])}")
    print("\n".join(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
