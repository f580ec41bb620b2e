"""The arithmetic of the quantized formats targets are served in, emulated exactly in
torch where no engine on this CPU runs the format's kernels.

NVFP4 (two-level scaling, as NVIDIA's Model Optimizer and Transformer Engine define it):
values are FP4 E2M1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and a sign), in blocks of 16
consecutive elements along the last (input) dimension; each block has an FP8 E4M3 scale
and the tensor one FP32 scale:
    global = amax(tensor) / (6 * 448)
    block  = e4m3(amax(block) / (6 * global))            saturated at 448
    q      = e2m1(x / (block * global))                   round to nearest, ties to even,
                                                           saturated at 6
    x'     = q * block * global
A zero block (or tensor) has scale 0 and dequantizes to zeros.

FP8 E4M3 (max 448) with one FP32 scale per output row (`per_row`) or per tensor:
    scale = amax / 448;  x' = e4m3(x / scale) * scale
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Index i has mantissa bit i % 2: a tie goes to the even index (round half to even)."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to the nearest E2M1 value (ties to the even mantissa), saturated at +-6;
    float32 out."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    a = x.double().abs().clamp(max=E2M1_MAX)
    dist = (a[..., None] - grid).abs()  # [..., 8]
    nearest = dist == dist.min(-1, keepdim=True).values  # one, or two adjacent on a tie
    even = nearest & (torch.arange(len(E2M1_VALUES)) % 2 == 0)
    pick = torch.where(even.any(-1), even.double().argmax(-1), nearest.double().argmax(-1))
    return (grid[pick] * torch.sign(x.double())).float()


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """`x` as FP8 E4M3 (round to nearest even, saturated at +-448), back in float32."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def nvfp4_quantize(
    x_NK: torch.Tensor, per_row: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] on the E2M1 grid, block scales [N, K/16] on the E4M3 grid, the global
    FP32 scale: one, or with `per_row` one per row [N, 1]) of `x_NK`; K a multiple of 16."""
    if x_NK.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"nvfp4: the last dimension {x_NK.shape[-1]} is not a multiple of 16")
    x = x_NK.float()
    blocks = x.reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
    amax = x.abs().amax(-1, keepdim=True) if per_row else x.abs().amax()
    global_scale = amax / (E2M1_MAX * E4M3_MAX)
    safe = torch.where(global_scale > 0, global_scale, torch.ones_like(global_scale))
    block = torch.where(
        global_scale > 0, to_e4m3(blocks.abs().amax(-1) / (E2M1_MAX * safe)), 0.0
    )  # a zero tensor (or row) has scale 0 and stays zeros
    denom = (block * global_scale)[..., None]
    q = torch.where(denom > 0, round_e2m1(blocks / denom.clamp_min(1e-45)), 0.0)
    return q.reshape(x.shape), block, global_scale


def nvfp4_dequantize(q: torch.Tensor, block: torch.Tensor, global_scale: torch.Tensor):
    blocks = q.reshape(*q.shape[:-1], -1, NVFP4_BLOCK)
    return (blocks * (block * global_scale)[..., None]).reshape(q.shape)


def nvfp4_round_trip(x: torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """What the served NVFP4 kernels compute with in place of `x` (float32, same shape);
    `per_row`: each row its own global scale (activations: a row's result then does not
    depend on which other rows share its batch)."""
    return nvfp4_dequantize(*nvfp4_quantize(x, per_row))


def fp8_round_trip(x: torch.Tensor, per_row: bool = True) -> torch.Tensor:
    """`x` through FP8 E4M3 with one scale per row (last dim reduced) or per tensor."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True) if per_row else x.abs().amax()
    scale = amax / E4M3_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.where(scale > 0, to_e4m3(x / safe) * safe, torch.zeros_like(x))
