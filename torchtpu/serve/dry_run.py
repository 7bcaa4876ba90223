"""`python -m torchtpu.serve.dry_run`: size a vLLM serving slice for TPUs without a TPU.

    python -m torchtpu.serve.dry_run --model llama3-8b --topology v5e:2x2 --tensor-parallel-size 4 \\
        --max-model-len 8192 --batch 64 --context 2048

It compiles the step torchtpu's vLLM runner runs (`TpuModelRunner._step`: vLLM's own model code
with its parameters laid out over the tensor-parallel mesh, the paged KV caches, one padding
bucket) ahead of time for the TPU topology's chips, with no weights: the parameters and caches
are never allocated. Two programs: a decode step (`--batch` sequences, one new token each, each
at `--context` tokens) and a prefill step (one prompt of `--prefill-tokens` tokens). It prints:

- HBM for the weights per chip, from the parameters' shapes and tensor-parallel layouts;
- the KV-cache capacity left: tokens, and concurrent sequences at `--max-model-len`;
- XLA's estimated decode-step time at the batch, the HBM-bandwidth roofline of that step (the
  weights a step reads plus its sequences' KV cache, over the chip's bandwidth) and the output
  tokens/s per chip they give; the prefill step's estimate (time to first token).

How the step is costed: XLA's cost analysis counts a while-loop body once, so the programs are
compiled with 2 and 4 layers (vLLM's model runs its layers in a Python loop, so each program is
unrolled) and XLA's figures are extrapolated to the model's depth, as the training dry run does
(`costing.depth_extrapolated_cost`). On TPU the attention is the Pallas ragged paged attention
kernel, which XLA costs by what it declares (`paged_attention.kernel_cost`: every sequence reads
its whole block table, which is why the decode program's block tables are sized to `--context`).
The costing programs are compiled without memory-space assignment, whose prefetches into on-chip
memory XLA's cost analysis counts as HBM traffic (topology.NO_MEMORY_SPACE_ASSIGNMENT); the
memory figures come from the same programs. A costing program that still holds loops (the pure-JAX attention, when the kernel does not take
the shapes) gets no time estimate. A named model (`llama3-8b`, `llama3-70b`, `llama3-405b`) is
torchtitan's Llama 3 flavor written as a Hugging Face config; `--model` may also be a local
Hugging Face folder (only its config.json is read). See docs/serving-dry-run.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time

__all__ = ["NAMED_MODELS", "ServingDryRun", "main", "run"]

NAMED_MODELS = {"llama3-8b": "8B", "llama3-70b": "70B", "llama3-405b": "405B"}


def model_folder(model: str, into: str) -> str:
    """A Hugging Face folder for `model`: the folder itself, or a named Llama 3 written into `into`."""
    if model in NAMED_MODELS:
        from torchtitan.models.llama3 import llama3_args

        from torchtpu.models.llama3.hf import hf_config

        with open(os.path.join(into, "config.json"), "w") as f:
            json.dump(hf_config(llama3_args[NAMED_MODELS[model]], "bfloat16"), f)
        return into
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(
            f"--model {model!r}: neither a named model ({', '.join(NAMED_MODELS)}) nor a Hugging Face folder "
            "with a config.json"
        )
    return model


@dataclasses.dataclass
class Program:
    """One compiled step program and what XLA says of it (topology.compile_report)."""

    name: str
    tokens: int
    reqs: int
    blocks_per_seq: int
    reports: dict  # depth -> compile_report


class ServingDryRun:
    """Builds vLLM's model for one depth on a TPU topology's mesh and compiles its step programs."""

    def __init__(self, args, folder: str, mesh, workdir: str):
        self.a = args
        self.folder = folder
        self.mesh = mesh
        self.workdir = workdir
        self._distributed = False

    # -- vLLM's config and runner, no weights
    def vllm_config(self, depth: int | None):
        from vllm.engine.arg_utils import EngineArgs

        a = self.a
        overrides = {"num_hidden_layers": depth} if depth is not None else {}
        return EngineArgs(
            model=self.folder,
            skip_tokenizer_init=True,
            dtype=a.dtype,
            max_model_len=a.max_model_len,
            tensor_parallel_size=a.tensor_parallel_size,
            max_num_seqs=max(a.batch, 8),
            max_num_batched_tokens=max(a.prefill_tokens, a.batch),
            block_size=a.block_size,
            enforce_eager=True,
            hf_overrides=overrides,
        ).create_engine_config()

    def runner(self, vllm_config):
        """torchtpu's runner with vLLM's model built on meta, laid out over the mesh (sharding.py)
        and made of lazy tpu tensors, which ahead-of-time compilation reads by shape only."""
        import torch
        from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.utils.torch_utils import set_default_torch_dtype

        from torchtpu.distributed import materialize

        from . import moe, sharding
        from .runner import TpuModelRunner
        from .worker import TpuWorker

        # the worker's constructor sets vLLM's per-process op choices (its IR ops' priorities)
        TpuWorker(
            vllm_config=vllm_config,
            local_rank=0,
            rank=0,
            distributed_init_method=f"file://{self.workdir}/dist",
            is_driver_worker=True,
        )
        if not self._distributed:
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"file://{self.workdir}/dist",
                local_rank=0,
                backend="gloo",
            )
            ensure_model_parallel_initialized(1, 1)
            self._distributed = True
        runner = TpuModelRunner(vllm_config, self.mesh)
        loader = get_model_loader(vllm_config.load_config)
        with set_default_torch_dtype(vllm_config.model_config.dtype):
            with torch.device("meta"):
                model = loader.create_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
        sharding.shard_model(model, self.mesh)
        moe.shard_experts(model, self.mesh)
        materialize(model)
        runner.model = model.eval()
        return runner

    # -- the programs
    def compile_programs(self, depth: int, programs: list[Program]) -> dict:
        """Compile each program at `depth` layers (costing options); returns the model's figures."""
        import torch
        from torch.distributed.tensor import Replicate
        from vllm.config import set_current_vllm_config
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

        from torchtpu.distributed import empty as empty_on_mesh
        from torchtpu.distributed.topology import aot_compile, compile_report, costing_compiles

        from . import steps

        vc = self.vllm_config(depth)
        with set_current_vllm_config(vc):
            runner = self.runner(vc)
            specs = runner.get_kv_cache_spec()
            spec = next(iter(specs.values()))
            blocks = max(p.reqs * p.blocks_per_seq for p in programs) + 1
            kv_config = KVCacheConfig(
                num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(specs), spec)]
            )
            caches = runner.initialize_kv_cache_tensors(kv_config, [self.a.block_size])
            figures = {
                "params": _parameter_figures(runner.model, self.mesh.size()),
                "kv_bytes_per_block_per_chip": sum(_local_bytes(c) for c in caches.values()) // blocks,
                "cache_shape": tuple(next(iter(caches.values())).shape),
            }
            for p in programs:
                bucket = steps.Bucket(p.tokens, p.reqs)
                runner.buckets.max_blocks_per_seq = p.blocks_per_seq
                size = steps.layout(bucket, p.blocks_per_seq)["_size"][0]
                packed = empty_on_mesh((size,), torch.int32, mesh=self.mesh, placements=[Replicate()])
                t0 = time.perf_counter()
                with torch.no_grad():
                    lowered = runner.step.lower_for(packed, bucket)
                with costing_compiles(self.mesh.jax_mesh, memory_space_assignment=False):
                    compiled = aot_compile(lowered)
                rep = compile_report(compiled, self.mesh.jax_mesh)
                rep["compile_seconds"] = time.perf_counter() - t0
                text = compiled.as_text()
                rep["pallas_attention"] = "ragged_paged_attention" in text and "tpu_custom_call" in text
                p.reports[depth] = rep
                del compiled
        return figures


def _local_bytes(t) -> int:
    """Bytes one device holds of tpu tensor `t` (its layout's shard shape; whole when unlaid)."""
    from torchtpu.backend import storage_of

    st = storage_of(t)
    shape = tuple(t.shape)
    if st.dist is not None:
        shape = st.dist.sharding.shard_shape(shape)
    return math.prod(shape) * t.element_size()


def _parameter_figures(model, tp: int) -> dict:
    """Parameter counts and per-chip bytes: split over the tensor-parallel mesh or replicated."""
    split = whole = 0
    per_chip = 0
    embedding = 0
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    seen = set()
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            local = _local_bytes(p)
            per_chip += local
            if local * tp == p.numel() * p.element_size():
                split += p.numel()
            else:
                whole += p.numel()
            if isinstance(mod, VocabParallelEmbedding) and not isinstance(mod, ParallelLMHead):
                embedding += local
    return {
        "split": split,
        "replicated": whole,
        "bytes_per_chip": per_chip,
        "embedding_bytes_per_chip": embedding,
        "itemsize": next(model.parameters()).element_size(),
    }


def _gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB"


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.3f} ms"


def run(a) -> int:
    """The dry run for parsed arguments `a`; prints the report; 0 if a sequence of max_model_len fits."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import transformers

    from torchtpu.costing import COSTING_DEPTHS, at_depth, depth_extrapolated_cost
    from torchtpu.distributed import init_device_mesh
    from torchtpu.distributed.topology import topology_devices
    from torchtpu.hardware import TP_AXIS, chip_of

    from .steps import Buckets

    tp = a.tensor_parallel_size
    devices = topology_devices(a.topology)
    if tp > len(devices):
        raise ValueError(f"--tensor-parallel-size {tp}: {a.topology} has only {len(devices)} chips")
    chip = chip_of(devices[0].device_kind)
    mesh = init_device_mesh("tpu", (tp,), mesh_dim_names=(TP_AXIS,), devices=devices[:tp])
    context = a.context or a.max_model_len
    if context > a.max_model_len:
        raise ValueError(f"--context {context} is longer than --max-model-len {a.max_model_len}")
    prompt = min(a.prefill_tokens, a.max_model_len)
    buckets = Buckets(max(a.prefill_tokens, a.batch), max(a.batch, 8), 1)
    decode = buckets.for_batch(a.batch, a.batch)
    prefill = buckets.for_batch(prompt, 1)
    blocks_of = lambda n: -(-n // a.block_size)  # noqa: E731
    programs = [
        Program("decode", decode.tokens, decode.reqs, blocks_of(context), {}),
        Program("prefill", prefill.tokens, prefill.reqs, blocks_of(prompt), {}),
    ]

    with tempfile.TemporaryDirectory(prefix="torchtpu-serve-dry-run-") as work:
        folder = model_folder(a.model, work)
        config = transformers.AutoConfig.from_pretrained(folder)
        depth = int(a.layers or config.num_hidden_layers)
        dry = ServingDryRun(a, folder, mesh, work)
        depths = (depth,) if depth <= COSTING_DEPTHS[1] else COSTING_DEPTHS
        figures = {}
        for d in depths:
            figures[d] = dry.compile_programs(d, programs)

    arch = (config.architectures or ["?"])[0]
    lines = [
        f"serving dry run         {a.model} ({arch}, {depth} layers, {a.dtype}) on {a.topology}, "
        f"tensor parallel {tp} ({devices[0].device_kind}, {chip.name if chip else '?'})",
    ]
    if len(depths) == 1:
        fig = figures[depth]
        costs = {p.name: {**p.reports[depth], "method": "XLA cost model on the whole program"} for p in programs}
    else:
        da, db = depths
        fig = dict(figures[da])
        fig["params"] = {  # counts that grow with depth; the parameters' item size does not
            k: v if k == "itemsize" else at_depth(v, figures[db]["params"][k], da, db, depth)
            for k, v in figures[da]["params"].items()
        }
        costs = {}
        for p in programs:
            ra, rb = p.reports[da], p.reports[db]
            est = depth_extrapolated_cost(ra, rb, da, db, depth)
            scratch = [r["hbm_bytes_needed"] - r["memory"]["argument_bytes"] for r in (ra, rb)]
            est["scratch_bytes"] = max(scratch[1], at_depth(*scratch, da, db, depth))
            est["while_loops"] = ra["while_loops"] + rb["while_loops"]
            est["pallas_attention"] = ra["pallas_attention"] and rb["pallas_attention"]
            costs[p.name] = est
    for p in programs:
        if len(depths) == 1:
            r = costs[p.name]
            r["scratch_bytes"] = r["hbm_bytes_needed"] - r["memory"]["argument_bytes"]
        if costs[p.name]["while_loops"]:
            costs[p.name]["estimated_step_seconds"] = None
            costs[p.name]["method"] += (
                f"; WARNING: {len(costs[p.name]['while_loops'])} while loop(s) in the program (XLA costs a loop body "
                "once): no time estimate"
            )

    compiled_at = " and ".join(str(d) for d in depths)
    lines.append(
        "compiled                torchtpu's vLLM step (TpuModelRunner._step: vLLM's model code, paged KV caches, "
        f"one padding bucket; no weights) for {tp} {devices[0].device_kind} chips at {compiled_at} layers, "
        "XLA's figures " + ("as they are" if len(depths) == 1 else f"extrapolated to {depth}")
    )
    for p in programs:
        r = p.reports[depths[-1]]
        lines.append(
            f"  {p.name:<8}              bucket {p.tokens} tokens x {p.reqs} requests, block tables of "
            f"{p.blocks_per_seq} blocks of {a.block_size}; attention: "
            + ("Pallas ragged paged attention kernel" if r["pallas_attention"] else "pure-JAX paged attention")
            + f"; {r['compile_seconds']:.0f} s to compile"
        )

    params = fig["params"]
    itemsize = params["itemsize"]
    weights = params["bytes_per_chip"]
    lines.append(
        f"weights / chip          {_gib(weights)} ({params['split'] + params['replicated']:,} parameters x {itemsize} B: "
        f"{params['split']:,} split {tp} ways, {params['replicated']:,} replicated)"
    )
    util = a.gpu_memory_utilization
    hbm = chip.hbm_bytes if chip else None
    scratch = max(c["scratch_bytes"] for c in costs.values())
    # every layer's cache is alike: a block's bytes per chip at the model's depth
    per_block = figures[depths[0]]["kv_bytes_per_block_per_chip"] // depths[0] * depth
    per_token = per_block // a.block_size
    lines.append(
        f"HBM / chip              {_gib(hbm)} x {util} (gpu_memory_utilization) = {_gib(hbm * util)}; step "
        f"scratch (XLA temporaries, outputs, program) {_gib(scratch)}"
    )
    kv_room = hbm * util - weights - scratch
    blocks = max(0, int(kv_room // per_block))
    tokens = blocks * a.block_size
    shape = fig["cache_shape"]
    lines.append(
        f"KV cache / chip         {_gib(max(kv_room, 0))} = {tokens:,} tokens ({per_token:,} B per token per chip: "
        f"{depth} layers x cache [blocks, {shape[1]}, {shape[2]} (K and V of {shape[2] // 2} kv heads), {shape[3]}] "
        f"split {tp} ways over kv heads)"
    )
    seqs = tokens // a.max_model_len
    lines.append(
        f"concurrent sequences    {seqs} at {a.max_model_len} tokens (max_model_len); {tokens // context} at "
        f"{context} tokens (the decode context)"
    )

    dec = costs["decode"]
    bw = chip.hbm_bandwidth
    weights_read = weights - params["embedding_bytes_per_chip"]  # a step gathers a few embedding rows only
    kv_read = a.batch * context * per_token
    roofline = (weights_read + kv_read) / bw
    est = dec["estimated_step_seconds"]
    lines.append(
        f"costing method          {dec['method']}; compiled without memory-space assignment (XLA counts its "
        "prefetches into on-chip memory as HBM traffic)"
    )
    lines.append(
        f"decode step             batch {a.batch} (bucket {decode.reqs}), {context} tokens of context each: XLA estimate "
        f"{_ms(est)}"
        + ("" if a.batch * context <= tokens else f" (the batch at this context does NOT fit: {tokens:,} tokens)")
    )
    lines.append(
        f"HBM roofline            {_ms(roofline)} = (weights read {_gib(weights_read)} + KV read {_gib(kv_read)}) / "
        f"{bw / 1e9:.0f} GB/s per chip" + (f"; estimate / roofline = {est / roofline:.2f}x" if est else "")
    )
    if est:
        lines.append(
            f"output tokens/s / chip  {a.batch / est / tp:,.0f} (estimate: batch / XLA's step / {tp} chips; roofline "
            f"bound {a.batch / roofline / tp:,.0f})"
        )
    pre = costs["prefill"]
    pre_est = pre["estimated_step_seconds"]
    bound = pre["flops_per_device"] / chip.peak_bf16_flops
    lines.append(
        f"prefill step            one prompt of {prompt} tokens (bucket {prefill.tokens}): XLA estimate {_ms(pre_est)}; "
        f"compute-bound {_ms(bound)} ({pre['flops_per_device']:.3g} XLA FLOPs per chip at {chip.peak_bf16_flops / 1e12:.0f} "
        "TFLOP/s); time to first token about the estimate"
    )
    print("\n".join(lines), flush=True)
    figures_out = {
        "parameters_split": params["split"],
        "parameters_replicated": params["replicated"],
        "weight_bytes_per_chip": weights,
        "hbm_bytes_per_chip": hbm,
        "scratch_bytes_per_chip": scratch,
        "kv_bytes_per_token_per_chip": per_token,
        "kv_cache_tokens_per_chip": tokens,
        "concurrent_sequences_at_max_model_len": seqs,
        "decode_estimate_seconds": est,
        "decode_roofline_seconds": roofline,
        "decode_kv_read_bytes_per_chip": kv_read,
        "decode_weight_read_bytes_per_chip": weights_read,
        "output_tokens_per_s_per_chip": a.batch / est / tp if est else None,
        "prefill_estimate_seconds": pre_est,
        "decode_method": dec["method"],
        "pallas_attention": all(p.reports[depths[-1]]["pallas_attention"] for p in programs),
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures_out, f, indent=1)
    if seqs < 1:
        print(
            f"serve dry run: a sequence of max_model_len={a.max_model_len} tokens does NOT fit in the KV cache left "
            f"({tokens:,} tokens per chip); lower --max-model-len, raise --tensor-parallel-size or use a larger topology",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m torchtpu.serve.dry_run", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help=f"a Hugging Face folder or one of {', '.join(NAMED_MODELS)}")
    p.add_argument("--topology", required=True, help="a TPU topology, e.g. v5e:2x2, v5p:2x2x2, v6e:2x2")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=64, help="sequences in the decode step")
    p.add_argument(
        "--context", type=int, default=0, help="tokens of context of each decoding sequence (default: max-model-len)"
    )
    p.add_argument("--prefill-tokens", type=int, default=2048, help="prompt length of the prefill step")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's share of HBM for weights + cache")
    p.add_argument("--layers", type=int, default=0, help="override the model's depth")
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    # vLLM's config checks the tensor-parallel degree against this host's devices; the programs
    # are compiled for the topology's chips, and XLA's CPU devices stand in for the count
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        n = max(8, a.tensor_parallel_size)
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    try:
        return run(a)
    except ValueError as e:
        print(f"serve dry run: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
