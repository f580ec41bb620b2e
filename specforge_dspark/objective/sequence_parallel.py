"""Sequence parallelism of the objective (`dist.sequence_parallel` = P ranks per sequence).

The positions of each sequence are cut into P equal slices, s = ceil(S / P) each (the last
padded): rank p of a sequence group holds the aux features of positions [p*s, (p+1)*s)
and the final hidden states of the same rows plus a halo of block_size - 1 (the teachers of
its last anchors' slots). The token ids, loss mask and packed position ids (integers) are
whole on every rank. Every rank of the group draws the same anchors over the whole sequence
(the same ones a run with P = 1 draws for that sequence and seed); rank p keeps those in
its slice, in their sampled order, and every rank pads to the same count n (the largest
over the group, computable on every rank without a collective).

A rank computes its slice's context keys and values and its own blocks' queries, keys and
values; attention runs across the group with DeepSpeed's Ulysses
(`deepspeed.sequence.layer.DistributedAttention`): an all-to-all gives each rank every
position for A/P heads, attention runs over the whole context for those heads, and the
inverse all-to-all returns each rank its own queries with every head. Heads must divide by
P (DeepSpeed's even layout; refused at load, config/validate.py). Ulysses rather than a
ring: the draft's queries are a few blocks per anchor over a long context, so the
all-to-all moves Q + S rows per layer once, where a ring would pass the context's keys P - 1
times; and DeepSpeed ships it, tested. The gathered order is rank-major: queries
[Q_0, Q_1, ...], keys [S_0, Q_0, S_1, Q_1, ...] (`gathered_masks` builds the masks in it).

The loss, the frozen head and the vocab loss then run on each rank's own anchors; the loss
normaliser is pooled over every rank (objective/loss.py), and DeepSpeed averages the
gradients over every rank, so the update equals P = 1's on the same batch.

Shape legend as in objective/loss.py, plus P ranks per sequence, s positions per rank,
n anchor columns per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class SeqShard:
    """This rank's place in its sequence group."""

    group: Any
    """The group's torch.distributed process group (its P ranks)."""
    index: int
    size: int

    def span(self, S: int) -> tuple[int, int]:
        """(first position, positions per rank s) of this rank's slice of S positions."""
        s = math.ceil(S / self.size)
        return self.index * s, s

    def window(self, S: int, halo: int) -> tuple[int, int]:
        """(first position, rows) this rank asks the engine for (PaddedBatch.window): its
        slice of S positions and `halo` rows after it."""
        lo, s = self.span(S)
        return lo, s + halo


def shard_features(feats, shard: SeqShard, halo: int) -> tuple[Tensor, Tensor]:
    """This rank's slice of a batch's features (`TargetFeatures`, or anything with its
    aux_hidden and last_hidden): aux `[B, s, D]` and last `[B, s+halo, H]` (rows past the
    sequence are zeros), from every position's rows, or from a window of them that holds
    the slice (row0: the window's first position, SeqShard.window; the positions are
    then input_ids')."""
    row0 = getattr(feats, "row0", None)
    S = feats.aux_hidden.shape[1] if row0 is None else feats.input_ids.shape[1]
    lo, s = shard.span(S)
    lo -= row0 or 0
    return _rows(feats.aux_hidden, lo, s), _rows(feats.last_hidden, lo, s + halo)


def _rows(x_BSX: Tensor, lo: int, n: int) -> Tensor:
    got = x_BSX[:, lo : lo + n]
    if got.shape[1] == n:
        return got
    pad = got.new_zeros(got.shape[0], n - got.shape[1], *got.shape[2:])
    return torch.cat((got, pad), 1)


def split_anchors(
    anchors_BN: Tensor, block_valid_BN: Tensor, S: int, ranks: int
) -> tuple[Tensor, Tensor]:
    """Every rank's anchors `[B, P, n]` and their validity: rank p's are the valid anchors
    in its slice, in their column order, then invalid columns (anchor 0); n is the most
    any rank holds of any sequence (at least 1)."""
    B, N = anchors_BN.shape
    s = math.ceil(S / ranks)
    owner_BN = torch.where(block_valid_BN, anchors_BN // s, ranks)  # invalid: no rank
    mine_BPN = owner_BN[:, None, :] == torch.arange(ranks, device=anchors_BN.device)[:, None]
    n = max(int(mine_BPN.sum(-1).max()), 1)
    # a stable sort puts each rank's columns first, in their order
    order_BPN = torch.sort((~mine_BPN).to(torch.int8), dim=-1, stable=True).indices[..., :n]
    valid_BPn = mine_BPN.gather(-1, order_BPN)
    anchors_BPn = anchors_BN[:, None, :].expand(B, ranks, N).gather(-1, order_BPN)
    return torch.where(valid_BPn, anchors_BPn, 0), valid_BPn


def gathered_masks(
    draft,
    anchors_BPn: Tensor,
    valid_BPn: Tensor,
    ctx_valid_BS: Tensor,
    starts_BPn: Tensor | None,
    rows: int,
):
    """The drafter's masks (`draft.masks`) for every rank's blocks, in the gathered order:
    queries rank-major, keys [ctx slice p ; blocks of p] for p = 0 .. P-1.

    ctx_valid_BS: the whole sequence's, padded to P*s; rows: block rows R per anchor."""
    B, P, n = anchors_BPn.shape
    s, Q = ctx_valid_BS.shape[1] // P, n * rows
    flat = (B, P * n)
    starts = None if starts_BPn is None else starts_BPn.reshape(flat)
    masks = draft.masks(anchors_BPn.reshape(flat), valid_BPn.reshape(flat), ctx_valid_BS, starts)
    ctx_keys_PS = torch.arange(P * s, device=anchors_BPn.device).view(P, s)
    blk_keys_PQ = P * s + torch.arange(P * Q, device=anchors_BPn.device).view(P, Q)
    order_K = torch.cat((ctx_keys_PS, blk_keys_PQ), 1).reshape(-1)
    if isinstance(masks, torch.Tensor):
        return masks[..., order_K]
    return {kind: m[..., order_K] for kind, m in masks.items()}


class UlyssesAttend:
    """`layers.Attend` across a sequence group: DeepSpeed's `DistributedAttention` over
    `[B, T, A, E]` (batch first: scatter the heads, gather the positions), with the
    drafter's own local attention (`local`, `layers.attend_local`) over every rank's keys."""

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, q_BAQE, k_BAKE, v_BAKE, visible_B1QK, empty_B1Q1, local) -> Tensor:
        from deepspeed.sequence.layer import DistributedAttention

        def over_all(q_BQaE, k_BKaE, v_BKaE, visible, empty) -> Tensor:  # this rank's heads
            q, k, v = (x.transpose(1, 2) for x in (q_BQaE, k_BKaE, v_BKaE))
            return local(q, k, v, visible, empty).transpose(1, 2)

        attention = DistributedAttention(over_all, self.group, scatter_idx=2, gather_idx=1)
        q, k, v = (x.transpose(1, 2) for x in (q_BAQE, k_BAKE, v_BAKE))
        return attention(q, k, v, 0, None, visible_B1QK, empty_B1Q1).transpose(1, 2)
