"""torchtpu.costing: the arithmetic the dry runs and the benchmarks share, and its HLO text parsers.
Standard library only: no TPU, no JAX needed."""

from __future__ import annotations

import pytest

from torchtpu.costing import at_depth, count_collectives, depth_extrapolated_cost, mfu_percent, roofline_seconds


def test_at_depth_extrapolates_linearly_and_keeps_counts_whole():
    # 2 layers: 10 units, 4 layers: 16 units -> 3 per layer over 4 at 2 layers
    assert at_depth(10, 16, 2, 4, 32) == 4 + 3 * 32
    assert at_depth(10.0, 16.0, 2, 4, 32) == pytest.approx(100.0)
    assert at_depth(10, 17, 2, 4, 3) == 13  # 10 + 1 * 7 // 2: a count stays a whole number
    assert isinstance(at_depth(10, 17, 2, 4, 3), int)
    assert at_depth(10.0, 17.0, 2, 4, 3) == pytest.approx(13.5)


def test_depth_extrapolated_cost():
    a = {"flops_per_device": 2e12, "bytes_accessed_per_device": 1e9, "estimated_step_seconds": 0.01}
    b = {"flops_per_device": 3e12, "bytes_accessed_per_device": 1.5e9, "estimated_step_seconds": 0.014}
    est = depth_extrapolated_cost(a, b, 2, 4, 32)
    assert est["flops_per_device"] == pytest.approx(2e12 + 30 * 0.5e12)
    assert est["bytes_accessed_per_device"] == pytest.approx(1e9 + 30 * 0.25e9)
    assert est["estimated_step_seconds"] == pytest.approx(0.01 + 30 * 0.002)
    assert est["roofline_seconds"] is None  # neither report has one
    assert est["per_layer"] == pytest.approx({"flops_per_device": 0.5e12, "estimated_step_seconds": 0.002})
    assert est["method"] == "XLA cost model on unrolled 2- and 4-layer programs, extrapolated to 32 layers"
    with pytest.raises(ValueError, match="0 <= depth_a < depth_b"):
        depth_extrapolated_cost(a, b, 4, 2, 32)


def test_mfu_and_roofline():
    # 8 chips of 459 TFLOP/s for 2 s could do 7.344e15 FLOPs; the model did half that
    assert mfu_percent(3.672e15, 2.0, 8, 459e12) == pytest.approx(50.0)
    # 1e12 FLOPs at 1e14 FLOP/s: 10 ms; 1e9 bytes at 1e12 B/s: 1 ms
    assert roofline_seconds(1e12, 1e9, 1e14, 1e12) == pytest.approx(0.01)
    assert roofline_seconds(1e10, 1e10, 1e14, 1e12) == pytest.approx(0.01)


def test_count_collectives_on_hlo_text():
    hlo = """
%all-reduce-scatter.2 (input: f32[512,64]) -> f32[128,64] {
  %all-reduce.5 = f32[512,64]{1,0} all-reduce(%input), channel_id=9, to_apply=%add
  ROOT %dynamic-slice.8 = f32[128,64]{1,0} dynamic-slice(%all-reduce.5, %i, %j), dynamic_slice_sizes={128,64}
}

ENTRY %main.1 (p0: f32[128,64]) -> f32[512,64] {
  %ag-start = (f32[128,64], f32[512,64]) all-gather-start(%p0), dimensions={0}
  %ag-done = f32[512,64] all-gather-done(%ag-start)
  %all-gather.3 = f32[512,64]{1,0} all-gather(%p0), dimensions={0}
  %fusion = f32[128,64]{1,0} fusion(%ag-done), kind=kCustom, calls=%all-reduce-scatter.2
  %cp = f32[128,64]{1,0} collective-permute(%fusion), source_target_pairs={{0,1}}
  %a2a = f32[128,64]{1,0} all-to-all(%cp), dimensions={0}
  ROOT %rs = f32[32,64]{1,0} reduce-scatter(%a2a), dimensions={0}, to_apply=%add
}
"""
    assert count_collectives(hlo) == {
        "all-gather": 2,
        "reduce-scatter": 2,
        "all-reduce": 0,
        "all-to-all": 1,
        "collective-permute": 1,
    }
