"""Parallelize torchtitan's Llama 3 `Transformer` through torchtpu's sharding layer.

The same layout torchtitan's `parallelize_llama` gives the model on GPUs, written with the
same PyTorch parallel styles, so the model shards on a TPU mesh the way it does there:

- tensor parallelism over "tp": attention q/k/v and the feed-forward w1/w3 split their output
  features (colwise), attention output and w2 split their input features (rowwise); the
  token embedding splits the vocabulary, the output projection the vocabulary too
  (vocab-parallel logits when `loss_parallel`);
- sequence parallelism (optional): the norms run on sequence shards, and the blocks gather
  the sequence before attention/feed-forward and reduce-scatter after them;
- FSDP over the data-parallel axes ("dp_shard", with "dp_replicate" for HSDP) per transformer
  block and for the rest of the model, with mixed precision;
- activation checkpointing of blocks (none, full, every n-th block, or every block keeping the
  outputs of torchtitan's per-op policy: matmuls, attention, ...);
- mixed precision without FSDP (one device, pure data parallelism, tensor parallelism only): the
  same parameter cast FSDP's MixedPrecisionPolicy applies, per block and for the rest of the model,
  so a job computes in the same precision whatever its layout. torchtitan uses torch.autocast
  there (and no mixed precision at all for TP without FSDP); a layout-independent cast keeps
  sharded runs numerically equal to unsharded ones, which autocast's per-op policy would not.
- optionally the layer scan (`scan_layers`): the identical blocks compile once and run under
  `jax.lax.scan`, each recomputed in backward (so it takes the place of full or per-op activation
  checkpointing), with every block keeping its own parameters and layouts.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from ...backend.activation_checkpoint import EVERY_BLOCK_AC_MODES, apply_activation_checkpointing, checkpoint_module
from ...distributed import (
    ColwiseParallel,
    MixedPrecisionPolicy,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    fully_shard,
    parallelize_module,
)
from ...distributed.batch import (
    DATA_PARALLEL_DIMS,
    batch_placements,  # noqa: F401  (the model's batch layout; callers import it from here)
)
from ...distributed.mesh import JOB_MESH_DIMS, DeviceMesh
from ...distributed.params import release_parameter, use_parameter
from ...distributed.scan import scan_layers as scan_blocks
from ...hardware import TP_AXIS


def tp_plan(sequence_parallel: bool = True, loss_parallel: bool = True):
    """The tensor-parallel plans: (top-level plan, per-block plan)."""
    act = Shard(1) if sequence_parallel else Replicate()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "output": ColwiseParallel(
            input_layouts=act,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    block = {
        "attention": PrepareModuleInput(
            input_layouts=(act, None, None, None), desired_input_layouts=(Replicate(), None, None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=act),
        "feed_forward": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=act),
        "feed_forward.w3": ColwiseParallel(),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
        block["attention_norm"] = SequenceParallel()
        block["ffn_norm"] = SequenceParallel()
    return top, block


def _has(mesh: DeviceMesh, name: str) -> bool:
    return name in mesh.mesh_dim_names and mesh.size(name) > 1


def parallelize_llama(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    ac_mode: str = "none",
    ac_every: int = 1,
    scan_layers: bool = False,
    scan_start: int = 0,
    block_plan=None,
) -> torch.nn.Module:
    """Shard `model` (a torchtitan llama3 Transformer, on meta, CPU or tpu) over `mesh`.

    `mesh` is the job's root mesh with any of the dims "dp_replicate", "dp_shard", "tp"
    (size-1 dims may be left out).

    `ac_mode`: "none", "full", "selective" (every `ac_every`-th block recomputed) or "op" (every
    block recomputed but for the outputs of the ops activation_checkpoint.OpPolicy keeps,
    torchtitan's per-op selective checkpointing).

    `scan_layers=True` runs the blocks under one layer scan in compiled programs; the scan
    recomputes every block in backward, so it needs ac_mode "full" or "op" (the recomputation the
    scan does, keeping OpPolicy's op outputs with "op") and applies no other checkpoint wrapper.
    `scan_start` blocks in front (DeepSeek-V3's dense layers) stay outside the scan, each under
    the same activation checkpointing.

    `block_plan(block, plan)`, if given, returns the tensor-parallel plan for one block from the
    Llama 3 block plan `plan` (another family's attention or Mixture-of-Experts layers)."""
    if scan_layers and ac_mode not in EVERY_BLOCK_AC_MODES:
        raise ValueError(
            f"parallelize_llama: scan_layers=True recomputes every block in backward (full or per-op activation "
            f"checkpointing), but ac_mode={ac_mode!r}; use ac_mode='full' or 'op', or scan_layers=False"
        )
    names = mesh.mesh_dim_names
    unknown = [n for n in names if n not in JOB_MESH_DIMS]
    if unknown:
        raise ValueError(f"parallelize_llama: mesh dims {unknown} are not supported (use {', '.join(JOB_MESH_DIMS)})")
    if _has(mesh, TP_AXIS):
        tp = mesh[TP_AXIS]
        n = tp.size()
        args = model.model_args if hasattr(model, "model_args") else None
        n_kv = getattr(args, "n_kv_heads", None) or getattr(args, "n_heads", None)
        if args is not None and (args.n_heads % n or (n_kv and n_kv % n)):
            raise ValueError(f"tensor parallel degree {n} must divide n_heads={args.n_heads} and n_kv_heads={n_kv}")
        top, block = tp_plan(sequence_parallel, loss_parallel)
        parallelize_module(model, tp, top)
        for layer in model.layers.values():
            parallelize_module(layer, tp, block if block_plan is None else block_plan(layer, block))
    if ac_mode != "none" and not scan_layers:
        apply_activation_checkpointing(model.layers, ac_mode, ac_every)
    elif scan_layers:
        for name, layer in list(model.layers.named_children())[:scan_start]:
            setattr(model.layers, name, checkpoint_module(layer, save_ops=ac_mode == "op"))
    dp = [n for n in DATA_PARALLEL_DIMS if _has(mesh, n)]
    fsdp_applied = False
    if dp:
        dp_mesh = mesh[tuple(dp)] if len(dp) == 2 or dp == ["dp_shard"] else None
        if dp == ["dp_replicate"]:
            # pure data parallelism: parameters replicated, only the batch is split
            dp_mesh = None
        if dp_mesh is not None:
            mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
            for layer in model.layers.values():
                # shard the block itself, inside any checkpoint wrapper: its hooks then run
                # again when the backward recomputes the block
                fully_shard(getattr(layer, "module", layer), mesh=dp_mesh, mp_policy=mp)
            fully_shard(model, mesh=dp_mesh, mp_policy=mp)
            fsdp_applied = True
    if param_dtype is not None and not fsdp_applied:
        apply_param_cast(model, param_dtype)
    if scan_layers:
        # last: the scan checks that the blocks' layouts and hooks are identical
        scan_blocks(model.layers, start=scan_start, save_ops=ac_mode == "op")
    return model


def apply_param_cast(model: torch.nn.Module, param_dtype: torch.dtype) -> torch.nn.Module:
    """Mixed precision for a model that fully_shard does not manage: while a block (and, for the
    embedding, final norm and output projection, the whole model) runs forward, its floating
    parameters read as copies cast to `param_dtype`; their gradients flow back through the cast
    into the parameters' own dtype (the master copy). The cast copies live only during the
    forward of their module, and are made again when activation checkpointing recomputes it."""
    blocks = [getattr(layer, "module", layer) for layer in model.layers.values()]
    inner = {id(p) for b in blocks for p in b.parameters()}
    for block in blocks:
        _cast_while_running(block, param_dtype, skip=set())
    _cast_while_running(model, param_dtype, skip=inner)
    return model


def _cast_while_running(module: torch.nn.Module, dtype: torch.dtype, skip: set[int]) -> None:
    owned = [
        (owner, name)
        for owner in module.modules()
        for name, p in owner._parameters.items()
        if p is not None and id(p) not in skip and p.is_floating_point() and p.dtype != dtype
    ]

    def pre(mod, args):
        for owner, name in owned:
            use_parameter(owner, name, owner._parameters[name].to(dtype))

    def post(mod, args, out):
        for owner, name in owned:
            release_parameter(owner, name)
        return out

    if owned:
        module.register_forward_pre_hook(pre)
        # always_call: activation checkpointing's recomputation may stop early by raising; the cast
        # copies must not outlive it
        module.register_forward_hook(post, always_call=True)
