"""STS calibration (decoding/calibration.py, decoding/sts.py) and the confidence verify budget
(evaluation/budget.py) on synthetic steps: the fits recover known temperatures (and a
known logit offset), the file loads with SGLang's own class, the export's confidence bias
is shifted exactly, and the budget follows SGLang's rule."""

from __future__ import annotations

import pytest
import torch

from evaluation.budget import VerifyBudget, budget_from_survival, survival, verify_drafts
from specforge_dspark.decoding.calibration import evaluate_sts, fit_sts, fit_sts_offset
from specforge_dspark.decoding.sts import (
    BIAS_KEY,
    read_bias_shift,
    shift_confidence_bias,
    validate_sts_file,
    write_sts_file,
)


def _synthetic(n: int, true_t: list[float], seed: int, true_d: float = 0.0):
    """Steps whose acceptance at slot k is sigmoid((z_k + true_d) / true_t[k]) given the
    prefix."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, len(true_t), generator=g, dtype=torch.float64) * 3 + 1
    acc = torch.rand(n, len(true_t), generator=g, dtype=torch.float64) < torch.sigmoid(
        (z + true_d) / torch.tensor(true_t, dtype=torch.float64)
    )
    return z, acc.long().cumprod(1).sum(1)


def test_sts_recovers_temperatures_and_halves_ece():
    true_t = [2.0, 0.5, 3.0]
    z, n = _synthetic(20000, true_t, seed=0)
    temps = fit_sts(z, n)
    assert all(abs(t / w - 1) < 0.1 for t, w in zip(temps, true_t, strict=True)), temps
    z2, n2 = _synthetic(20000, true_t, seed=1)
    before, after = evaluate_sts(z2, n2, [1.0] * 3), evaluate_sts(z2, n2, temps)
    assert after["conditional"]["ece"] <= 0.5 * before["conditional"]["ece"]
    for b, a in zip(before["per_position"], after["per_position"], strict=True):
        assert a["ece"] <= 0.5 * b["ece"] and a["brier"] < b["brier"]


def test_offset_fit_recovers_a_shift_that_temperatures_cannot_fix():
    """A head overconfident at every confidence (true logit = z - 2): temperatures alone
    leave most of the error, one shared offset plus temperatures recover both."""
    true_t, true_d = [1.5, 0.7, 2.0], -2.0
    z, n = _synthetic(20000, true_t, seed=2, true_d=true_d)
    temps, d = fit_sts_offset(z, n)
    assert abs(d - true_d) < 0.15, d
    assert all(abs(t / w - 1) < 0.1 for t, w in zip(temps, true_t, strict=True)), temps
    z2, n2 = _synthetic(20000, true_t, seed=3, true_d=true_d)
    before = evaluate_sts(z2, n2, [1.0] * 3)
    only_t = evaluate_sts(z2, n2, fit_sts(z, n))
    both = evaluate_sts(z2, n2, temps, d)
    ece = lambda r: r["conditional"]["ece"]  # noqa: E731
    assert ece(both) <= 0.25 * ece(before) and ece(both) < 0.5 * ece(only_t)
    assert both["conditional"]["brier"] < only_t["conditional"]["brier"]
    # no offset in the data: the fit finds none and matches the temperature-only fit
    z3, n3 = _synthetic(20000, true_t, seed=4)
    temps3, d3 = fit_sts_offset(z3, n3)
    assert abs(d3) < 0.1 and all(
        abs(a / b - 1) < 0.05 for a, b in zip(temps3, fit_sts(z3, n3), strict=True)
    )


def test_bias_shift_rewrites_only_the_confidence_bias(tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = {BIAS_KEY: torch.tensor([0.25]), "confidence_head.proj.weight": torch.ones(1, 4)}
    tensors["layers.0.w"] = torch.randn(3, 3)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert read_bias_shift(tmp_path) == 0.0
    assert shift_confidence_bias(tmp_path, -0.5) == -0.5
    assert shift_confidence_bias(tmp_path, 0.125) == -0.375  # accumulates
    out = load_file(str(tmp_path / "model.safetensors"))
    assert out[BIAS_KEY].item() == 0.25 - 0.5 + 0.125
    assert torch.equal(out["layers.0.w"], tensors["layers.0.w"])
    assert read_bias_shift(tmp_path) == -0.375
    # the harness's uncalibrated budget takes the recorded shift off again
    from types import SimpleNamespace

    from evaluation.budget import verify_budgets

    drafter = SimpleNamespace(config=SimpleNamespace(block_size=2))
    budgets = verify_budgets(drafter, tmp_path, 0.1, None)
    assert budgets["uncalibrated"].logit_offset == 0.375 and "calibrated" not in budgets
    raw = [0.3, -0.2]
    assert survival(raw, offset=0.375) == survival([z + 0.375 for z in raw])


def test_sts_file_loads_with_sglangs_class(tmp_path):
    path = tmp_path / "sts_calibration.json"
    write_sts_file(path, [0.5, 1.5, 2.0], "gsm8k", 10, [0.3, 0.2, 0.1], [0.1, 0.05, 0.02])
    assert validate_sts_file(path, 3) == [0.5, 1.5, 2.0]


def test_budget_rule():
    surv = survival([2.0, 0.0, -2.0, -5.0])  # ~[0.88, 0.44, 0.05, 0.0003]
    assert budget_from_survival(surv, 0.0) == 4  # flat cost: every candidate >= eps
    assert budget_from_survival(surv, 10.0) == 0  # verifying costs more than it brings
    mid = budget_from_survival(surv, 0.2)
    assert 1 <= mid <= 3
    assert verify_drafts(survival([2.0, -30.0, 5.0]), 3) == 1  # survival < eps is skipped
    b = VerifyBudget(block_size=4, verify_token_cost=0.2, lag_steps=2)
    low = [-6.0] * 4
    # the first two steps see no history (all ones): the budget is every draft, capped
    # by the current survival >= eps (2 drafts); the third step uses step 1's survival
    assert [b.drafts_to_verify(low) for _ in range(3)] == [2, 2, 0]
    b.reset()
    assert b.drafts_to_verify(low) == 2


def test_export_errors_come_before_any_decoding(tmp_path):
    """A wrong --export fails at once, naming it (the target path does not even exist)."""
    from safetensors.torch import save_file

    from evaluation.calibrate import calibrate

    def export(name: str, bias: float):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text("{}")
        head = {BIAS_KEY: torch.tensor([bias]), "confidence_head.proj.weight": torch.ones(1, 4)}
        save_file(head, str(d / "model.safetensors"))
        return d

    a, b = export("a", 0.0), export("b", 1.0)
    kw = dict(workloads=["gsm8k"], num_prompts=4, max_new_tokens=8, out_dir=tmp_path / "out")
    with pytest.raises(ValueError, match=r"--export .*empty: not an export directory \(no config"):
        (tmp_path / "empty").mkdir()
        calibrate("no-target", a, export_dir=tmp_path / "empty", **kw)
    with pytest.raises(ValueError, match="its confidence head differs from --draft"):
        calibrate("no-target", a, export_dir=b, **kw)
    assert not (tmp_path / "out").exists(), "nothing written before the checks"
