"""The draft's rotary position tables, with the target's RoPE scaling, as SGLang serves them.

A drafter attends over the target's context at the target's positions, so it rotates with
the target's RoPE: its base (`rope_theta`) and, for long-context targets, its scaling
(`draft.rope_scaling`: the target config's `rope_parameters` without `rope_theta`). The
tables follow SGLang 0.5.23's `get_rope` (layers/rotary_embedding/factory.py), which the
DSPARK and DFLASH draft models build from the export's `rope_parameters`:

- default: inv_freq_e = 1 / theta^(2e / E), angle = position * inv_freq.
- linear (`factor`): positions divided by the factor (LinearScalingRotaryEmbedding).
- llama3 (`factor`, `low_freq_factor` 1, `high_freq_factor` 4,
  `original_max_position_embeddings`): wavelengths above orig / low divided by the
  factor, below orig / high kept, smoothly mixed between (Llama3RotaryEmbedding).
- yarn (`factor`, `original_max_position_embeddings`, `beta_fast` 32, `beta_slow` 1,
  `extrapolation_factor` 1, `attn_factor` 1, `truncate` true, `mscale`/`mscale_all_dim`):
  the frequencies between the two correction dims ramp from interpolated (/ factor) to
  extrapolated, and cos/sin are multiplied by the magnitude scale
  (YaRNScalingRotaryEmbedding: 0.1 ln(factor) + 1, times attn_factor).

Dynamic NTK scaling is refused (config/rope.py): its tables depend on the served length.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from specforge_dspark.config.rope import rope_type


def _yarn_dim(rotations: float, dim: int, theta: float, positions: int) -> float:
    """The rotary dim whose wavelength turns `rotations` times over `positions`."""
    return dim * math.log(positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def _yarn(wave_e: torch.Tensor, head_dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    """(inv_freq, magnitude) from theta^(2e / E), SGLang's pos_freqs."""
    factor = float(s["factor"])
    orig = s["original_max_position_embeddings"]
    low = _yarn_dim(s.get("beta_fast", 32), head_dim, theta, orig)
    high = _yarn_dim(s.get("beta_slow", 1), head_dim, theta, orig)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp_e = ((torch.arange(head_dim // 2, dtype=wave_e.dtype) - low) / (high - low)).clamp(0, 1)
    keep_e = (1 - ramp_e) * s.get("extrapolation_factor", 1)  # 1: extrapolated, as trained
    inv_e = 1.0 / (factor * wave_e) * (1 - keep_e) + 1.0 / wave_e * keep_e

    def magnitude(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if s.get("mscale") is not None and s.get("mscale_all_dim") is not None:
        scale = magnitude(s["mscale"]) / magnitude(s["mscale_all_dim"])
    else:
        scale = magnitude()
    return inv_e, float(scale) * s.get("attn_factor", 1)


def _llama3(inv_e: torch.Tensor, s: dict) -> torch.Tensor:
    factor, orig = float(s["factor"]), s["original_max_position_embeddings"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    wave_e = 2 * math.pi / inv_e
    smooth_e = (orig / wave_e - low) / (high - low) if low != high else 0
    mixed_e = (1 - smooth_e) * inv_e / factor + smooth_e * inv_e
    return torch.where(wave_e < orig / high, inv_e,
                       torch.where(wave_e > orig / low, inv_e / factor, mixed_e))  # fmt: skip


def rope_tables(
    pos_BT: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    scaling: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[B, T, E/2]` at absolute positions, as SGLang's fp32 cos_sin_cache rows
    (fp64 when the model runs in fp64), with `scaling` (module docstring)."""
    wide = torch.promote_types(dtype, torch.float32)
    exponent_e = torch.arange(0, head_dim, 2, device=pos_BT.device, dtype=wide) / head_dim
    inv_e = 1.0 / theta**exponent_e  # yarn recomputes from theta^exponent (below)
    pos, scale, kind = pos_BT.to(wide), 1.0, rope_type(scaling)
    if kind == "linear":
        pos = pos / float(scaling["factor"])
    elif kind == "llama3":
        inv_e = _llama3(inv_e, scaling)
    elif kind == "yarn":
        inv_e, scale = _yarn(theta**exponent_e, head_dim, theta, scaling)
    elif kind != "default":
        raise ValueError(f"rope_type {kind!r} is not supported (drafters/rope.py)")
    angle_BTe = pos[..., None] * inv_e
    if scale == 1.0:
        return angle_BTe.cos(), angle_BTe.sin()
    return angle_BTe.cos() * scale, angle_BTe.sin() * scale
