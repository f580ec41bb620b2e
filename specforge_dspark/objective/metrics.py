"""What one objective call reports: `LossOutput` (the loss a rank backpropagates and the
metrics pooled over the data-parallel group) and the teacher-forced accept counts
(vocab_loss.py computes the per-slot statistics these pool)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from specforge_dspark.config.recipe import ObjectiveRecipe
from specforge_dspark.objective.blocks import Blocks
from specforge_dspark.objective.vocab_loss import objective_value, weighted_terms


@dataclass
class LossOutput:
    """`loss` is what this rank backpropagates; `metrics` are pooled over the DP group.

    Metrics (detached): loss (0-d; the pooled objective whose rank-average gradient the
    ranks' `loss` produce); ce, l1, bce (0-d; their means under the fixed decay weights,
    whatever objective.slot_weighting and divergence train, so that runs compare); alpha,
    top1, ce_k, conf_err ([G]; means over supervised slots at position k, NaN where there
    is none); tau (0-d, the per-block greedy accept length averaged over valid blocks, see
    the module docstring; NaN without a block) and tau_expected (0-d, the per-block
    expected accept length from the slots' acceptance probabilities, averaged the same
    way); valid_blocks, supervised_slots, weight_sum, sequences_skipped (0-d counts).
    """

    loss: Tensor
    metrics: dict[str, Tensor]

    def log_dict(self) -> dict[str, float]:
        """Flat floats for a tracker: per-position vectors become `name/k` entries."""
        out: dict[str, float] = {}
        for name, value in self.metrics.items():
            if value.dim() == 0:
                out[name] = value.item()
            else:
                out.update({f"{name}/{k}": v for k, v in enumerate(value.tolist())})
        return out


def accepted_drafts(top1_BNG: Tensor, eval_mask_BNG: Tensor) -> Tensor:
    """Teacher-forced greedy accept count of each block [B, N] (long): its leading slots
    whose draft argmax is the teacher's (top1 > 0.5), a slot outside the block's supervised
    prefix counting as rejected. The block's accept length is this + 1."""
    accept_BNG = (top1_BNG > 0.5) & eval_mask_BNG
    return accept_BNG.long().cumprod(dim=-1).sum(dim=-1)


def expected_accepts(alpha_BNG: Tensor, eval_mask_BNG: Tensor) -> Tensor:
    """Expected accepted drafts of each block [B, N]: sum_k prod_{i<=k} alpha_i over the
    block's slots, alpha (a slot's acceptance probability) counting 0 outside the block's
    supervised prefix. The block's expected accept length is this + 1."""
    alpha_BNG = torch.where(eval_mask_BNG, alpha_BNG, torch.zeros_like(alpha_BNG))
    return alpha_BNG.cumprod(dim=-1).sum(dim=-1)


def pooled_metrics(
    stats_8BNG: Tensor,
    bl: Blocks,
    obj: ObjectiveRecipe,
    weight_sum: Tensor,
    skipped: int,
    pooled: bool,
    group: dist.ProcessGroup | None,
) -> dict[str, Tensor]:
    """Pool per-slot statistics over the group (one all-reduce) into logging metrics."""
    stats = stats_8BNG.detach().to(torch.float64)
    mask_BNG = bl.eval_mask_BNG.to(torch.float64)
    G = mask_BNG.shape[-1]
    # unnormalised sums of w * term; summed over ranks and divided by the pooled W below
    _, terms_3 = weighted_terms(stats, bl.weight_BNG, obj)
    per_k = [torch.where(bl.eval_mask_BNG, stats[i], 0.0).sum(dim=(0, 1)) for i in (2, 5, 0, 4)]
    accepted = float(accepted_drafts(stats[5], bl.eval_mask_BNG).sum())
    expected = float(expected_accepts(stats[2], bl.eval_mask_BNG).sum())
    valid = float(bl.block_valid_BN.sum())
    # this rank's share of the pooled objective (its coefficients carry world / W)
    world = dist.get_world_size(group) if pooled else 1
    share = float(objective_value(stats, obj)) / world
    counts = stats.new_tensor([valid, float(skipped), accepted, expected, share])
    packed = torch.cat([terms_3, mask_BNG.sum(dim=(0, 1)), *per_k, counts])
    if pooled:
        dist.all_reduce(packed, group=group)
    terms_3, n_G, alpha_G, top1_G, ce_G, calib_G, counts = packed.split([3, G, G, G, G, G, 5])
    terms_3 = terms_3 / weight_sum.clamp_min(1e-12)
    alpha_G = alpha_G / n_G
    return {
        "loss": counts[4],
        "ce": terms_3[0],
        "l1": terms_3[1],
        "bce": terms_3[2],
        "alpha": alpha_G,
        "top1": top1_G / n_G,
        "ce_k": ce_G / n_G,
        "conf_err": calib_G / n_G,
        "tau": 1.0 + counts[2] / counts[0],  # NaN without a valid block
        "tau_expected": 1.0 + counts[3] / counts[0],
        "valid_blocks": counts[0],
        "supervised_slots": n_G.sum(),
        "weight_sum": weight_sum.detach(),
        "sequences_skipped": counts[1],
    }
