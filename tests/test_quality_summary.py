"""`make quality`'s verdict and files (scripts/quality.py): per budget and workload,
DSpark against the n-gram drafter, "above" only when the intervals do not overlap."""

from __future__ import annotations

import csv
import importlib.util
import json
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


@pytest.fixture(scope="module")
def bakeoff(quality):
    spec = importlib.util.spec_from_file_location("bakeoff", REPO / "scripts" / "bakeoff.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _generations(path: Path, rows: list[tuple[str, int, int, int]]) -> None:
    """generations.jsonl of (workload, index, committed, verify steps) rows."""
    path.mkdir(parents=True)
    lines = [
        json.dumps(
            {
                "workload": w,
                "index": i,
                "turn": 0,
                "prompt": f"prompt {w} {i}",
                "output": f"text {path.name} {i}",
                "new_tokens": c,
                "committed": c,
                "verify_steps": n,
                "accepted_per_step": [c // n - 1] * n,
            }
        )  # fmt: skip
        for w, i, c, n in rows
    ]
    (path / "generations.jsonl").write_text("\n".join(lines) + "\n")


def test_the_bakeoff_shows_the_decoded_texts_where_a_kind_loses(bakeoff, tmp_path):
    w = ("gsm8k", "humaneval", "overall")  # gsm8k: dflash wholly below dspark; else overlaps
    cells = {
        "dspark": dict(zip(w, [(4.0, 3.6, 4.4), (3.0, 2.5, 3.5), (3.5, 3.2, 3.8)], strict=True)),
        "dflash": dict(zip(w, [(2.5, 2.2, 2.9), (3.1, 2.6, 3.6), (2.8, 2.5, 3.1)], strict=True)),
        "dflash2": dict(zip(w, [(3.9, 2.8, 4.2), (3.0, 2.4, 3.6), (3.4, 3.0, 3.7)], strict=True)),
        "ngram": dict(zip(w, [(3.0, 2.5, 3.5), (3.2, 2.8, 3.6), (3.1, 2.8, 3.4)], strict=True)),
    }
    results = {k: _summary(v) for k, v in cells.items()}
    per_prompt = {"dspark": [40, 40, 40], "dflash": [38, 10, 30], "dflash2": [40, 40, 40],
                  "ngram": [30, 30, 30]}  # fmt: skip
    for kind, committed in per_prompt.items():
        rows = [("gsm8k", i, c, 10) for i, c in enumerate(committed)]
        _generations(tmp_path / f"eval_{kind}", rows + [("humaneval", i, 30, 10) for i in range(3)])
    lost = bakeoff.losses_report(results, ["gsm8k", "humaneval"], tmp_path)
    assert lost == [{"workload": "gsm8k", "loser": "dflash", "winner": "dspark", "prompts": [1, 2]}]
    text = (tmp_path / "losses.md").read_text()
    assert "## gsm8k: dflash 2.50 below dspark 4.00" in text
    assert "text eval_dflash 1" in text and "text eval_dspark 1" in text  # both decoded texts
    assert "humaneval" not in text


def test_a_finished_run_is_reused_only_for_the_same_recipe(quality, tmp_path, monkeypatch):
    """`make quality` / `make bakeoff` keep a finished run when rerun, but an edited recipe
    (not only other overrides) trains it afresh."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text((REPO / "recipes" / "tiny_cpu.yaml").read_text())
    out, data = tmp_path / "run", tmp_path / "data.jsonl"
    trained = []

    def fake_run(cmd, **kwargs):  # the training job: writes what a finished run leaves
        trained.append(cmd)
        (out / "ckpt" / "step-5").mkdir(parents=True)
        (out / "ckpt" / "step-5" / "train_state.json").write_text('{"tokens": 10}')

    monkeypatch.setattr(quality.subprocess, "run", fake_run)
    first = quality.train_budget(str(recipe), data, 5, out, 1, ())
    assert len(trained) == 1 and first["recipe_digest"]
    assert quality.train_budget(str(recipe), data, 5, out, 1, ()) == first  # reused
    assert len(trained) == 1
    recipe.write_text(recipe.read_text().replace("num_anchors: ", "num_anchors: 1", 1))
    assert (
        quality.train_budget(str(recipe), data, 5, out, 1, ())["recipe_digest"]
        != first["recipe_digest"]
    )
    assert len(trained) == 2  # the edited recipe trained afresh
