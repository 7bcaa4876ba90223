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
"""

from __future__ import annotations

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


_PATCHES = {"torchtitan.models.moe.kernels": _patch_kernels, "torchtitan.tools.utils": _patch_utils}


def install() -> None:
    patch_on_import(_PATCHES)
