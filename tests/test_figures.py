"""Every figure the README shows from a command comes from that command's results file
(docs/results/NAME.json, evaluation/figures.py): the README's blocks are what the results
render to, each results file says where, when and by which command it was made, and the
renderer bolds only what its intervals support."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from evaluation import figures

REPO = figures.REPO


def test_the_readmes_figures_are_rendered_from_the_results_files():
    blocks = []
    for page in figures.PAGES:
        text = page.read_text()
        blocks += [m.group(2) for m in figures.BLOCK.finditer(text)]
        assert figures.render_page(page) == text, (
            f"{page.name}'s figures blocks differ from docs/results: run "
            "`python -m evaluation.figures render` (or publish the run they came from)"
        )
    assert {"demo", "bakeoff", "drift", "loop"} <= set(blocks), blocks
    for path in sorted(figures.RESULTS.glob("*.json")):
        res = figures.load_results(path.stem)  # refuses a file without its provenance
        p = res["provenance"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", p["date"]), path
        assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?", p["commit"]), path
        assert p["command"].startswith("python scripts/"), path
        assert path.stem in blocks, f"{path}: published but shown on no page"


def _demo_results(trained_ci, ngram_ci) -> dict:
    def drafter(al, ci, lossless=True):
        w = {"accept_length": al, "accept_length_ci": ci, "lossless": lossless}
        return {"accept_length": al, "accept_length_ci": ci, "per_position": [0.7, 0.3],
                "workloads": {"gsm8k": dict(w), "humaneval": dict(w)}}  # fmt: skip

    return {
        "trained": drafter(4.0, trained_ci),
        "untrained": drafter(1.0, [1.0, 1.0]),
        "ngram": {**drafter(2.5, ngram_ci), "per_position": [0.4, 0.25]},
        "num_prompts": 20,
        "max_new_tokens": 128,
        "seconds": 501.0,
        "split_seconds": {"target_build": 1.0, "regeneration": 85.0},
        "provenance": {
            "date": "2026-12-04",
            "commit": "abc1234",
            "machine": "2-core CPU",
            "command": "python scripts/demo.py --nproc 2",
        },  # fmt: skip
    }


@pytest.mark.parametrize(
    "trained_ci, ngram_ci, bold",
    [([3.8, 4.2], [2.3, 2.7], True), ([2.6, 4.2], [2.3, 2.7], False)],
)
def test_bold_and_the_sentence_follow_the_intervals(tmp_path, trained_ci, ngram_ci, bold):
    res = _demo_results(trained_ci, ngram_ci)
    (tmp_path / "demo.json").write_text(json.dumps(res))
    text = "intro\n<!-- figures:demo -->\nold table\n<!-- /figures:demo -->\nafter\n"
    out = figures.render(text, tmp_path)
    assert out.startswith("intro\n<!-- figures:demo -->\n") and out.endswith("after\n")
    assert "old table" not in out
    trained_row = next(line for line in out.splitlines() if line.startswith("| trained"))
    assert (f"**4.000** [{trained_ci[0]:.2f}, {trained_ci[1]:.2f}]" in trained_row) is bold
    assert "**" not in next(line for line in out.splitlines() if line.startswith("| n-gram"))
    want = "on 2 of 2 workloads (gsm8k, humaneval)" if bold else "on 0 of 2 workloads"
    assert want in out, out
    assert "at 0 of 2 draft positions" not in out and "at 2 of 2 draft positions" in out
    assert "`python scripts/demo.py --nproc 2`" in out and "commit abc1234" in out
    assert figures.render(out, tmp_path) == out  # rendering is a fixed point


def test_a_results_file_without_provenance_and_an_unknown_block_are_refused(tmp_path):
    res = _demo_results([3.8, 4.2], [2.3, 2.7])
    del res["provenance"]["commit"]
    (tmp_path / "demo.json").write_text(json.dumps(res))
    with pytest.raises(ValueError, match=r"demo.json: provenance lacks \['commit'\]"):
        figures.render("<!-- figures:demo -->\n<!-- /figures:demo -->\n", tmp_path)
    with pytest.raises(ValueError, match="figures:nosuch: no renderer"):
        figures.render("<!-- figures:nosuch -->\n<!-- /figures:nosuch -->\n", tmp_path)
    text = "<!-- figures:bakeoff -->\nstale\n<!-- /figures:bakeoff -->\n"
    assert "run `make bakeoff`" in figures.render(text, tmp_path)  # nothing published yet
    text = "<!-- figures:loop_real -->\n<!-- /figures:loop_real -->\n"
    assert "run `make loop TARGET=smollm2`, then" in figures.render(text, tmp_path)


def test_every_unpublished_block_names_a_make_target_the_makefile_has():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    for name in figures.PUBLISHED:
        command = figures.MAKE_COMMAND.get(name, f"make {name}").split()
        assert command[0] == "make" and command[1] in targets, (name, command)


def test_provenance_names_this_commit():
    p = figures.provenance(["python", "scripts/demo.py"])
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert p["commit"].split("+")[0] == head and p["command"] == "python scripts/demo.py"


def test_the_bakeoff_pairs_drafters_on_the_same_prompts(tmp_path):
    """scripts/bakeoff.py's paired comparison from the decoded texts, and its rendering:
    "better" only where the paired interval excludes 0."""
    import importlib.util
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location("bakeoff", REPO / "scripts" / "bakeoff.py")
    bakeoff = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bakeoff)
    per_step = {"dspark": 3.0, "dflash": 2.0, "ngram": 2.0}  # committed per verify step
    for name, rate in per_step.items():
        (tmp_path / f"eval_{name}").mkdir()
        rows = []
        for w in ("gsm8k", "mt_bench"):
            for i in range(12):
                steps = 10 + 3 * i
                for turn in (0, 1) if w == "mt_bench" else (0,):
                    jitter = (i % 3) - 1 if name == "dflash" else 0  # dflash ~ ngram, noisier
                    rows.append({"workload": w, "index": i, "turn": turn, "verify_steps": steps,
                                 "committed": rate * steps + jitter})  # fmt: skip
        lines = "".join(json.dumps(r) + "\n" for r in rows)
        (tmp_path / f"eval_{name}" / "generations.jsonl").write_text(lines)
    pairs = bakeoff.paired(list(per_step), ["gsm8k", "mt_bench"], tmp_path)
    got = {(r["a"], r["b"], r["workload"]): r for r in pairs}
    assert len(pairs) == 3 * 3  # 3 pairs x (2 workloads + overall)
    assert got["dspark", "dflash", "overall"]["better"] == "dspark"
    assert got["dspark", "dflash", "overall"]["difference"] == pytest.approx(1.0, abs=0.02)
    assert got["dflash", "ngram", "overall"]["better"] is None  # its interval holds 0
    assert got["dspark", "ngram", "mt_bench"]["units"] == 12  # a conversation is one unit
    res = {
        "kinds": {n: {"flops_per_step": 2e7 if n != "ngram" else 0.0, "workloads": {
            "gsm8k": {"accept_length": r, "accept_length_ci": [r - 0.1, r + 0.1]}}}
            for n, r in per_step.items()},
        "paired": pairs, "num_prompts": 12, "max_new_tokens": 64,
        "provenance": {"date": "2026-12-04", "commit": "abc1234", "machine": "2-core CPU",
                       "command": "python scripts/bakeoff.py --nproc 2"},
    }  # fmt: skip
    text = figures.render_bakeoff(res)
    assert "| n-gram | 2.000 [1.90, 2.10] | 0.0 | - |" in text
    same = {"l1_weight": 0.9, "slot_weighting": "decay", "divergence": "l1", "window": None}
    res["settings"] = {
        "dspark": {"kind": "dspark", "block": 16, **same},
        "dflash": {"kind": "dflash", "block": 5, **same},
        "ngram": {"kind": "n-gram", "block": 16, **same, "l1_weight": None},
    }
    table = figures.render_bakeoff(res)  # only what differs between rows is a column
    assert "| drafter | kind | block | l1_weight | gsm8k | MFLOP / step | ms / step |" in table
    assert "| dflash | dflash | 5 | 0.9 | 2.000 [1.90, 2.10] | 20.0 | - |" in table
    assert "| n-gram | n-gram | 16 | - |" in table and "slot_weighting" not in table
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in table.splitlines()}
    # the leader (dspark) against every other drafter; dflash and n-gram differ in more
    # than one setting and neither leads: not shown
    assert rows["dspark", "dflash"].startswith("| dspark | dflash | kind, block | +1.000 [")
    assert rows["dspark", "dflash"].endswith("| dspark | gsm8k | - |")
    assert ("dflash", "n-gram") not in rows and ("n-gram", "dflash") not in rows
    res["settings"]["dflash"]["block"] = 16  # now dspark and dflash differ in kind alone
    res["kinds"]["dflash"]["workloads"]["overall"] = {"accept_length": 9.0}  # and dflash leads
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line
            for line in figures.render_bakeoff(res).splitlines()}  # fmt: skip
    assert rows["dspark", "dflash"].startswith("| dspark | dflash | kind | +1.000 [")
    assert rows["dflash", "n-gram"].split("|")[5].strip() == "-"  # its interval holds 0
    assert ("dspark", "n-gram") not in rows


def test_the_drift_tables_pool_seeds_and_pair_each_side():
    def al(x):
        return {"accept_length": x, "accept_length_ci": [x - 0.2, x + 0.2]}

    def diff(d):
        return {"difference": d, "ci": [d - 0.1, d + 0.1]}

    ws = ("gsm8k", "mt_bench")
    fmt = {
        "targets": {"gsm8k": {"top1_agreement": 0.9, "kl_a_b": 0.002, "tokens": 100},
                    "mt_bench": {"top1_agreement": 0.8, "kl_a_b": 0.006, "tokens": 300}},
        "sides": {s: {w: al(x) for w in (*ws, "overall")}
                  for s, x in (("a", 3.0), ("b", 3.05), ("c", 3.5))},
        "paired": {p: {"pooled": {w: diff(d) for w in (*ws, "overall")},
                       "by_seed": {"0": diff(d), "1": diff(-d), "2": diff(0.0)}}
                   for p, d in (("b_minus_a", 0.05), ("c_minus_a", 0.5), ("c_minus_b", 0.45))},
    }  # fmt: skip
    res = {
        "formats": {"nvfp4": fmt}, "seeds": [0, 1, 2], "steps": 800, "num_prompts": 10,
        "a_on_original": {"overall": al(3.6)},
        "provenance": {"date": "2026-12-06", "commit": "abc1234", "machine": "2-core CPU",
                       "command": "python scripts/drift.py --nproc 2"},
    }  # fmt: skip
    lines = figures.render_drift(res).splitlines()
    # top-1 and KL weighted by tokens: (0.9 * 100 + 0.8 * 300) / 400, (0.2 + 1.8) / 400
    assert lines[4] == ("| nvfp4 | 0.8250 | 0.00500 | 3.000 [2.80, 3.20] | 3.050 [2.85, 3.25] "
                        "| 3.500 [3.30, 3.70] | +0.050 [-0.05, +0.15] | **+0.500 [+0.40, +0.60]** "
                        "| **+0.450 [+0.35, +0.55]** |")  # fmt: skip
    assert "(a) on the original itself: 3.600 [3.40, 3.80]" in lines[0]
    assert len([x for x in lines if x.startswith("| nvfp4")]) == 1  # overall only
    detail = figures.render_drift_workloads(res).splitlines()
    seed_rows = [x for x in detail if x.startswith("| nvfp4 | (")]
    assert seed_rows[1] == ("| nvfp4 | (c) - (a) | **+0.500 [+0.40, +0.60]** "
                            "| **-0.500 [-0.60, -0.40]** | +0.000 [-0.10, +0.10] "
                            "| **+0.500 [+0.40, +0.60]** |")  # fmt: skip
    rows = [x for x in detail if x.startswith("| nvfp4 | ") and not x.startswith("| nvfp4 | (")]
    assert [r.split(" | ")[1] for r in rows] == list(ws)
    assert rows[1].split(" | ")[2:4] == ["0.8000", "0.00600"]


def test_the_loop_block_shows_each_drafter_paired_against_the_base(tmp_path):
    def cell(al, ci, d=None):
        out = {"accept_length": al, "ci": ci}
        if d is not None:
            out["minus_base"] = {"difference": d, "ci": [d - 0.1, d + 0.1], "units": 9}
        return out

    res = {
        "table": {"shifted traffic (held out)": {"requests": 9, "base": cell(2.1, [1.9, 2.3]),
                  "control": cell(2.15, [1.9, 2.4], 0.05), "loop": cell(2.6, [2.4, 2.8], 0.5)}},
        "lossless": True,
        "rounds": [{"round": 0, "seconds": {"record": 30.0, "train": 90.0}, "promoted": True}],
        "settings": {"rounds": 1, "requests_per_round": 12, "steps_per_round": 50},
        "provenance": {"date": "2026-12-04", "commit": "abc1234", "machine": "m",
                       "command": "python scripts/loop.py"},
    }  # fmt: skip
    gain = [{"difference": 0.2, "ci": [0.1, 0.3], "better": "a"},
            {"difference": -0.01, "ci": [-0.05, 0.03], "better": None}]  # fmt: skip
    res["table"]["shifted traffic (held out)"]["loop"]["positions"] = {
        "paired_gain": gain, "improved": [1], "worse": []}  # fmt: skip
    res["stream"] = {"requests": 50, "answered": 50, "failed": 0, "started_during_a_swap": 4,
                     "swaps": 2, "in_flight_across_a_swap_edge": 1,
                     "same_answer_to_each_prompt": True}  # fmt: skip
    (tmp_path / "loop.json").write_text(json.dumps(res))
    out = figures.render("<!-- figures:loop -->\n<!-- /figures:loop -->\n", tmp_path)
    assert "1 +0.200 [+0.10, +0.30], 2 -0.010 [-0.05, +0.03]; improved at [1], worse at none" in out
    assert "50 sent, 50 answered, **0 failed or dropped**; 4 started during its 2 swap" in out
    row = next(line for line in out.splitlines() if line.startswith("| shifted"))
    assert row == (
        "| shifted traffic (held out) | 9 | 2.100 [1.90, 2.30] | 2.150 [1.90, 2.40] "
        "| +0.050 [-0.05, +0.15] | 2.600 [2.40, 2.80] | +0.500 [+0.40, +0.60] |"
    )
    assert (
        "trained 50 more steps" in out and "round 0: promoted (120 s: record 30, train 90)" in out
    )
