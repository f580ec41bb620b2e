"""Anchor blocks of a micro-batch: anchor sampling and the teacher-forced block tensors.

A block anchored at position a is the G block rows [x_a, MASK * (G-1)] at positions
a .. a+G-1, decoded over the context strictly before a. Its P drafted slots (P = G for
DSpark, G - 1 for DFlash: `num_drafts`) are supervised as slot k -> token x[a+k+1], with
the target's LM head on last_hidden[a+k] as teacher and x[a+k] as the "previous" token;
`build_blocks` computes these per-slot tensors, `block_inputs` the G block rows.

Shape legend
  B  sequences in the micro-batch        S  sequence length
  N  anchor blocks per sequence          G  block rows (block_size)
  P  drafted slots per block             K  anchors kept per sequence (<= N)
  T  candidate anchor positions (S - 1)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def sample_anchors(
    loss_mask_BS: Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Sample up to `num_anchors` anchor positions per sequence, uniformly without replacement.

    Eligible t in [0, S-2] with loss_mask[t] and loss_mask[t+1]. Each sequence gets
    min(num_anchors, #eligible) distinct anchors in its first columns (random order); the
    remaining columns are invalid (anchor 0, block_valid False). A sequence with no
    eligible position gets only invalid columns.

    The keys are drawn on the CPU (`generator`, if given, is a CPU generator) and moved to
    the mask's device, so the anchors are the same whatever device the batch is on.

    Returns anchors_BN (long) and block_valid_BN (bool), N = num_anchors.
    """
    B, S = loss_mask_BS.shape
    supervised_BS = loss_mask_BS.bool()
    eligible_BT = supervised_BS[:, :-1] & supervised_BS[:, 1:]  # T = S - 1 candidate anchors
    T = eligible_BT.shape[1]
    # The k smallest of iid uniform keys over the eligible set form a uniform k-subset.
    keys_BT = torch.rand(B, T, generator=generator).to(loss_mask_BS.device)
    keys_BT = keys_BT.masked_fill(~eligible_BT, 2.0)
    take = min(num_anchors, T)
    keys_BK, order_BK = keys_BT.sort(dim=1)
    valid_BK = keys_BK[:, :take] < 1.5
    anchors_BK = torch.where(valid_BK, order_BK[:, :take], 0)
    anchors_BN = anchors_BK.new_zeros(B, num_anchors)
    block_valid_BN = valid_BK.new_zeros(B, num_anchors)
    anchors_BN[:, :take] = anchors_BK
    block_valid_BN[:, :take] = valid_BK
    return anchors_BN, block_valid_BN


@dataclass
class Blocks:
    """Teacher-forced inputs and targets of N anchor blocks per sequence (all [B, N, G],
    G here the number of slots `build_blocks` was given)."""

    anchors_BN: Tensor
    block_valid_BN: Tensor
    ids_BNG: Tensor
    """Block input tokens [x_a, MASK, ..., MASK]."""
    pos_BNG: Tensor
    """Position ids a .. a+G-1."""
    labels_BNG: Tensor
    """y[j, k] = x[a_j + k + 1] (clamped into the sequence where invalid)."""
    prev_BNG: Tensor
    """prev[j, 0] = x[a_j], prev[j, k] = y[j, k-1]."""
    teacher_idx_BNG: Tensor
    """Index into last_hidden of slot k's teacher: a_j + k (clamped)."""
    eval_mask_BNG: Tensor
    """cumprod_k of (a+k+1 < S and loss_mask[a+k+1]), and the block is valid (bool)."""
    weight_BNG: Tensor
    """eval_mask * exp(-k / gamma) (float64: tiny, and exact enough for any compute dtype)."""


def build_blocks(
    input_ids_BS: Tensor,
    loss_mask_BS: Tensor,
    anchors_BN: Tensor,
    block_valid_BN: Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> Blocks:
    """Block inputs, positions, shifted labels, prefix eval mask and slot weights."""
    B, S = input_ids_BS.shape
    G = block_size
    k_G = torch.arange(G, device=anchors_BN.device)
    pos_BNG = anchors_BN[..., None] + k_G  # a + k
    label_pos_BNG = pos_BNG + 1  # a + k + 1
    in_seq_BNG = label_pos_BNG < S
    label_idx_BNG = label_pos_BNG.clamp(max=S - 1)
    flat = (B, -1)
    labels_BNG = input_ids_BS.gather(1, label_idx_BNG.reshape(flat)).view_as(pos_BNG)
    supervised_BNG = loss_mask_BS.bool().gather(1, label_idx_BNG.reshape(flat)).view_as(pos_BNG)
    valid_BNG = in_seq_BNG & supervised_BNG & block_valid_BN[..., None]
    eval_mask_BNG = valid_BNG.long().cumprod(dim=-1).bool()
    x_anchor_BN = input_ids_BS.gather(1, anchors_BN)
    prev_BNG = torch.cat([x_anchor_BN[..., None], labels_BNG[..., :-1]], dim=-1)
    ids_BNG = torch.full_like(prev_BNG, mask_token_id)
    ids_BNG[..., 0] = x_anchor_BN
    decay_G = torch.exp(-k_G.double() / gamma)
    return Blocks(
        anchors_BN=anchors_BN,
        block_valid_BN=block_valid_BN,
        ids_BNG=ids_BNG,
        pos_BNG=pos_BNG,
        labels_BNG=labels_BNG,
        prev_BNG=prev_BNG,
        teacher_idx_BNG=pos_BNG.clamp(max=S - 1),
        eval_mask_BNG=eval_mask_BNG,
        weight_BNG=eval_mask_BNG.double() * decay_G,
    )


def block_inputs(
    input_ids_BS: Tensor, anchors_BN: Tensor, block_size: int, mask_token_id: int
) -> tuple[Tensor, Tensor]:
    """Block row tokens [x_a, MASK, ..., MASK] and positions a .. a+G-1 (both `[B, N, G]`)."""
    G = block_size
    pos_BNG = anchors_BN[..., None] + torch.arange(G, device=anchors_BN.device)
    ids_BNG = torch.full_like(pos_BNG, mask_token_id)
    ids_BNG[..., 0] = input_ids_BS.gather(1, anchors_BN)
    return ids_BNG, pos_BNG


def used_columns(block_valid_BN: Tensor) -> int:
    """Anchor columns up to the last one with a valid block anywhere in the batch, at least
    one: trailing columns contribute nothing, but one is kept so every parameter still
    receives a (zero) gradient on every rank."""
    any_valid_N = block_valid_BN.any(dim=0)
    return max(int(any_valid_N.nonzero().max()) + 1 if any_valid_N.any() else 0, 1)
