"""`make quality`'s verdict and files (scripts/quality.py): per budget and workload,
DSpark against the n-gram drafter, "above" only when the intervals do not overlap."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quality():
    sys.path.insert(0, str(REPO / "scripts"))  # quality.py imports demo.py beside it
    spec = importlib.util.spec_from_file_location("quality", REPO / "scripts" / "quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _summary(per_workload: dict[str, tuple[float, float, float]]) -> dict:
    """A pooled evaluation summary: workload -> (accept length, ci low, ci high)."""
    cells = {w: {"accept_length": m, "accept_length_ci": [lo, hi]}
             for w, (m, lo, hi) in per_workload.items()}  # fmt: skip
    return {"workloads": cells, "overall": cells.pop("overall")}


def test_above_means_intervals_apart_per_budget_and_workload(quality, tmp_path):
    ngram = _summary({"gsm8k": (2.0, 1.8, 2.2), "humaneval": (3.0, 2.6, 3.5),
                      "overall": (2.4, 2.2, 2.6)})  # fmt: skip
    results = {
        "ngram": ngram,
        "dspark_300": _summary(
            {"gsm8k": (2.5, 2.2, 2.8), "humaneval": (2.0, 1.7, 2.3), "overall": (2.2, 2.0, 2.4)}
        ),  # fmt: skip
        "dspark_3000": _summary(
            {"gsm8k": (4.0, 3.6, 4.4), "humaneval": (3.9, 3.51, 4.3), "overall": (3.9, 3.6, 4.2)}
        ),  # fmt: skip
    }
    runs = {
        3000: {"steps": 3000, "training_tokens": 9000, "train_seconds": 300.0, "overrides": []},
        300: {"steps": 300, "training_tokens": 900, "train_seconds": 40.0, "overrides": []},
    }
    per_budget = quality.summarize(runs, results, ["gsm8k", "humaneval"])
    assert [b["steps"] for b in per_budget] == [300, 3000]
    first, last = (b["workloads"] for b in per_budget)
    # 2.2 touches n-gram's 2.2: overlapping, not above, though the mean is higher
    assert first["gsm8k"]["separated"] is False
    assert first["humaneval"]["separated"] is False and first["overall"]["separated"] is False
    assert all(last[w]["separated"] for w in ("gsm8k", "humaneval", "overall"))
    assert last["humaneval"]["dspark"] == {"accept_length": 3.9, "accept_length_ci": [3.51, 4.3]}
    assert last["humaneval"]["ngram"] == {"accept_length": 3.0, "accept_length_ci": [2.6, 3.5]}
    assert "overrides" not in per_budget[0]

    quality.write_curve_csv(per_budget, tmp_path / "curve.csv")
    rows = list(csv.DictReader((tmp_path / "curve.csv").open()))
    assert len(rows) == 2 * 3 * 2  # budgets x (workloads + overall) x drafters
    assert rows[0] == {"steps": "300", "training_tokens": "900", "train_seconds": "40.0",
                       "workload": "gsm8k", "drafter": "dspark", "accept_length": "2.5000",
                       "ci_low": "2.2000", "ci_high": "2.8000"}  # fmt: skip

    from evaluation.report import write_learning_curve

    write_learning_curve(per_budget, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
