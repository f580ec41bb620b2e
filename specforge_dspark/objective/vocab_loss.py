"""The one chunked vocab-sized loss: 0.1 CE + 0.9 L1 + 1.0 BCE per drafted slot, its
gradients, the data-parallel normalisation and the pooled metrics, for any drafter kind.

DSPARK_SPEC.md section 3 is the contract. `objective/loss.py` runs one micro-step for a
drafter whose last `num_drafts` block rows draft (DSpark: all G rows; DFlash: rows
1 .. G-1) through the pieces here.

Shape legend
  B  sequences in the micro-batch        S  sequence length
  N  anchor blocks per sequence          G  drafted slots per block (`num_drafts`)
  R  block rows (block_size; R = G, or G + 1 for DFlash)
  X  blocks of the micro-batch (B * N)   C  blocks per chunk (objective.chunk_size; 0 = X)
  H  hidden size                         D  aux feature width (m * H)
  V  LM-head rows (padded vocabulary)    M  slots of one chunk (C * G)
  Y  the slot dims, [X, G] or [B, N, G]

Vocabulary (serve exactly what we train): SGLang's draft takes its argmax over ALL LM-head
rows (`models/dspark.py` crops the draft's logits only to `lm_head.org_vocab_size`, which
for Inkling is the padded row count), while the target's logits are cropped to the L
logical tokens. So the draft's softmax, CE and L1 run over all V rows and the teacher is
a softmax over the first L rows with probability exactly 0 on rows >= L: mass the draft
puts on a padded row is penalised by L1 and CE, and a Markov head's padded rows of
markov_w2 train (downwards). Metrics (alpha, top1, tau) use the draft's argmax over all
V rows, as served.

Normalisation and gradient accumulation
  Each call (one micro-step) returns  loss = world * (this rank's weighted sum) / W,  with
  W = sum of slot weights over all data-parallel ranks of this micro-step (all-reduced,
  detached). Averaging the ranks' gradients (DDP, DeepSpeed) then gives the gradient of
  the pooled weighted mean of this micro-step. Micro-steps of one accumulation window are
  combined with EQUAL weight: the window's gradient is the mean over its micro-steps of
  the per-micro-step pooled means. DeepSpeed's `engine.backward` already divides by
  `gradient_accumulation_steps`; a plain-torch trainer calls `(loss / accum).backward()`.

Teacher-forced accept length
  `tau` averages over valid blocks b the greedy accept length 1 + sum_k prod_{i<=k} a_{b,i},
  a_{b,i} = 1 where the draft's argmax at slot i equals the teacher's (top1). A block only
  counts while its slots are supervised: a slot outside the block's supervised prefix
  (eval_mask False) counts as rejected, so a block with n supervised slots contributes at
  most 1 + n. `tau_expected` is DSPARK_SPEC's expected accept length per block,
  1 + sum_k prod_{i<=k} alpha_{b,i}, alpha_{b,i} = sum_v min(p, q) the probability that
  slot i is accepted under speculative sampling (0 outside the supervised prefix),
  averaged over valid blocks the same way. (`tau_slot_mean`, the product of per-slot
  MEAN alphas, is retired: a mean over blocks of a product is not a product of means.)

Memory
  Vocab-sized work runs one chunk of C blocks at a time inside `FusedVocabLoss`, whose
  forward computes each chunk's loss and, analytically, the gradient wrt the logits and
  the confidence logit, then pulls those back to h and the head parameters with
  `torch.autograd.grad`. Only gradients of size [B, N, G, H] and of the head parameters
  are kept; nothing vocab-sized is stored or recomputed. The decoder (objective/loss.py)
  computes each layer's context keys and values once per micro-step, then runs the blocks
  in chunks of its own (objective.decode_chunk_size), checkpointed when
  objective.recompute is on (the context K/V, their inputs, are not recomputed); auto is
  resolved from the memory estimate by `training/memory.py`. One `loss.backward()` by the
  trainer delivers every gradient through ordinary autograd.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specforge_dspark.config.recipe import ObjectiveRecipe
from specforge_dspark.objective.acceptance import divergence, dpace_weights
from specforge_dspark.objective.frozen_head import FrozenHead

log = logging.getLogger(__name__)


class BlockDrafter(Protocol):
    """What the objective calls on a drafter network (`DSparkDraft`, `DFlashDraft`)."""

    config: Any
    """Reads block_size (R), mask_token_id and vocab_size."""

    @property
    def num_drafts(self) -> int:
        """Drafted slots per block (G): the last G of the R block rows draft."""

    def context(self, aux_hidden_BSD: Tensor) -> Tensor: ...

    def masks(
        self,
        anchors_BN: Tensor,
        block_valid_BN: Tensor,
        ctx_valid_BS: Tensor,
        starts_BN: Tensor | None = None,
    ) -> Any:
        """The attention-mask argument of `__call__` for these blocks (context keys from
        `starts_BN`, each block's conversation start in a packed row; None = 0)."""

    def __call__(
        self, ctx_BSH: Tensor, ctx_pos_BS: Tensor, emb_BNRH: Tensor, pos_BNR: Tensor, masks: Any
    ) -> Tensor: ...

    def apply_heads(
        self, h_BNGH: Tensor, base_logits_BNGV: Tensor, prev_BNG: Tensor
    ) -> tuple[Tensor, Tensor | None]: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...


# --------------------------------------------------------------------------- per-slot terms


@dataclass
class SlotTerms:
    """Per-slot values of one chunk (all [M], detached) and the loss gradients."""

    ce_M: Tensor
    l1_M: Tensor
    alpha_M: Tensor
    div_M: Tensor
    """The trained divergence (objective.divergence): L1 itself by default."""
    coef_M: Tensor
    """The slot's coefficient in the loss (objective.slot_weighting applied)."""
    bce_M: Tensor
    """Zeros when the draft has no confidence head."""
    calib_M: Tensor
    """|sigmoid(conf) - alpha|; NaN when the draft has no confidence head."""
    top1_M: Tensor
    """1.0 where the draft's argmax over all V rows is (one of) the teacher's argmax."""
    dlogits_MV: Tensor | None
    dconf_M: Tensor | None


def _softmax_(x_MV: Tensor) -> Tensor:
    """Softmax over the last dim in place (no vocab-sized allocation); returns logsumexp [M].
    Entries of -inf (not all of a row) become exactly 0."""
    m_M1 = x_MV.amax(dim=-1, keepdim=True)
    x_MV.sub_(m_M1).exp_()
    s_M1 = x_MV.sum(dim=-1, keepdim=True)
    x_MV.div_(s_M1)
    return (m_M1 + s_M1.log()).squeeze(-1)


def slot_terms_(
    logits_MV: Tensor,
    conf_M: Tensor | None,
    teacher_logits_MV: Tensor,
    labels_M: Tensor,
    coef_M: Tensor,
    obj: ObjectiveRecipe,
    logical_vocab: int,
    slots: int,
    need_grads: bool,
) -> SlotTerms:
    """CE, L1 (= 2 TV), alpha, BCE per slot, and the gradient of their weighted sum.

    Both logit tensors span all V LM-head rows. The draft's softmax q runs over all of
    them (SGLang's draft argmax does); the teacher's p over the first `logical_vocab` rows
    only, with p = 0 exactly on the padded rows (the target never emits them). Both
    tensors are CONSUMED: used as scratch in place, so each vocab-sized step costs no
    allocation. Softmaxes run in (at least) float32. `coef_M` is each slot's weight times
    the normaliser; with objective.slot_weighting dpace it is the normaliser on supervised
    slots, times the D-PACE weights computed here (objective/acceptance.py; M = blocks x
    `slots`). With `need_grads`, also returns the gradient of
    sum_M coef * (ce_w*CE + l1_w*DIV + bce_w*BCE) wrt logits_MV and conf_M:
      dCE/dz = q - onehot(y);  dL1/dz = q * (s - <s, q>), s = sign(q - p);
      dBCE/dconf = sigmoid(conf) - alpha  (alpha is a detached soft label);
    DIV (objective.divergence) is L1, or -log alpha whose gradient is L1's times 1 / (2 alpha).
    On a padded row p = 0, so s = +1 there and both gradients push its logit down.
    """
    f = torch.promote_types(logits_MV.dtype, torch.float32)
    with torch.no_grad():
        p_MV = teacher_logits_MV.to(f)
        p_MV[:, logical_vocab:] = -math.inf  # exp(-inf) = 0: no teacher mass on padded rows
        _softmax_(p_MV)
        z_MV = logits_MV.detach().to(f)
        z_y_M = z_MV.gather(1, labels_M[:, None]).squeeze(1)
        top_M1 = z_MV.max(dim=-1, keepdim=True).indices  # over all rows, as served
        ce_M = _softmax_(z_MV) - z_y_M
        q_MV = z_MV
        top1_M = (p_MV.gather(1, top_M1).squeeze(1) >= p_MV.amax(dim=-1)).to(f)
        d_MV = torch.sub(q_MV, p_MV, out=p_MV)  # q - p, in p's storage
        l1_M = torch.linalg.vector_norm(d_MV, ord=1, dim=-1)
        alpha_M = (1.0 - 0.5 * l1_M).clamp(0.0, 1.0)
        div_M, div_scale_M = divergence(obj.divergence, l1_M, alpha_M)
        coef_M = coef_M.to(f)
        if obj.slot_weighting == "dpace":
            conf_XG, mask_XG = torch.exp(-ce_M).view(-1, slots), (coef_M > 0).view(-1, slots)
            coef_M = coef_M * dpace_weights(conf_XG, mask_XG, obj.dpace_alpha).view(-1)
        if conf_M is None:
            bce_M = torch.zeros_like(l1_M)
            calib_M = torch.full_like(l1_M, math.nan)
        else:
            c_M = conf_M.detach().to(f)
            bce_M = F.binary_cross_entropy_with_logits(c_M, alpha_M, reduction="none")
            calib_M = (torch.sigmoid(c_M) - alpha_M).abs()
        dlogits_MV = dconf_M = None
        if need_grads:
            c_ce_M1 = (obj.ce_weight * coef_M)[:, None]
            c_div_M = obj.l1_weight * coef_M
            c_l1_M1 = (c_div_M if div_scale_M is None else c_div_M * div_scale_M)[:, None]
            s_MV = d_MV.sign_()
            sq_M1 = torch.einsum("mv,mv->m", s_MV, q_MV)[:, None]
            # q * (c_l1 * (s - <s,q>) + c_ce) - c_ce * onehot(y), in s's storage
            s_MV.mul_(c_l1_M1).add_(c_ce_M1 - c_l1_M1 * sq_M1).mul_(q_MV)
            s_MV.scatter_add_(1, labels_M[:, None], -c_ce_M1)
            dlogits_MV = s_MV.to(logits_MV.dtype)
            if conf_M is not None:
                dconf_M = obj.bce_weight * coef_M * (torch.sigmoid(c_M) - alpha_M)
                dconf_M = dconf_M.to(conf_M.dtype)
    return SlotTerms(
        ce_M, l1_M, alpha_M, div_M, coef_M, bce_M, calib_M, top1_M, dlogits_MV, dconf_M
    )


# --------------------------------------------------------------------------- fused vocab part


@dataclass
class Candidates:
    """Per drafted slot, the draft logits' top-K rows and the teacher's argmax over its
    logical rows, taken from the vocab-sized logits each chunk computes anyway (the
    DFlash2 selector's inputs, objective/selector_loss.py). No gradient."""

    ids_XGK: Tensor
    unary_XGK: Tensor
    """The draft logits of `ids_XGK` (float32)."""
    gold_XG: Tensor
    gold_logit_XG: Tensor
    """The draft logit of the teacher's argmax (float32)."""


@dataclass
class VocabPlan:
    """What `FusedVocabLoss` needs besides the differentiable inputs; blocks flattened
    over the batch, X = B * N, and G their drafted slots."""

    draft: BlockDrafter
    head: FrozenHead
    prev_XG: Tensor
    labels_XG: Tensor
    teacher_h_XGH: Tensor
    coef_XG: Tensor
    """Slot weight times the normaliser world / W."""
    obj: ObjectiveRecipe
    chunk: int
    need_grads: bool
    top_k: int = 0
    """> 0: forward also fills `candidates` with each slot's top-`top_k` draft rows."""
    candidates: Candidates | None = None


class FusedVocabLoss(torch.autograd.Function):
    """Chunked vocab-sized loss whose gradients are computed in forward and only scaled in
    backward.

    Inputs: h_XGH (X = B*N blocks) and the draft's trainable parameters. Outputs: the
    scalar loss (differentiable) and the per-slot statistics [8, X, G] (STATS; not
    differentiable).
    """

    @staticmethod
    def forward(ctx, plan: VocabPlan, h_XGH: Tensor, *params: Tensor):
        X, G, _ = h_XGH.shape
        f = torch.promote_types(h_XGH.dtype, torch.float32)
        stats_8XG = h_XGH.new_zeros((len(STATS), X, G), dtype=f)
        grad_h_XGH = torch.zeros_like(h_XGH) if plan.need_grads else None
        # Parameter gradients are summed over the chunks in (at least) float32 and cast to
        # the parameter's dtype once, in backward: a bf16 running sum would round each add.
        grad_P: list[Tensor | None] = [None] * len(params)
        if plan.top_k > 0:
            K, dev = plan.top_k, h_XGH.device
            plan.candidates = Candidates(
                torch.zeros(X, G, K, dtype=torch.long, device=dev),
                torch.zeros(X, G, K, device=dev),
                torch.zeros(X, G, dtype=torch.long, device=dev),
                torch.zeros(X, G, device=dev),
            )
        for lo in range(0, X, plan.chunk):
            sl = slice(lo, min(lo + plan.chunk, X))
            stats_8XG[:, sl], grads = vocab_chunk(plan, sl, h_XGH[sl], params)
            if grads is not None:
                grad_h_XGH[sl] = grads[0]
                for i, g in enumerate(grads[1:]):
                    if g is not None:
                        grad_P[i] = g.to(f) if grad_P[i] is None else grad_P[i].add_(g)
            del grads  # this chunk's parameter gradients: added, not kept into the next chunk
        loss = objective_value(stats_8XG, plan.obj)
        ctx.grads = (grad_h_XGH, grad_P)
        ctx.param_dtypes = [p.dtype for p in params]
        ctx.mark_non_differentiable(stats_8XG)
        return loss, stats_8XG

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_stats: Tensor):
        grad_h_XGH, grad_P = ctx.grads
        del ctx.grads
        scaled = [
            None if g is None else (g * grad_loss.to(g.dtype)).to(dtype)
            for g, dtype in zip(grad_P, ctx.param_dtypes, strict=True)
        ]
        return None, grad_h_XGH * grad_loss.to(grad_h_XGH.dtype), *scaled


def vocab_chunk(
    plan: VocabPlan, sl: slice, h_CGH: Tensor, params: tuple[Tensor, ...]
) -> tuple[Tensor, tuple[Tensor | None, ...] | None]:
    """Statistics [8, C, G] of the blocks `sl` and, when training, the gradients of their
    loss wrt h_CGH and `params`. No vocab-sized tensor outlives the call."""
    head, V, G = plan.head, plan.head.vocab_rows, h_CGH.shape[1]
    # [1, C, G, H] with canonical strides (slice, then unsqueeze): F.linear folds it into one
    # matrix product; x[None, sl] would keep the stride of the unsliced tensor on the new
    # dim, and matmul then falls back to a batched product, several times slower.
    h_1CGH = h_CGH.unsqueeze(0).detach().requires_grad_(plan.need_grads)
    with torch.enable_grad():
        base_1CGV = head.logits(h_1CGH)  # all rows: SGLang's draft does not crop them
        prev_1CG = plan.prev_XG[sl].unsqueeze(0)
        logits_1CGV, conf_1CG = plan.draft.apply_heads(h_1CGH, base_1CGV, prev_1CG)
    del base_1CGV
    with torch.no_grad():
        # float32 output and softcap: the target's served logits (see frozen_head.py);
        # slot_terms_ keeps its first logical_vocab rows
        teacher_1CGV = head.teacher_logits(plan.teacher_h_XGH[sl].unsqueeze(0))
        if plan.candidates is not None:  # before slot_terms_ consumes both
            c, z_CGV = plan.candidates, logits_1CGV[0].detach().float()
            c.unary_XGK[sl], c.ids_XGK[sl] = z_CGV.topk(plan.top_k, dim=-1)
            c.gold_XG[sl] = teacher_1CGV[0, ..., : head.logical_vocab].argmax(-1)
            c.gold_logit_XG[sl] = z_CGV.gather(-1, c.gold_XG[sl, :, None])[..., 0]
            del z_CGV
    # logits_1CGV is scratch for slot_terms_: nothing saved its value for backward (it is
    # the output of an addition), so overwriting it is safe.
    t = slot_terms_(
        logits_1CGV.view(-1, V),
        None if conf_1CG is None else conf_1CG.reshape(-1),
        teacher_1CGV.reshape(-1, V),
        plan.labels_XG[sl].reshape(-1),
        plan.coef_XG[sl].reshape(-1),
        plan.obj,
        head.logical_vocab,
        G,
        plan.need_grads,
    )
    stats_8CG = torch.stack(
        (t.ce_M, t.l1_M, t.alpha_M, t.bce_M, t.calib_M, t.top1_M, t.div_M, t.coef_M)
    ).view(len(STATS), -1, G)
    if not plan.need_grads:
        return stats_8CG, None
    outs, grad_outs = [logits_1CGV], [t.dlogits_MV.view_as(logits_1CGV)]
    detached = conf_1CG is not None and plan.obj.confidence_detach
    if conf_1CG is not None and not detached:
        outs.append(conf_1CG)
        grad_outs.append(t.dconf_M.view_as(conf_1CG))
    grads = torch.autograd.grad(
        outs, [h_1CGH, *params], grad_outs, allow_unused=True, retain_graph=detached
    )
    if detached:  # the BCE's gradient for the confidence head's own parameters only
        grads = _add_head_grads(plan, params, grads, conf_1CG, t.dconf_M.view_as(conf_1CG))
    return stats_8CG, (grads[0][0], *grads[1:])


def _add_head_grads(plan: VocabPlan, params, grads, conf: Tensor, dconf: Tensor) -> tuple:
    """`grads` (wrt h and `params`) plus the confidence's gradient wrt the confidence
    head's parameters among `params` (objective.confidence_detach)."""
    own = {id(p) for p in plan.draft.confidence_head.parameters()}
    idx = [i for i, p in enumerate(params) if id(p) in own]
    extra = torch.autograd.grad([conf], [params[i] for i in idx], [dconf], allow_unused=True)
    out = list(grads)
    for i, g in zip(idx, extra, strict=True):
        if g is not None:
            out[1 + i] = g if out[1 + i] is None else out[1 + i] + g
    return tuple(out)


STATS = ("ce", "l1", "alpha", "bce", "calib", "top1", "div", "coef")
"""The rows of FusedVocabLoss's per-slot statistics: SlotTerms' values; `div` is the
trained divergence (L1 by default), `coef` the slot's coefficient in the loss."""


def weighted_terms(stats_8Y: Tensor, coef_Y: Tensor, obj: ObjectiveRecipe) -> tuple[Tensor, Tensor]:
    """sum_slots coef * (ce_w*CE + l1_w*L1 + bce_w*BCE) and its three terms [3] (Y: the slot
    dims, [X, G] or [B, N, G]): the default objective's value under weights `coef_Y`."""
    c_Y = coef_Y.to(stats_8Y.dtype)
    terms_3 = torch.stack([(c_Y * stats_8Y[i]).sum() for i in (0, 1, 3)])
    w_3 = terms_3.new_tensor([obj.ce_weight, obj.l1_weight, obj.bce_weight])
    return (w_3 * terms_3).sum(), terms_3


def objective_value(stats_8Y: Tensor, obj: ObjectiveRecipe) -> Tensor:
    """The trained loss, sum_slots coef * (ce_w*CE + l1_w*DIV + bce_w*BCE), with the
    coefficients and divergence the chunks used (equal to weighted_terms' for the defaults)."""
    ce, div, bce, coef = (stats_8Y[STATS.index(n)] for n in ("ce", "div", "bce", "coef"))
    return (coef * (obj.ce_weight * ce + obj.l1_weight * div + obj.bce_weight * bce)).sum()
