"""DSpark training objective: every one of the G block rows drafts, under the DSpark slot
convention, through the shared chunked loss of `vocab_loss.py` (0.1 CE + 0.9 L1 + 1.0 BCE).

DSPARK_SPEC.md section 3 is the contract; `vocab_loss.py`'s docstring covers the
vocabulary, the normalisation over data-parallel ranks, the metrics and the memory plan.
`compute_loss` is the entry point.

Slot convention (DSpark / SGLang `sample_from_anchor`): the block anchored at a is
[x_a, MASK * (G-1)] at positions a .. a+G-1 over the context strictly before a; slot k of
the block (row k) predicts token a+k+1; its teacher is the target's LM head on
last_hidden[a+k] (`FrozenHead.teacher_logits`: float32 output and softcap, as the target
serves them); its Markov "previous" token is x[a+k] (teacher forced); the confidence head
learns each slot's acceptance (BCE against the detached alpha).

Shape legend
  B  sequences in the micro-batch        S  sequence length
  N  anchor blocks per sequence          G  block size (slots per block)
  H  hidden size                         D  aux feature width (m * H)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from specforge_dspark.drafters.dspark import DSparkDraft, build_visibility_mask
from specforge_dspark.frozen_head import FrozenHead
from specforge_dspark.objective.blocks import sample_anchors
from specforge_dspark.objective.vocab_loss import LossOutput, block_loss_at
from specforge_dspark.recipe import ObjectiveRecipe


def compute_loss(
    draft: DSparkDraft,
    head: FrozenHead,
    input_ids_BS: Tensor,
    loss_mask_BS: Tensor,
    aux_hidden_BSD: Tensor,
    last_hidden_BSH: Tensor,
    obj: ObjectiveRecipe,
    generator: torch.Generator | None = None,
    group: dist.ProcessGroup | None = None,
) -> LossOutput:
    """Sample anchors (`generator`: a CPU generator), then `compute_loss_at`."""
    anchors_BN, block_valid_BN = sample_anchors(loss_mask_BS, obj.num_anchors, generator)
    return compute_loss_at(
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


def compute_loss_at(
    draft: DSparkDraft,
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
    """Loss and metrics of one micro-step at the given anchors (`vocab_loss.block_loss_at`
    with the DSpark visibility mask: all G rows draft). Metrics per position have G entries.

    input_ids_BS, loss_mask_BS: tokens and supervision mask; aux_hidden_BSD: the target's
    aux hidden states; last_hidden_BSH: its post-final-norm hidden states (the LM head
    input); group: the data-parallel group (None = the default group when
    torch.distributed is initialised, else no pooling). Every rank calls this once per
    micro-step.
    """
    G = draft.config.block_size

    def masks(anchors_BN: Tensor, block_valid_BN: Tensor, ctx_valid_BS: Tensor) -> Tensor:
        return build_visibility_mask(anchors_BN, block_valid_BN, ctx_valid_BS, G)

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
        masks,
    )
