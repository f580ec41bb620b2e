"""Acceptance statistics, calibration metrics and the prompt loader (no model needed)."""

from __future__ import annotations

import json
import random

import pytest

from evaluation.metrics import by_context, calibration_pairs, context_units, step_stats
from specforge_dspark.decoding.calibration_metrics import auroc, ece
from specforge_dspark.decoding.prompts import load_conversations, parse_workload
from specforge_dspark.decoding.spec_decode import Generation, Step, cut_new_tokens


def _naive_auroc(conf, label):
    pos = [c for c, y in zip(conf, label, strict=True) if y]
    neg = [c for c, y in zip(conf, label, strict=True) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_auroc_matches_pairwise_count_with_ties():
    rng = random.Random(0)
    conf = [rng.choice([0.1, 0.2, 0.5, 0.7, 0.9]) for _ in range(200)]
    label = [int(rng.random() < c) for c in conf]
    assert auroc(conf, label) == pytest.approx(_naive_auroc(conf, label), abs=1e-12)
    assert auroc([0.1, 0.9], [0, 1]) == 1.0
    assert auroc([0.9, 0.1], [0, 1]) == 0.0
    assert auroc([0.3, 0.4], [1, 1]) is None


def test_ece_by_hand():
    # bin 0: conf 0.05 x2, labels 0,1 -> |0.05-0.5|*2; bin 9: 0.95, label 1 -> 0.05
    assert ece([0.05, 0.05, 0.95], [0, 1, 1]) == pytest.approx((0.45 * 2 + 0.05) / 3)
    assert ece([1.0, 0.0], [1, 0]) == 0.0  # conf 1.0 falls in the last bin
    assert ece([], []) is None


def test_step_stats_exact():
    G = 3
    steps = [
        Step(accepted=3, committed=4, confidence=[0.9, 0.8, 0.7], drafts=[5, 6, 7]),
        Step(accepted=1, committed=2, confidence=[0.6, 0.5, 0.4], drafts=[8, 10, 9]),
        Step(accepted=0, committed=1, confidence=[0.3, 0.2, 0.1], drafts=[11, 12, 3]),
        Step(accepted=2, committed=1, confidence=[0.9, 0.9, 0.9], drafts=[1, 2, 3]),  # eos cut
    ]
    s = step_stats(steps, G, logical_vocab=10)
    assert (s["drafted_tokens"], s["padded_drafts"]) == (12, 3)  # ids 10, 11, 12
    assert s["padded_draft_rate"] == 3 / 12
    unknown = step_stats(steps, G)
    assert unknown["padded_drafts"] is None and unknown["padded_draft_rate"] is None
    assert step_stats([], G, logical_vocab=10)["padded_draft_rate"] is None
    assert s["steps"] == 4 and s["committed_tokens"] == 8
    assert s["accept_length"] == 2.0
    assert s["accept_length_uncut"] == (4 + 2 + 1 + 3) / 4
    assert s["per_position"] == [3 / 4, 2 / 4, 1 / 4]
    assert s["accept_length_uncut"] == pytest.approx(1 + sum(s["per_position"]))
    assert s["accept_length_hist"] == {"1": 2, "2": 1, "3": 0, "4": 1}
    # judged slots: step0 k=0..2 all accepted; step1 k=0 yes, k=1 no; step2 k=0 no;
    # step3 k=0,1 yes, k=2 no
    conf, label = calibration_pairs(steps, G)
    assert conf == [0.9, 0.8, 0.7, 0.6, 0.5, 0.3, 0.9, 0.9, 0.9]
    assert label == [1, 1, 1, 1, 0, 0, 1, 1, 0]
    assert s["calibration"]["pairs"] == 9


def test_context_buckets_by_hand():
    """A step counts at the position it drafts from: the prompt plus what was committed."""

    def gen(prompt_len: int, committed: list[int]) -> Generation:
        steps = [Step(accepted=c - 1, committed=c, confidence=[]) for c in committed]
        return Generation(prompt_ids=[0] * prompt_len, tokens=[0] * sum(committed), steps=steps)

    # prompt 7 tokens; steps start at 7, 10, 11 | 13, 17 (edges 0, 12, 16)
    a = gen(7, [3, 1, 2, 4, 1])
    b = gen(20, [2, 2])  # both steps at >= 16
    c = gen(14, [5])  # one step at 14: bucket 12-16
    buckets = by_context([a, b, c], ["a", "b", "c"], edges=(0, 12, 16))
    assert [(x["from"], x["to"], x["steps"], x["committed_tokens"]) for x in buckets] == [
        (0, 12, 3, 6),
        (12, 16, 2, 9),  # a's step at 13 (4 tokens) and c's at 14 (5)
        (16, None, 3, 5),  # a's step at 17 (1) and b's two (2 + 2)
    ]
    assert buckets[1]["accept_length"] == 4.5
    assert buckets[0]["accept_length_ci"] == [2.0, 2.0]  # one unit: no spread
    assert by_context([c], ["c"], edges=(0, 12, 16, 64))[0]["to"] == 16  # empty ones left out
    with pytest.raises(ValueError, match="rise from 0"):
        by_context([a], ["a"], edges=(12, 16))


def test_context_units_from_records_match_the_generations(tmp_path):
    """The per-bucket units of generations.jsonl records (accepted drafts per step, the
    prompt's length, the total) are the buckets `by_context` gives the same generations;
    a last step cut short is cut as the record's total says."""
    records = [  # a: steps of 3, 2, 2 from 10 (the last cut to 1); b: 4, 1 from 13
        {"workload": "w", "index": 0, "prompt_tokens": 10, "accepted_per_step": [2, 1, 1],
         "committed": 6},
        {"workload": "w", "index": 1, "prompt_tokens": 13, "accepted_per_step": [3, 0],
         "committed": 5},
    ]  # fmt: skip
    (tmp_path / "generations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cells = context_units(tmp_path, edges=(0, 12, 16))
    assert cells == [
        {("w", 0): (3, 1)},  # a's step at 10
        {("w", 0): (3, 2), ("w", 1): (4, 1)},  # a's at 13 and 15 (2 + 1), b's at 13
        {("w", 1): (1, 1)},  # b's at 17
    ]
    gens = [
        Generation([0] * 10, [0] * 6, [Step(2, 3, []), Step(1, 2, []), Step(1, 1, [])]),
        Generation([0] * 13, [0] * 5, [Step(3, 4, []), Step(0, 1, [])]),
    ]
    want = by_context(gens, [("w", 0), ("w", 1)], edges=(0, 12, 16))
    got = [(sum(c for c, _ in cell.values()), sum(n for _, n in cell.values())) for cell in cells]
    assert got == [(b["committed_tokens"], b["steps"]) for b in want]


def test_cut_at_eos_and_budget():
    eos = {7}
    assert cut_new_tokens([1, 2, 3], eos, 10) == ([1, 2, 3], False)
    assert cut_new_tokens([1, 7, 3], eos, 10) == ([1, 7], True)
    assert cut_new_tokens([1, 2, 3], eos, 2) == ([1, 2], True)
    assert cut_new_tokens([1, 2, 3], eos, 3) == ([1, 2, 3], True)
    assert cut_new_tokens([1, 2, 7], eos, 2) == ([1, 2], True)


def test_loader_by_field_skips_bad_rows(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"text": "first"},
        {"other": "no field"},
        {"text": ""},
        {"text": ["turn a", "turn b"]},
        {"text": "third"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    wl = parse_workload(f"mbpp={path}:text")
    assert (wl.name, wl.field) == ("mbpp", "text")
    with pytest.warns(UserWarning, match="skipped 3 rows"):
        convs = load_conversations(wl, 10)
    assert [c.turns for c in convs] == [("first",), ("turn a", "turn b"), ("third",)]
    assert [c.index for c in convs] == [0, 1, 2]
    with pytest.warns(UserWarning, match="skipped 2 rows"):
        two = load_conversations(wl, 2)
    assert [c.turns for c in two] == [("first",), ("turn a", "turn b")]


def test_builtin_workloads_read_shared_data(shared_data):
    data = shared_data / "eval"
    for name in ("gsm8k", "math500", "humaneval"):
        convs = load_conversations(parse_workload(name, data), 2)
        assert len(convs) == 2 and all(len(c.turns) == 1 for c in convs)
    mt = load_conversations(parse_workload("mt_bench", data), 3)
    assert all(len(c.turns) == 2 for c in mt)


def test_bad_workload_specs_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        parse_workload("nope")
    with pytest.raises(ValueError, match="name=path:field"):
        parse_workload("x=just_a_path")
    with pytest.raises(ValueError, match="no such file"):
        load_conversations(parse_workload(f"x={tmp_path}/missing.jsonl:q"), 1)


def test_the_comparison_plot_shows_every_drafter_and_names_a_missing_baseline(tmp_path):
    from evaluation.report import write_comparison_plot

    def summary(al: float) -> dict:
        row = {"accept_length": al, "accept_length_ci": [al - 0.2, al + 0.3]}
        per_position = [0.5, 0.25, 0.1]
        workloads = {"gsm8k": row, "humaneval": {**row, "accept_length_ci": None}}
        return {"workloads": workloads, "overall": {**row, "per_position": per_position}}

    results = {"trained": summary(2.5), "ngram": summary(2.0)}
    write_comparison_plot(results, tmp_path / "summary.png")
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KeyError, match=r"no 'ngram' among \['trained'\]"):
        write_comparison_plot({"trained": results["trained"]}, tmp_path / "other.png")
    assert not (tmp_path / "other.png").exists()
