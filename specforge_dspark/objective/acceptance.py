"""Objective options aimed at the accept length itself: D-PACE slot weights
(`objective.slot_weighting: dpace`) and the LK divergence (`objective.divergence: lk`).
Pure functions of per-slot statistics; `vocab_loss.slot_terms_` applies them inside its
chunks. The defaults (fixed decay weights, L1) are DSPARK_SPEC.md section 3.

D-PACE. A block's expected number of accepted drafts is E = sum_t prod_{j<=t} c_j, c_j the
chance that slot j is accepted given the slots before it were. Its derivative wrt log c_k is
    w_k = sum_{t>=k} prod_{j<=t} c_j,
so weighting slot k's per-slot loss (whose gradient moves log c_k) by the detached w_k
spends the gradient where the accept length is bought, and the weights move as the
drafter improves (a fixed exp(-k / gamma) does not). c_j is the drafter's probability of
the label, exp(-CE_j), smoothed as (1 - a) c_j + a (`objective.dpace_alpha` = a) so that
one unconfident early slot does not silence every later one. Slots outside the block's
supervised prefix weigh 0. The weighted terms are normalised by the count of supervised
slots (the decay weights by their own sum).

LK. Under speculative sampling a slot is accepted with probability
alpha = sum_v min(p_v, q_v) = 1 - L1 / 2. `lk` trains -log alpha in place of L1: its
gradient is L1's scaled by 1 / (2 alpha), large where acceptance is low. alpha is floored
at LK_FLOOR, below which the slot's divergence gradient is 0 (as a clamp's).

Shape legend: X blocks, G drafted slots per block, M = X * G slots.
"""

from __future__ import annotations

import torch
from torch import Tensor

LK_FLOOR = 1e-6


def dpace_weights(conf_XG: Tensor, mask_XG: Tensor, smoothing: float) -> Tensor:
    """D-PACE weight of each slot [X, G] (no gradient): mask_k * sum_{t>=k} mask_t *
    prod_{j<=t} s_j, s_j = (1 - smoothing) * conf_j + smoothing on supervised slots (1 on
    the others; `mask_XG` is each block's supervised prefix)."""
    with torch.no_grad():
        m_XG = mask_XG.to(conf_XG.dtype)
        s_XG = torch.where(mask_XG, (1.0 - smoothing) * conf_XG + smoothing, 1.0)
        reach_XG = s_XG.cumprod(dim=-1) * m_XG
        return reach_XG.flip(-1).cumsum(dim=-1).flip(-1) * m_XG


def divergence(kind: str, l1_M: Tensor, alpha_M: Tensor) -> tuple[Tensor, Tensor | None]:
    """Per-slot divergence value [M] and the factor on L1's gradient that gives its own
    (None = 1): `l1` is L1 itself; `lk` is -log alpha (alpha = 1 - L1 / 2 clamped to
    [0, 1], floored at LK_FLOOR)."""
    if kind == "l1":
        return l1_M, None
    if kind == "lk":
        live_M = alpha_M > LK_FLOOR
        value_M = -alpha_M.clamp_min(LK_FLOOR).log()
        scale_M = torch.where(live_M, 0.5 / alpha_M.clamp_min(LK_FLOOR), 0.0)
        return value_M, scale_M
    raise ValueError(f"objective.divergence: unknown {kind!r} (l1 or lk)")
