"""The learning curve of the embedded default (`make quality`, about 20 minutes on 2 CPU
cores): what accept length DSpark reaches for how much training, against the n-gram
drafter that needs none.

1. the tiny Inkling target (cached) answers a larger prompt mix than the demo's (QUALITY_MIX,
   2000 prompts; `data_pipelines.regenerate --backend hf`) three times each (REGEN), once:
   cached under .cache/quality/ by the target's weights, the mix and REGEN
2. DSpark trains at each budget of --budgets (300, 1000, 3000 steps on 2 ranks; each its
   own run and LR schedule) with data.pack and 128 anchors per packed sequence
   (`python -m specforge_dspark.cli.bench pack`), resuming a budget that was interrupted
3. every budget's export and the n-gram drafter decode the demo's four held-out workloads
   (--num-prompts each, greedy, lossless), sharing the references; 95% bootstrap
   intervals over prompts
Writes runs/quality/summary.json (per budget and workload: accept_length and
accept_length_ci of dspark and ngram, the training tokens and seconds), learning_curve.csv,
learning_curve.png, and the decoded texts in runs/quality/eval_*/generations.jsonl.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import demo  # noqa: E402  (scripts/demo.py: regeneration mix format, evaluation, tables)

# (file, field, first row, count): the demo's sources, more of each; evaluation-only rows
# (the first rows of the eval files, below targets/corpus.py EVAL_ROWS_RESERVED) are never read
QUALITY_MIX = (
    ("train/gsm8k_train.jsonl", "question", 0, 1200),
    ("eval/math500_test.jsonl", "problem", 100, 400),
    ("eval/humaneval.jsonl", "prompt", 100, 64),
    ("train/sharegpt_sample.json", "conversations", 0, 336),
)
TRAIN = (
    "data.pack=true",
    "objective.num_anchors=128",
    "train.epochs=1000",  # train.max_steps (the budget) decides
    "train.eval_interval=0",
    "train.served_eval.num_prompts=0",
    "export.formats=[sglang]",
    "export.calibrate_prompts=0",
    "checkpoint.save_interval=500",
)
# three answers per prompt: the greedy one, and two that open with 4 sampled tokens and go
# on greedily (the target's own loops; see docs/data.md, "Several answers per prompt")
REGEN = {"batch": 60, "max_new_tokens": 160, "samples": 3, "opening_tokens": 4}


def regenerated(recipe: str, target: Path) -> Path:
    """The target's answers to QUALITY_MIX, made once per (target weights, mix, settings)."""
    from specforge_dspark.training.fingerprint import weight_file_digest

    key = json.dumps(
        [[weight_file_digest(p) for p in sorted(target.glob("*.safetensors"))], QUALITY_MIX, REGEN]
    )
    cache = REPO / ".cache" / "quality" / f"regen-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    out, done = cache / "mix_regenerated.jsonl", cache / "done"
    if done.is_file():
        print(f"reusing {out}")
        return out
    mix = demo.prompt_mix(cache / "prompt_mix.jsonl", QUALITY_MIX)
    rows = sum(n for *_, n in QUALITY_MIX)
    cmd = [
        sys.executable, "-m", "data_pipelines.regenerate", "--recipe", recipe,
        "--input", str(mix), "--format", "messages", "--out", str(out), "--backend", "hf",
        "--batch-size", str(REGEN["batch"]), "--max-new-tokens", str(REGEN["max_new_tokens"]),
        "--answers-per-prompt", str(REGEN["samples"]),
        "--opening-tokens", str(REGEN["opening_tokens"]),
        "--max-rows", str(rows), "--quiet",
    ]  # fmt: skip
    print(" ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)  # resumes where an interrupted one stopped
    done.write_text("")
    return out


def recipe_digest(recipe: str, overrides: list[str]) -> str:
    """A finished run is reused only for the same resolved recipe: the file's contents and
    the overrides, as loaded (an edited recipe retrains)."""
    from specforge_dspark.config.recipe import load_recipe

    resolved = load_recipe(recipe, overrides).to_dict()
    resolved.pop("loop")  # the serving loop's settings: not read by a training run
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()


def train_budget(
    recipe: str, data: Path, steps: int, out: Path, nproc: int, train: tuple = TRAIN
) -> dict:
    """One budget's run (resumed when interrupted; kept when finished): its export, the
    supervised tokens it trained and its wall seconds. `train`: the runs' own overrides."""
    overrides = [
        f"train.output_dir={out}", f"train.max_steps={steps}", f"data.train_files=[{data}]",
        "data.format=messages", "data.max_rows=0", *train,
    ]  # fmt: skip
    record = out / "budget.json"
    digest = recipe_digest(recipe, overrides)
    if record.is_file():
        kept = json.loads(record.read_text())
        if kept["overrides"] == overrides and kept.get("recipe_digest") == digest:
            print(f"reusing {out} ({steps} steps)")
            return kept
        print(f"{out}: trained with another recipe or other settings; training it afresh")
        shutil.rmtree(out)
    t = time.time()
    demo.train_online(recipe, overrides, nproc, 29400)
    state = json.loads((out / "ckpt" / f"step-{steps}" / "train_state.json").read_text())
    result = {
        "steps": steps,
        "export": str(out / "export" / "sglang"),
        "training_tokens": state["tokens"] * nproc,  # rank 0's supervised tokens x ranks
        "train_seconds": round(time.time() - t, 1),
        "overrides": overrides,
        "recipe_digest": digest,
    }
    record.write_text(json.dumps(result, indent=1))
    return result


def separated(a: dict, b: dict) -> bool:
    """Whether a's 95% interval lies wholly above b's."""
    return a["accept_length_ci"][0] > b["accept_length_ci"][1]


def summarize(runs: dict[int, dict], results: dict[str, dict], workloads: list[str]) -> list:
    """Per budget (`runs`: steps -> train_budget's record), per workload and overall: the
    accept length and interval of dspark_<steps> and of ngram (`results`: pooled
    evaluation summaries by drafter), and whether dspark's interval lies above."""
    ngram = results["ngram"]
    per_budget = []
    for steps, r in sorted(runs.items()):
        mine = results[f"dspark_{steps}"]
        cells = {}
        for w in [*workloads, "overall"]:
            d = mine["overall"] if w == "overall" else mine["workloads"][w]
            n = ngram["overall"] if w == "overall" else ngram["workloads"][w]
            cells[w] = {
                "dspark": {k: d[k] for k in ("accept_length", "accept_length_ci")},
                "ngram": {k: n[k] for k in ("accept_length", "accept_length_ci")},
                "separated": separated(d, n),
            }
        per_budget.append({**{k: v for k, v in r.items() if k != "overrides"}, "workloads": cells})
    return per_budget


def write_curve_csv(per_budget: list[dict], path: Path) -> None:
    """One row per budget, workload and drafter."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["steps", "training_tokens", "train_seconds", "workload", "drafter",
                    "accept_length", "ci_low", "ci_high"])  # fmt: skip
        for b in per_budget:
            for wl, cell in b["workloads"].items():
                for name in ("dspark", "ngram"):
                    c = cell[name]
                    lo, hi = c["accept_length_ci"]
                    w.writerow([b["steps"], b["training_tokens"], b["train_seconds"], wl, name,
                                f"{c['accept_length']:.4f}", f"{lo:.4f}", f"{hi:.4f}"])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/tiny_cpu.yaml")
    ap.add_argument("--out", default="runs/quality")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--budgets", type=int, nargs="+", default=[300, 1000, 3000])
    ap.add_argument("--num-prompts", type=int, default=40, help="per workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    os.chdir(REPO)
    t0 = time.time()
    from evaluation.figures import provenance
    from evaluation.report import write_learning_curve
    from specforge_dspark.config.recipe import load_recipe
    from specforge_dspark.targets.target import build

    recipe = load_recipe(a.recipe)
    out = Path(a.out)
    demo.step("1/3 tiny Inkling target and its answers to the prompt mix")
    target = build(Path(recipe.target.path))
    demo.fresh_for_target(out, target)
    data = regenerated(a.recipe, target)

    budgets = sorted(a.budgets)
    runs = {}
    for i, steps in enumerate(budgets):
        demo.step(f"2/3 budget {i + 1} of {len(budgets)}: {steps} steps, packed")
        runs[steps] = train_budget(a.recipe, data, steps, out / f"steps_{steps}", a.nproc)

    demo.step("3/3 acceptance by speculative decoding (held-out prompts)")
    drafts = {f"dspark_{s}": r["export"] for s, r in runs.items()}
    drafts["ngram"] = ("ngram", recipe.draft.block_size)
    results, workloads, eval_seconds = demo.judge(
        drafts, target, a.num_prompts, a.max_new_tokens, out
    )

    per_budget = summarize(runs, results, workloads)
    top = per_budget[-1]["workloads"]
    met = all(top[w]["separated"] for w in workloads)
    summary = {
        "budgets": per_budget,
        "target_met": met,
        "target": "at the largest budget DSpark's 95% interval lies above the n-gram "
        "drafter's on every workload",
        "training_data": str(data),
        "training_prompts": [f"{f}[{s}:{s + n}] ({fld})" for f, fld, s, n in QUALITY_MIX],
        "recipe": a.recipe,
        "train_overrides": runs[budgets[-1]]["overrides"],
        "num_prompts": a.num_prompts,
        "max_new_tokens": a.max_new_tokens,
        "eval_seconds": round(eval_seconds, 1),
        "seconds": round(time.time() - t0, 1),
        "provenance": provenance(
            ["python", "scripts/quality.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    write_curve_csv(per_budget, out / "learning_curve.csv")
    write_learning_curve(per_budget, out / "learning_curve.png")
    for b in per_budget:
        behind = [w for w in workloads if not b["workloads"][w]["separated"]]
        print(
            f"{b['steps']:>5} steps ({b['training_tokens']} tokens, {b['train_seconds']:.0f} s): "
            + ("above n-gram on every workload" if not behind else f"not above on {behind}")
        )
    print(
        f"wrote {out}/summary.json, learning_curve.csv and learning_curve.png "
        f"({summary['seconds']:.0f} s); target {'met' if met else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
