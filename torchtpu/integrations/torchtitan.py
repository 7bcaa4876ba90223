"""torchtitan's own trainer (`torchrun ... -m torchtitan.train`) on tpu: its two CUDA-only pieces.

- **The MoE token permutation.** Before its grouped matmuls, torchtitan's MoE layer
  (`moe/utils.py`, `indices_padding_wrapper`) orders the tokens by expert, padding each expert's
  group to an aligned size, with a Triton kernel (`moe/kernels.py`, `fill_indices_wrapper`) whose CPU
  variant reads every count back to the host. On tpu tensors `fill_indices_wrapper` runs
  `permutation_indices` here: the same indices computed with tensor ops on the device, no host sync.
- **The peak FLOPs behind its MFU.** `tools/utils.get_peak_flops(device_name)` knows GPUs only and
  falls back to an A100's 312 TFLOP/s; for a TPU's device name (`torch.tpu.get_device_name()`, XLA's
  device kind, e.g. "TPU v5p") it answers the chip's bf16 peak from torchtpu's chip table.

Both take effect when torchtitan's module is imported (now or later: an import hook) and leave
every other device to torchtitan's own code.

And one cost of importing torchtitan, on every device: `torchtitan.models.attention` compiles its
attention wrappers in class bodies (`torch.compile(varlen_attn, mode="max-autotune-no-cudagraphs")`),
and building an inductor-backed compiled function imports inductor's compiler, 1.4 s of every
process that imports torchtitan, whether or not its model ever calls them. Where torchtitan is imported
after torchtpu (torchtpu-train), `torch.compile` returns, while that module's body runs, a function that
compiles on its first call with the same arguments.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .on_import import patch_on_import

_PATCHED = "_torchtpu"


def permutation_indices(
    tokens_per_expert_group, start_index_values, write_offsets, experts_per_rank, num_ranks, max_len
):
    """torchtitan's `fill_indices_wrapper` as tensor ops: a (max_len,) int32 tensor whose position
    `write_offsets[e] + (tokens of expert e from ranks before r) + j` holds `start_index_values[r *
    experts_per_rank + e] + j` for each local expert e, rank r and j < that rank's count, and -1
    elsewhere (the padding, which picks the appended zero row)."""
    counts = tokens_per_expert_group.view(num_ranks, experts_per_rank).t().reshape(-1).to(torch.int64)
    starts = start_index_values.view(num_ranks, experts_per_rank).t().reshape(-1).to(torch.int64)
    # destination of each (expert, rank) chunk, in destination order (expert-major)
    per_expert = counts.view(experts_per_rank, num_ranks)
    before = torch.cumsum(per_expert, 1) - per_expert
    dest = (write_offsets.to(torch.int64).view(-1, 1) + before).reshape(-1)
    p = torch.arange(max_len, device=counts.device, dtype=torch.int64)
    chunk = (p.view(-1, 1) >= dest.view(1, -1)).sum(1) - 1
    chunk = chunk.clamp(min=0)
    j = p - dest[chunk]
    valid = (j >= 0) & (j < counts[chunk])
    out = torch.where(valid, starts[chunk] + j, torch.full_like(j, -1))
    return out.to(torch.int32)


def _peak_flops_for_tpu(get_peak_flops):
    def peak_flops(device_name: str) -> float:
        from ..hardware import chip_of

        chip = chip_of(device_name)
        return chip.peak_bf16_flops if chip is not None else get_peak_flops(device_name)

    setattr(peak_flops, _PATCHED, True)
    return peak_flops


def _patch_kernels(module) -> None:
    original = module.fill_indices_wrapper
    if getattr(original, _PATCHED, False):
        return

    def fill_indices_wrapper(
        tokens_per_expert_group,
        start_index_values,
        write_offsets,
        experts_per_rank,
        num_ranks,
        max_len,
        *args,
        **kwargs,
    ):
        if tokens_per_expert_group.device.type == "tpu":
            return permutation_indices(
                tokens_per_expert_group, start_index_values, write_offsets, experts_per_rank, num_ranks, max_len
            )
        return original(
            tokens_per_expert_group,
            start_index_values,
            write_offsets,
            experts_per_rank,
            num_ranks,
            max_len,
            *args,
            **kwargs,
        )

    setattr(fill_indices_wrapper, _PATCHED, True)
    module.fill_indices_wrapper = fill_indices_wrapper


def _patch_utils(module) -> None:
    if not getattr(module.get_peak_flops, _PATCHED, False):
        module.get_peak_flops = _peak_flops_for_tpu(module.get_peak_flops)


class CompiledOnFirstCall:
    """`torch.compile(fn, **options)`, made the first time it is called (or an attribute of the compiled
    function is read). Called inside a graph that dynamo traces, it traces `fn` itself, as dynamo does
    with a compiled function called there."""

    def __init__(self, compile, fn, options):
        functools.update_wrapper(self, fn)
        self._compile = compile
        self._fn = fn
        self._options = options
        self._compiled = None

    def compiled(self):
        if self._compiled is None:
            self._compiled = self._compile(self._fn, **self._options)
        return self._compiled

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self._fn(*args, **kwargs)  # inside a graph dynamo traces: as it does a nested compiled function
        return self.compiled()(*args, **kwargs)

    def __getattr__(self, name):
        if name in ("_compile", "_fn", "_options", "_compiled"):  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.compiled(), name)


@contextlib.contextmanager
def compile_on_first_call():
    """`torch.compile(fn, ...)` gives a CompiledOnFirstCall while this is entered (a decorator use,
    `torch.compile(...)` without a function, too)."""
    compile = torch.compile

    def deferred(model=None, **options):
        if model is None:
            return lambda fn: CompiledOnFirstCall(compile, fn, options)
        return CompiledOnFirstCall(compile, model, options)

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = compile


_PATCHES = {"torchtitan.models.moe.kernels": _patch_kernels, "torchtitan.tools.utils": _patch_utils}
_AROUND = {"torchtitan.models.attention": compile_on_first_call}


def install() -> None:
    patch_on_import(_PATCHES, _AROUND)
