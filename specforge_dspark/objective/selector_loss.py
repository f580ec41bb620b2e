"""The DFlash2 selector's objective: a K-way cross-entropy over each slot's candidates,
added to the DFlash loss (`compute_loss(..., extra=selector_term)`, drafters/registry.py).

What the serving engine implies (drafters/dflash2.py has the engine's lines):
- a slot's candidates are the top-K of the draft's own logits (no gradient flows through
  a top-K choice), so the candidate set and the unary scores are computed without
  gradient, from the detached draft hidden: the selector learns to rerank what the
  backbone proposes and never pulls the backbone (the stop-gradient);
- the selector's own input h_e is detached too, for the same reason; its parameters
  (codes and projection) are all this term trains;
- the predecessor of drafted slot k is teacher forced, x[a+k] (for slot 0 the anchor
  token, which the engine feeds as the bonus), as the DSpark Markov head is;
- the gold candidate is the target's argmax at that slot (what greedy verification
  accepts); where it is not among the top-K it replaces the last candidate, for the
  loss only (`candidate_recall` reports how often it was there).
Normalised as the vocab loss is: `coef_XG` (block position weights over the pooled weight
sum) makes the ranks' summed gradient that of the pooled weighted mean.

Shapes: X blocks, G drafted slots, K candidates, H hidden, V vocab rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


@torch.no_grad()
def candidates(
    draft_logits_XGV: Tensor, gold_XG: Tensor, top_k: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(candidate ids [X, G, K], unary logits [X, G, K] float32, the gold's index [X, G],
    whether the gold was in the strict top-K [X, G]); a missing gold replaces candidate
    K-1 with its own logit."""
    unary_XGK, cand_XGK = draft_logits_XGV.float().topk(top_k, dim=-1)
    hit_XGK = cand_XGK == gold_XG[..., None]
    found_XG = hit_XGK.any(-1)
    gold_logit_XG = draft_logits_XGV.float().gather(-1, gold_XG[..., None])[..., 0]
    cand_XGK[..., -1] = torch.where(found_XG, cand_XGK[..., -1], gold_XG)
    unary_XGK[..., -1] = torch.where(found_XG, unary_XGK[..., -1], gold_logit_XG)
    index_XG = (cand_XGK == gold_XG[..., None]).int().argmax(-1)
    return cand_XGK, unary_XGK, index_XG, found_XG


def selector_loss(
    selector,
    unary_XGK: Tensor,
    cand_XGK: Tensor,
    index_XG: Tensor,
    h_XGH: Tensor,
    prev_XG: Tensor,
    coef_XG: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """(sum of coef * CE, the per-slot CE [X, G], whether the selector's teacher-forced
    choice is the gold [X, G]); `selector` is a `dflash2.CandidateSelector`."""
    scores_XGK = selector.scores(prev_XG[..., None], cand_XGK, unary_XGK, h_XGH.detach())[:, :, 0]
    ce_XG = F.cross_entropy(scores_XGK.flatten(0, 1), index_XG.flatten(), reduction="none").view_as(
        index_XG
    )
    right_XG = scores_XGK.detach().argmax(-1) == index_XG
    return (coef_XG * ce_XG).sum(), ce_XG.detach(), right_XG


def selector_term(
    draft,
    head,
    h_XGH: Tensor,
    teacher_h_XGH: Tensor,
    prev_XG: Tensor,
    coef_XG: Tensor,
    weight_XG: Tensor,
    mask_XG: Tensor,
    chunk: int,
    weight: float,
    group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`weight` x the selector loss of the drafting rows, and its pooled metrics
    (selector_loss, selector_acc, candidate_recall), `chunk` blocks of vocab work at a
    time. h_XGH: the drafting rows' hidden; teacher_h_XGH: the target's hidden whose
    logits label each slot; mask_XG: supervised slots."""
    X = h_XGH.shape[0]
    K = draft.candidate_selector.top_k
    total = h_XGH.new_zeros((), dtype=torch.float32)
    sums = torch.zeros(5, dtype=torch.float64, device=h_XGH.device)
    for lo in range(0, X, max(chunk, 1)):
        hi = min(lo + max(chunk, 1), X)
        with torch.no_grad():
            h = h_XGH[lo:hi].detach()
            gold_XG = head.teacher_logits(teacher_h_XGH[lo:hi]).argmax(-1)
            cand, unary, index, found = candidates(head.logits(h), gold_XG, K)
        part, ce, right = selector_loss(
            draft.candidate_selector, unary, cand, index, h, prev_XG[lo:hi], coef_XG[lo:hi]
        )
        total = total + part
        m = mask_XG[lo:hi]
        sums += torch.stack(
            [
                (weight_XG[lo:hi] * ce).sum().double(),
                (right & m).sum().double(),
                (found & m).sum().double(),
                m.sum().double(),
                weight_XG[lo:hi].sum().double(),
            ]
        )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums, group=group)
    n = sums[3].clamp_min(1)
    return weight * total, {
        "selector_loss": sums[0] / sums[4].clamp_min(1e-12),  # the pooled weighted mean
        "selector_acc": sums[1] / n,
        "candidate_recall": sums[2] / n,
    }
