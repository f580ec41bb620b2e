"""fp8 aux rows (target.transport_dtype fp8_e4m3): the slot writer quantizes them, the
trainer dequantizes them where the features land (features.TargetFeatures.to).

Legend: N rows, m aux layers, H hidden size, D = m*H (an aux row is its m layers' hidden
states side by side).

Each (row, aux layer) has its own float32 scale, its largest magnitude over FP8_MAX, so a
shallow layer of small magnitudes keeps e4m3's 3 mantissa bits beside a deep layer of
large ones (one scale across the row would push the shallow layer into e4m3's
subnormals): q = e4m3(x / scale), x ~ q * scale, every element within 1/16 of itself, or
within 2**-10 of its (row, layer)'s largest when below 2**-6 of it (the subnormals).
Scales are at least SCALE_MIN, so an all-zero or near-zero row comes back as zeros,
never NaN or inf. The last hidden state, which makes the teacher's logits, is not
quantized (it crosses in bfloat16: shm.SlotLayout).

Both directions work through blocks of rows whose float32 temporaries stay within
BLOCK_BYTES: quantizing a 4096-token Inkling request (aux 5 x 6144) in one pass would take
~1.1 GB of temporaries on the server's GPU, outside every memory model. Each (row, layer)
is computed on its own, so the blocks give the bytes of one pass over all rows, and a GPU
gives the bytes of the CPU (one IEEE multiply per element, rounded once).

Standard library and torch only: the slot writer uses it inside every engine's server.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE_MIN = torch.finfo(torch.float32).tiny  # the least scale: x / scale stays finite
BLOCK_BYTES = 32 << 20  # float32 bytes of one block of rows


def block_rows(width: int) -> int:
    """Rows of `width` elements whose float32 copy fits in BLOCK_BYTES (at least one)."""
    return max(1, BLOCK_BYTES // (4 * width))


def quantize(x_NLH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes [N, m, H] (float8_e4m3fn) and float32 scales [N, m] of x [N, m, H] (any
    float dtype), in one pass: each (row, layer)'s largest magnitude at FP8_MAX."""
    amax_NL = x_NLH.detach().abs().amax(-1).float()
    scale_NL = (amax_NL / FP8_MAX).clamp_min(SCALE_MIN)
    return torch.div(x_NLH.detach(), scale_NL[..., None]).to(FP8), scale_NL


def quantize_into(x_ND: torch.Tensor, q_ND: torch.Tensor, scale_NL: torch.Tensor) -> None:
    """Quantize rows x [N, D] (any device and float dtype) into q [N, D] float8_e4m3fn
    and scale [N, m] float32 (a slot's or a staging buffer's memory), a block of rows at
    a time (module docstring)."""
    N, D = x_ND.shape
    m = scale_NL.shape[1]
    step = block_rows(D)
    for i in range(0, N, step):
        q_RLH, scale_RL = quantize(x_ND[i : i + step].reshape(-1, m, D // m))
        q_ND[i : i + step].copy_(q_RLH.view(-1, D))
        scale_NL[i : i + step].copy_(scale_RL)


def dequantize(q_ND: torch.Tensor, scale_NL: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [N, D] in `dtype` from fp8 codes q [N, D] and their scales [N, m] (float32),
    on q's device, a block of rows at a time: layer i of row r is q * scale[r, i]
    computed in float32, then rounded to `dtype`."""
    N, D = q_ND.shape
    m = scale_NL.shape[1]
    out_ND = torch.empty((N, D), dtype=dtype, device=q_ND.device)
    step = block_rows(D)
    for i in range(0, N, step):
        q_RLH = q_ND[i : i + step].reshape(-1, m, D // m)
        x_RLH = q_RLH.float() * scale_NL[i : i + step, :, None]
        out_ND[i : i + step].copy_(x_RLH.view(-1, D))
    return out_ND
