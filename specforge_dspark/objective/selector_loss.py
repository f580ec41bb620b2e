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
The candidates and the gold come from the vocab loss's own chunks (vocab_loss.Candidates):
no second pass over the vocabulary. Normalised as the vocab loss is: `coef_XG` (block
position weights over the pooled weight sum; under objective.slot_weighting dpace the
D-PACE weights, i.e. each slot's reach, as the vocab loss computed them) makes the ranks'
summed gradient that of the pooled weighted mean. `objective.selector_detach: false`
trains the selector jointly with the backbone (the alternative some references take).

Shapes: X blocks, G drafted slots, K candidates, H hidden, V vocab rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from specforge_dspark.objective.vocab_loss import Candidates


@torch.no_grad()
def inject_gold(c: Candidates) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(candidate ids [X, G, K], unary logits [X, G, K], the gold's index [X, G], whether
    the gold was in the strict top-K [X, G]); a missing gold replaces candidate K-1, with
    its own logit."""
    cand_XGK, unary_XGK, gold_XG = c.ids_XGK.clone(), c.unary_XGK.clone(), c.gold_XG
    found_XG = (cand_XGK == gold_XG[..., None]).any(-1)
    cand_XGK[..., -1] = torch.where(found_XG, cand_XGK[..., -1], gold_XG)
    unary_XGK[..., -1] = torch.where(found_XG, unary_XGK[..., -1], c.gold_logit_XG)
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
    detach: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """(sum of coef * CE, the per-slot CE [X, G], whether the selector's teacher-forced
    choice is the gold [X, G]); `selector` is a `dflash2.CandidateSelector`. `detach`:
    the backbone's hidden enters without gradient (the default), else the CE trains it."""
    h_XGH = h_XGH.detach() if detach else h_XGH
    scores_XGK = selector.scores(prev_XG[..., None], cand_XGK, unary_XGK, h_XGH)[:, :, 0]
    ce_XG = F.cross_entropy(scores_XGK.flatten(0, 1), index_XG.flatten(), reduction="none").view_as(
        index_XG
    )
    right_XG = scores_XGK.detach().argmax(-1) == index_XG
    return (coef_XG * ce_XG).sum(), ce_XG.detach(), right_XG


class SelectorTerm:
    """The selector's term for `compute_loss(..., extra=)`: `top_k(draft)` asks the vocab
    loss for each slot's candidates (vocab_loss.Candidates), the call scores them."""

    def top_k(self, draft) -> int:
        return draft.candidate_selector.top_k

    def __call__(
        self,
        draft,
        cands: Candidates,
        h_XGH: Tensor,
        prev_XG: Tensor,
        coef_XG: Tensor,
        weight_XG: Tensor,
        mask_XG: Tensor,
        weight: float,
        group: dist.ProcessGroup | None = None,
        detach: bool = True,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`weight` x the selector loss of the drafting rows (hidden `h_XGH`), and its
        metrics pooled over `group` (selector_loss, selector_acc, candidate_recall over the
        supervised slots `mask_XG`)."""
        cand, unary, index, found = inject_gold(cands)
        total, ce, right = selector_loss(
            draft.candidate_selector, unary, cand, index, h_XGH, prev_XG, coef_XG, detach
        )
        m = mask_XG
        sums = torch.stack(
            [(weight_XG * ce).sum(), (right & m).sum(), (found & m).sum(), m.sum(), weight_XG.sum()]
        ).double()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums, group=group)
        n = sums[3].clamp_min(1)
        return weight * total, {
            "selector_loss": sums[0] / sums[4].clamp_min(1e-12),  # the pooled weighted mean
            "selector_acc": sums[1] / n,
            "candidate_recall": sums[2] / n,
        }


selector_term = SelectorTerm()
