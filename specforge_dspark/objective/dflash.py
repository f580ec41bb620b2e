"""DFlash training objective: rows 1 .. G-1 of each block draft, through the shared chunked
loss of `vocab_loss.py` (0.1 CE + 0.9 L1 by default; no BCE: there is no confidence head).

Slot convention (SGLang DFLASH, see drafters/dflash.py): the block anchored at a is
[x_a, MASK * (G-1)] at positions a .. a+G-1 over the context strictly before a; its row i
(i = 1 .. G-1) drafts the token x[a+i]. Written as drafted slot k = i - 1 (k = 0 .. G-2)
that is label x[a+k+1], teacher lm_head(last_hidden[a+k]), exactly the first G-1 slots of
a DSpark block at the same anchor (`blocks.build_blocks` with G-1 slots: labels, teacher
indices, prefix eval mask and weights exp(-k / gamma)); only the hidden state feeding
slot k is row k+1 of the G-row block instead of row k. `DFlashDraft.num_drafts` = G-1
tells `vocab_loss.block_loss_at` so. The anchors, the normalisation over data-parallel
ranks and the metrics are DSpark's, with G-1 positions per block; `tau` is the
teacher-forced accept length 1 + accepted drafts.

Shape legend
  B  sequences in the micro-batch        S  sequence length
  N  anchor blocks per sequence          G  block size (rows per block; G-1 drafted slots)
  H  hidden size                         D  aux feature width (m * H)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from specforge_dspark.drafters.dflash import DFlashDraft
from specforge_dspark.frozen_head import FrozenHead
from specforge_dspark.objective.blocks import sample_anchors
from specforge_dspark.objective.vocab_loss import LossOutput, block_loss_at
from specforge_dspark.recipe import ObjectiveRecipe


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
    `objective.dspark.compute_loss_at`): `vocab_loss.block_loss_at` with the drafter's
    per-layer-type masks, rows 1 .. G-1 drafting. Metrics per position have G-1 entries."""
    return block_loss_at(
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
        draft.masks,
    )
