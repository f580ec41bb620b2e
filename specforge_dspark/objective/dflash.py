"""DFlash training objective: the DSpark objective's machinery under the DFlash slot convention.

Slot convention (SGLang DFLASH, see dflash.py): the block anchored at a is
[x_a, MASK * (G-1)] at positions a .. a+G-1 over the context strictly before a; its row i
(i = 1 .. G-1) drafts the token x[a+i]. Written as drafted slot k = i - 1 (k = 0 .. G-2)
that is label x[a+k+1], teacher lm_head(last_hidden[a+k]), exactly the first G-1 slots of
a DSpark block at the same anchor: `objective.build_blocks` with block size G-1 gives the
labels, teacher indices, prefix eval mask and weights exp(-k / gamma); only the hidden
state feeding slot k is row k+1 of the G-row block instead of row k. So the anchors, the
chunked vocab-sized loss (`objective._FusedVocabLoss`: 0.1 CE + 0.9 L1 by default, no BCE:
there is no confidence head), the normalisation over data-parallel ranks and the metrics
are DSpark's (objective.py's module docstring), with G-1 positions per block; `tau` is the
teacher-forced accept length 1 + accepted drafts.

Shape legend as in objective.py; G is the block size, P = G - 1 drafted slots.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from specforge_dspark.drafters.dflash import DFlashDraft
from specforge_dspark.frozen_head import FrozenHead
from specforge_dspark.objective.dspark import (
    LossOutput,
    _FusedVocabLoss,
    _metrics,
    _VocabPlan,
    build_blocks,
    sample_anchors,
)
from specforge_dspark.recipe import ObjectiveRecipe

log = logging.getLogger(__name__)


def dflash_block_inputs(
    input_ids_BS: Tensor, anchors_BN: Tensor, block_size: int, mask_token_id: int
) -> tuple[Tensor, Tensor]:
    """Block tokens [x_a, MASK, ..., MASK] and positions a .. a+G-1 (both `[B, N, G]`)."""
    G = block_size
    pos_BNG = anchors_BN[..., None] + torch.arange(G, device=anchors_BN.device)
    ids_BNG = torch.full_like(pos_BNG, mask_token_id)
    ids_BNG[..., 0] = input_ids_BS.gather(1, anchors_BN)
    return ids_BNG, pos_BNG


def compute_dflash_loss(
    draft: DFlashDraft,
    head: FrozenHead,
    input_ids_BS: Tensor,
    loss_mask_BS: Tensor,
    aux_hidden_BSD: Tensor,
    last_hidden_BSH: Tensor,
    obj: ObjectiveRecipe,
    generator: torch.Generator | None = None,
    group: dist.ProcessGroup | None = None,
) -> LossOutput:
    """Sample anchors (`generator`: a CPU generator), then `compute_dflash_loss_at`."""
    anchors_BN, block_valid_BN = sample_anchors(loss_mask_BS, obj.num_anchors, generator)
    return compute_dflash_loss_at(
        draft,
        head,
        input_ids_BS,
        loss_mask_BS,
        aux_hidden_BSD,
        last_hidden_BSH,
        anchors_BN,
        block_valid_BN,
        obj,
        group,
    )


def compute_dflash_loss_at(
    draft: DFlashDraft,
    head: FrozenHead,
    input_ids_BS: Tensor,
    loss_mask_BS: Tensor,
    aux_hidden_BSD: Tensor,
    last_hidden_BSH: Tensor,
    anchors_BN: Tensor,
    block_valid_BN: Tensor,
    obj: ObjectiveRecipe,
    group: dist.ProcessGroup | None = None,
) -> LossOutput:
    """Loss and metrics of one micro-step at the given anchors (arguments as
    `objective.compute_loss_at`). Metrics per position have G-1 entries."""
    cfg = draft.config
    G, P = cfg.block_size, cfg.block_size - 1
    B, S = input_ids_BS.shape
    if head.vocab_rows != cfg.vocab_size:
        raise ValueError(
            f"draft.vocab_size={cfg.vocab_size} but the target's LM head has {head.vocab_rows} rows"
        )
    pooled = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if pooled else 1
    skipped = int((~block_valid_BN.any(dim=1)).sum())
    if skipped:
        log.warning("%d of %d sequence(s) have no eligible anchor; skipped", skipped, B)

    any_valid_N = block_valid_BN.any(dim=0)
    n_eff = max(int(any_valid_N.nonzero().max()) + 1 if any_valid_N.any() else 0, 1)
    anchors_BN, block_valid_BN = anchors_BN[:, :n_eff], block_valid_BN[:, :n_eff]
    # labels / teacher / eval mask / weights of the P drafted slots (module docstring)
    bl = build_blocks(
        input_ids_BS, loss_mask_BS, anchors_BN, block_valid_BN, P, cfg.mask_token_id, obj.gamma
    )
    ids_BNG, pos_BNG = dflash_block_inputs(input_ids_BS, anchors_BN, G, cfg.mask_token_id)
    N, X = n_eff, B * n_eff
    chunk = X if obj.chunk_size <= 0 else min(obj.chunk_size, X)

    weight_sum = bl.weight_BNG.sum()
    if pooled:
        dist.all_reduce(weight_sum, group=group)
    coef_BNP = bl.weight_BNG * (world / weight_sum.clamp_min(1e-12))

    ctx_BSH = draft.context(aux_hidden_BSD)
    ctx_pos_BS = torch.arange(S, device=input_ids_BS.device).expand(B, S)
    ctx_valid_BS = torch.ones_like(loss_mask_BS, dtype=torch.bool)
    with torch.no_grad():
        emb_BNGH = head.embed(ids_BNG).to(ctx_BSH.dtype)

    def decode(ctx: Tensor, lo: int, hi: int) -> Tensor:
        masks = draft.masks(anchors_BN[:, lo:hi], block_valid_BN[:, lo:hi], ctx_valid_BS)
        h_BnGH = draft(ctx, ctx_pos_BS, emb_BNGH[:, lo:hi], pos_BNG[:, lo:hi], masks)
        return h_BnGH[:, :, 1:]  # rows 1 .. G-1 draft; row 0 is the bonus token

    need_grads = torch.is_grad_enabled() and ctx_BSH.requires_grad
    cols = max(chunk // B, 1)
    spans = [(lo, min(lo + cols, N)) for lo in range(0, N, cols)]
    if len(spans) > 1 and need_grads:
        h_BNPH = torch.cat(
            [checkpoint(decode, ctx_BSH, lo, hi, use_reentrant=False) for lo, hi in spans], 1
        )
    else:
        h_BNPH = torch.cat([decode(ctx_BSH, lo, hi) for lo, hi in spans], 1)

    with torch.no_grad():
        idx_BX = bl.teacher_idx_BNG.reshape(B, -1)
        H = last_hidden_BSH.shape[-1]
        teacher_XPH = last_hidden_BSH.gather(1, idx_BX[..., None].expand(-1, -1, H))
    plan = _VocabPlan(
        draft=draft,
        head=head,
        prev_XG=bl.prev_BNG.reshape(X, P),
        labels_XG=bl.labels_BNG.reshape(X, P),
        teacher_h_XGH=teacher_XPH.view(X, P, H),
        coef_XG=coef_BNP.reshape(X, P),
        obj=obj,
        chunk=chunk,
        need_grads=need_grads,
    )
    params = [p for p in draft.parameters() if p.requires_grad] if need_grads else []
    loss, stats_6XP = _FusedVocabLoss.apply(plan, h_BNPH.reshape(X, P, -1), *params)
    metrics = _metrics(stats_6XP.view(6, B, N, P), bl, obj, weight_sum, skipped, pooled, group)
    return LossOutput(loss=loss, metrics=metrics)
