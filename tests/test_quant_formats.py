"""The NVFP4 and FP8 emulation (engines/quant_formats.py) against the formats'
definitions, on hand-made blocks: round to nearest with ties to even on the E2M1 grid,
saturation of values and scales, zeros, and the two-level NVFP4 scales."""

from __future__ import annotations

import torch

from specforge_dspark.engines.quant_formats import (
    fp8_round_trip,
    nvfp4_quantize,
    nvfp4_round_trip,
    round_e2m1,
    to_e4m3,
)


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 7.0, -100.0, 0.3, 2.6])
    # ties: 0.25 -> 0 (not 0.5), 0.75 -> 1 (not 0.5), 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
    # 3.5 -> 4, 5 -> 4: each to the value whose mantissa bit is 0
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -4.0, 6.0, -6.0, 0.5, 3.0]
    assert round_e2m1(x).tolist() == want
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert torch.equal(round_e2m1(grid), grid) and torch.equal(round_e2m1(-grid), -grid)


def test_a_block_holding_the_tensors_amax_gets_scale_448_and_keeps_its_grid_values():
    block = torch.tensor([6.0, -3.0, 2.5, 0.75, 0.25, 1.0, -1.5, 4.0, 5.0, 0, 0, 0, 0, 0, 0, 0])
    q, scales, global_scale = nvfp4_quantize(block[None])
    assert global_scale == 6.0 / (6 * 448) and scales.tolist() == [[448.0]]
    assert q[0, :9].tolist() == [6.0, -3.0, 2.0, 1.0, 0.0, 1.0, -1.5, 4.0, 4.0]
    assert torch.equal(nvfp4_round_trip(block[None]), q * (448.0 * global_scale))


def test_a_smaller_blocks_scale_is_rounded_to_e4m3_and_its_values_saturate_at_6():
    big = torch.zeros(16)
    big[0] = 6.0
    small = torch.linspace(-0.6, 0.6, 16)  # amax 0.6: scale 0.6 / (6 x 6/2688) = 44.8
    q, scales, global_scale = nvfp4_quantize(torch.cat([big, small])[None])
    assert to_e4m3(torch.tensor(44.8)).item() == 44.0  # E4M3 steps by 4 in [32, 64)
    assert scales.tolist() == [[448.0, 44.0]]
    step = 44.0 * global_scale  # one E2M1 unit of the small block
    assert small.abs().max() / step > 6  # the rounded-down scale pushes 0.6 past 6 units
    assert q[0, 16].item() == -6.0 and q[0, 31].item() == 6.0  # saturated, not overflowed
    want = round_e2m1(small / step) * step
    assert torch.equal(nvfp4_round_trip(torch.cat([big, small])[None])[0, 16:], want)


def test_zeros_and_underflowing_blocks_stay_zeros_without_nan():
    assert torch.equal(nvfp4_round_trip(torch.zeros(2, 32)), torch.zeros(2, 32))
    x = torch.zeros(1, 48)
    x[0, 0] = 1000.0  # the global amax
    x[0, 32:] = 1e-6  # a block whose scale falls below E4M3's smallest subnormal
    q, scales, _ = nvfp4_quantize(x)
    assert scales[0, 1:].tolist() == [0.0, 0.0]
    out = nvfp4_round_trip(x)
    assert not out.isnan().any() and out[0, 16:].abs().sum() == 0
    assert out[0, 0] == 1000.0


def test_nvfp4_refuses_a_row_that_is_not_whole_blocks():
    import pytest

    with pytest.raises(ValueError, match="not a multiple of 16"):
        nvfp4_quantize(torch.ones(2, 24))


def test_fp8_scales_each_row_to_448_and_rounds_to_e4m3():
    x = torch.tensor([[448.0, 1.0, -3.0, 0.1], [2.0, 1.0, 0.0, -0.5], [0.0, 0.0, 0.0, 0.0]])
    out = fp8_round_trip(x)
    assert torch.equal(out[0], to_e4m3(x[0]))  # scale 1: E4M3 itself (0.1 -> 0.1015625)
    assert out[0, 3].item() == 0.1015625
    assert torch.equal(out[1], x[1])  # scale 2/448: these values are exact in E4M3
    assert torch.equal(out[2], torch.zeros(4))
    per_tensor = fp8_round_trip(x, per_row=False)
    assert torch.equal(per_tensor[0], to_e4m3(x[0]))
