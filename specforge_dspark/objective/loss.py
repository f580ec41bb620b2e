"""The training objective of one micro-step, for every drafter kind: anchors, blocks,
the drafter's block forward, then the one chunked vocab loss of `vocab_loss.py`
(0.1 CE + 0.9 L1 + 1.0 BCE; DSPARK_SPEC.md section 3 is the contract). `compute_loss` is
the entry point; `vocab_loss.py`'s docstring covers the vocabulary, the normalisation
over data-parallel ranks, the metrics and the memory plan.

A drafter kind enters only through its network: `num_drafts` (how many of its R block
rows draft) and `masks` (its attention masks for a set of blocks).
- DSpark (`sample_from_anchor`): the block anchored at a is [x_a, MASK * (G-1)] at
  positions a .. a+G-1 over the context strictly before a; slot k (row k) predicts token
  a+k+1; its teacher is the target's LM head on last_hidden[a+k]
  (`FrozenHead.teacher_logits`: float32 output and softcap, as the target serves them);
  its Markov "previous" token is x[a+k] (teacher forced); the confidence head learns
  each slot's acceptance (BCE against the detached alpha). G drafted slots.
- DFlash (SGLang DFLASH): the same block; row i (i = 1 .. G-1) drafts x[a+i]. Written as
  drafted slot k = i - 1 that is label x[a+k+1], teacher last_hidden[a+k]: the first G-1
  slots of a DSpark block at the same anchor, only fed by row k+1. No Markov or confidence
  head (no BCE). G-1 drafted slots; `tau` is the teacher-forced accept length.

Shape legend
  B  sequences in the micro-batch        S  sequence length
  N  anchor blocks per sequence          G  drafted slots per block (`num_drafts`)
  R  block rows (block_size)             X  blocks of the micro-batch (B * N)
  H  hidden size                         D  aux feature width (m * H)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from specforge_dspark.config.recipe import ObjectiveRecipe
from specforge_dspark.objective.blocks import (
    block_inputs,
    build_blocks,
    sample_anchors,
    used_columns,
)
from specforge_dspark.objective.frozen_head import FrozenHead
from specforge_dspark.objective.metrics import LossOutput, pooled_metrics
from specforge_dspark.objective.sequence_parallel import (
    SeqShard,
    UlyssesAttend,
    gathered_masks,
    split_anchors,
)
from specforge_dspark.objective.vocab_loss import STATS, BlockDrafter, FusedVocabLoss, VocabPlan

log = logging.getLogger(__name__)


def compute_loss(
    draft: BlockDrafter,
    head: FrozenHead,
    input_ids_BS: Tensor,
    loss_mask_BS: Tensor,
    aux_hidden_BSD: Tensor,
    last_hidden_BSH: Tensor,
    obj: ObjectiveRecipe,
    generator: torch.Generator | None = None,
    group: dist.ProcessGroup | None = None,
    position_ids_BS: Tensor | None = None,
    extra: Callable | None = None,
    shard: SeqShard | None = None,
) -> LossOutput:
    """Sample `obj.num_anchors` anchors per sequence (`generator`: a CPU generator), then
    `compute_loss_at`."""
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
        position_ids_BS,
        extra,
        shard,
    )


def compute_loss_at(
    draft: BlockDrafter,
    head: FrozenHead,
    input_ids_BS: Tensor,
    loss_mask_BS: Tensor,
    aux_hidden_BSD: Tensor,
    last_hidden_BSH: Tensor,
    anchors_BN: Tensor,
    block_valid_BN: Tensor,
    obj: ObjectiveRecipe,
    group: dist.ProcessGroup | None = None,
    position_ids_BS: Tensor | None = None,
    extra: Callable | None = None,
    shard: SeqShard | None = None,
) -> LossOutput:
    """Loss and metrics of one micro-step at the given anchors.

    input_ids_BS, loss_mask_BS: tokens and supervision mask (right padding needs no extra
    mask: context keys are strictly before an anchor, which is a supervised token).
    aux_hidden_BSD: the target's aux hidden states; last_hidden_BSH: its post-final-norm
    hidden states (the LM head input). `head` is the frozen `FrozenHead`. The block rows
    [x_a, MASK * (R-1)] at positions a .. a+R-1 are decoded with `draft.masks(...)` as
    the attention masks; drafted slot k (k < G) is block row R - G + k, supervised as
    `build_blocks` with G slots says (label x[a+k+1], teacher last_hidden[a+k]).
    group: the data-parallel group; None = the default group when torch.distributed is
    initialised, else no pooling. Every rank must call this once per micro-step.
    position_ids_BS: packed rows (training/packing.py): each token's position in its own
    conversation; a block's context then starts at its conversation's first token and its
    rows sit at the conversation's positions. None: one sequence per row.
    extra: a kind's own term over the drafting rows (selector_loss.SelectorTerm: its
    `top_k(draft)` candidates per slot come from the vocab loss's chunks), added to the
    loss with its metrics; None for DSpark and DFlash.
    """
    cfg = draft.config
    R, G = cfg.block_size, draft.num_drafts
    B, S = input_ids_BS.shape
    if head.vocab_rows != cfg.vocab_size:
        raise ValueError(
            f"draft.vocab_size={cfg.vocab_size} but the target's LM head has "
            f"{head.vocab_rows} rows: the draft's logits must cover every row it serves"
        )
    pooled = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if pooled else 1
    skipped = int((~block_valid_BN.any(dim=1)).sum())
    if shard is not None and shard.index:  # counted once per sequence group
        skipped = 0
    if skipped:
        log.warning("%d of %d sequence(s) have no eligible anchor; skipped", skipped, B)

    if shard is None:
        N = used_columns(block_valid_BN)
        anchors_BN, block_valid_BN = anchors_BN[:, :N], block_valid_BN[:, :N]
    else:  # every rank's anchors (the masks need them), this rank's to decode
        all_BPn, all_valid_BPn = split_anchors(anchors_BN, block_valid_BN, S, shard.size)
        anchors_BN, block_valid_BN = all_BPn[:, shard.index], all_valid_BPn[:, shard.index]
        N = anchors_BN.shape[1]
    bl = build_blocks(
        input_ids_BS, loss_mask_BS, anchors_BN, block_valid_BN, G, cfg.mask_token_id, obj.gamma
    )
    ids_BNR, pos_BNR = block_inputs(input_ids_BS, anchors_BN, R, cfg.mask_token_id)
    ctx_pos_BS, starts_BN = torch.arange(S, device=input_ids_BS.device).expand(B, S), None
    if position_ids_BS is not None:  # packed: positions and context per conversation
        ctx_pos_BS = position_ids_BS
        starts_BN = anchors_BN - position_ids_BS.gather(1, anchors_BN)
        pos_BNR = pos_BNR - starts_BN[..., None]
    ctx_valid_BS = torch.ones_like(loss_mask_BS, dtype=torch.bool)
    attend, lo_pos = None, 0
    if shard is not None:  # this rank's context slice; masks over the whole sequence
        lo_pos, s = shard.span(S)
        ctx_pos_BS = ctx_pos_BS[:, lo_pos : lo_pos + s]
        ctx_pos_BS = torch.cat((ctx_pos_BS, ctx_pos_BS.new_zeros(B, s - ctx_pos_BS.shape[1])), 1)
        ctx_valid_BS = torch.arange(shard.size * s, device=input_ids_BS.device).expand(B, -1) < S
        all_starts_BPn = None
        if position_ids_BS is not None:
            flat_BX = all_BPn.reshape(B, -1)
            all_starts_BPn = (flat_BX - position_ids_BS.gather(1, flat_BX)).view_as(all_BPn)
        attend = UlyssesAttend(shard.group)
    X = B * N
    chunk = X if obj.chunk_size <= 0 else min(obj.chunk_size, X)  # blocks per vocab chunk

    # [decay weight sum, supervised slots] over the data-parallel group: the normaliser of
    # the fixed decay weights, or of D-PACE's (counted per supervised slot)
    sums_2 = torch.stack([bl.weight_BNG.sum(), bl.eval_mask_BNG.sum().to(bl.weight_BNG.dtype)])
    if pooled:
        dist.all_reduce(sums_2, group=group)
    weight_sum = sums_2[0]
    if obj.slot_weighting == "dpace":  # the D-PACE weights multiply in, per chunk
        coef_BNG = bl.eval_mask_BNG.to(sums_2.dtype) * (world / sums_2[1].clamp_min(1.0))
    else:
        coef_BNG = bl.weight_BNG * (world / weight_sum.clamp_min(1e-12))

    # Decoder: context features and each layer's context keys and values once, then the
    # blocks about `obj.decode_chunk_size` blocks at a time over them, each chunk
    # checkpointed when recomputing (the context K/V are its inputs: not recomputed).
    ctx_BSH = draft.context(aux_hidden_BSD)
    kv_ctx = draft.context_kv(ctx_BSH, ctx_pos_BS)
    with torch.no_grad():
        emb_BNRH = head.embed(ids_BNR).to(ctx_BSH.dtype)

    def decode(lo: int, hi: int, *kv_flat: Tensor) -> Tensor:
        if shard is None:
            starts = None if starts_BN is None else starts_BN[:, lo:hi]
            mask = draft.masks(anchors_BN[:, lo:hi], block_valid_BN[:, lo:hi], ctx_valid_BS, starts)
        else:  # every rank's blocks of these columns, in the gathered order
            starts = None if all_starts_BPn is None else all_starts_BPn[..., lo:hi]
            both = (all_BPn[..., lo:hi], all_valid_BPn[..., lo:hi])
            mask = gathered_masks(draft, *both, ctx_valid_BS, starts, R)
        kv = list(zip(kv_flat[::2], kv_flat[1::2], strict=True))
        ranks = 1 if shard is None else shard.size
        h_BnRH = draft.decode(kv, emb_BNRH[:, lo:hi], pos_BNR[:, lo:hi], mask, attend, ranks)
        return h_BnRH[:, :, R - G :]  # the drafting rows

    need_grads = torch.is_grad_enabled() and ctx_BSH.requires_grad
    spans = decoder_spans(N, B, obj.decode_chunk_size)
    kv_flat = [t for kv in kv_ctx for t in kv]
    if need_grads and recomputes(obj, len(spans)):
        h_BNGH = torch.cat(
            [checkpoint(decode, lo, hi, *kv_flat, use_reentrant=False) for lo, hi in spans], 1
        )
    else:
        h_BNGH = torch.cat([decode(lo, hi, *kv_flat) for lo, hi in spans], 1)

    with torch.no_grad():
        idx_BX = bl.teacher_idx_BNG.reshape(B, -1) - lo_pos  # into this rank's rows
        idx_BX = idx_BX.clamp(0, last_hidden_BSH.shape[1] - 1)  # (invalid blocks' slots)
        H = last_hidden_BSH.shape[-1]
        teacher_XGH = last_hidden_BSH.gather(1, idx_BX[..., None].expand(-1, -1, H))
    plan = VocabPlan(
        draft=draft,
        head=head,
        prev_XG=bl.prev_BNG.reshape(X, G),
        labels_XG=bl.labels_BNG.reshape(X, G),
        teacher_h_XGH=teacher_XGH.view(X, G, H),
        coef_XG=coef_BNG.reshape(X, G),
        obj=obj,
        chunk=chunk,
        need_grads=need_grads,
        top_k=0 if extra is None else extra.top_k(draft),
    )
    params = [p for p in draft.parameters() if p.requires_grad] if need_grads else []
    loss, stats_8XG = FusedVocabLoss.apply(plan, h_BNGH.reshape(X, G, -1), *params)
    stats_8BNG = stats_8XG.view(-1, B, N, G)
    metrics = pooled_metrics(stats_8BNG, bl, obj, weight_sum, skipped, pooled, group)
    if extra is not None:
        # under D-PACE a slot's coefficient is its reach, which the vocab loss computed
        coef_XG = stats_8XG[STATS.index("coef")] if obj.slot_weighting == "dpace" else plan.coef_XG
        term, more = extra(
            draft,
            plan.candidates,
            h_BNGH.reshape(X, G, -1),
            plan.prev_XG,
            coef_XG,
            bl.weight_BNG.reshape(X, G),
            bl.eval_mask_BNG.reshape(X, G),
            obj.selector_weight,
            group if pooled else None,
            obj.selector_detach,
        )
        loss, metrics = loss + term, {**metrics, **more}
    return LossOutput(loss=loss, metrics=metrics)


def decoder_spans(N: int, B: int, decode_chunk_size: int) -> list[tuple[int, int]]:
    """Column ranges [lo, hi) of the [B, N] blocks decoded together: about
    `decode_chunk_size` blocks (at least one column) each; 0 = all N columns at once."""
    cols = N if decode_chunk_size <= 0 else max(decode_chunk_size // B, 1)
    return [(lo, min(lo + cols, N)) for lo in range(0, N, max(cols, 1))]


def recomputes(obj: ObjectiveRecipe, num_chunks: int) -> bool:
    """Whether the decoder chunks are checkpointed: `objective.recompute` as resolved by
    `training.memory.resolve_recompute`; "auto" unresolved keeps the rule of old, on when
    there is more than one chunk."""
    if obj.recompute == "auto":
        return num_chunks > 1
    return obj.recompute == "on"
