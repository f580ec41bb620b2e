"""objective/acceptance.py's pure pieces by hand, and the recipe keys that select them
(the losses themselves against loop references: test_objective.py, test_dflash.py)."""

from __future__ import annotations

import pytest
import torch

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.objective.acceptance import LK_FLOOR, divergence, dpace_weights


def test_dpace_weights_are_suffix_sums_of_reach_probabilities():
    conf = torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 1.0], [0.5, 0.2, 0.9]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    w = dpace_weights(conf, mask, 0.0)
    # reach = 0.5, 0.25 (third slot unsupervised): w = 0.75, 0.25, 0
    torch.testing.assert_close(w[0], torch.tensor([0.75, 0.25, 0.0], dtype=torch.float64))
    torch.testing.assert_close(w[1], torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(w[2], torch.tensor([0.69, 0.19, 0.09], dtype=torch.float64))
    # smoothing 1: every confidence counts as 1, the weight is the supervised suffix length
    torch.testing.assert_close(dpace_weights(conf, mask, 1.0)[0], w.new_tensor([2.0, 1.0, 0.0]))
    # smoothing 0.5 of confidence 0: 0.5 per slot
    zero = dpace_weights(torch.zeros(1, 2, dtype=torch.float64), mask[1:2, :2], 0.5)
    torch.testing.assert_close(zero[0], w.new_tensor([0.75, 0.25]))


def test_dpace_weights_are_the_expected_accept_length_gradient():
    """w_k = d E / d log c_k for E = sum_t prod_{j<=t} c_j (smoothing 0)."""
    log_c = torch.log(torch.tensor([0.9, 0.6, 0.3, 0.8], dtype=torch.float64)).requires_grad_()
    expected = torch.cumprod(log_c.exp(), 0).sum()
    (grad,) = torch.autograd.grad(expected, log_c)
    got = dpace_weights(log_c.detach().exp()[None], torch.ones(1, 4, dtype=torch.bool), 0.0)
    torch.testing.assert_close(got[0], grad)


def test_lk_divergence_and_its_gradient_factor():
    l1 = torch.tensor([0.0, 0.5, 1.9, 2.0], dtype=torch.float64, requires_grad=True)
    alpha = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
    value, scale = divergence("lk", l1.detach(), alpha.detach())
    torch.testing.assert_close(value[:3], -torch.log(alpha[:3].detach()))
    assert float(value[3]) == pytest.approx(-torch.log(torch.tensor(LK_FLOOR)).item())
    (grad,) = torch.autograd.grad(-torch.log(alpha[:3]).sum(), l1)
    torch.testing.assert_close(scale[:3], grad[:3])  # d(-log alpha)/dL1 = 1 / (2 alpha)
    assert float(scale[3]) == 0.0  # below the floor: no gradient, as a clamp's
    same, none = divergence("l1", l1.detach(), alpha.detach())
    assert none is None and torch.equal(same, l1.detach())


def test_recipe_keys_are_checked_and_name_themselves():
    obj = recipe_from_dict({"objective": {"slot_weighting": "dpace", "divergence": "lk"}}).objective
    assert (obj.slot_weighting, obj.divergence, obj.dpace_alpha) == ("dpace", "lk", 0.5)
    with pytest.raises(ValueError, match="objective.dpace_alpha must be in"):
        recipe_from_dict({"objective": {"dpace_alpha": 1.5}})
    with pytest.raises(ValueError, match="objective.divergence"):
        recipe_from_dict({"objective": {"divergence": "kl"}})
    with pytest.raises(ValueError, match="objective.slot_weighting"):
        recipe_from_dict({"objective": {"slot_weighting": "uniform"}})
