"""The bake-off (`make bakeoff`): DSpark, DFlash and DFlash2 at blocks 5, 8 and 16 trained
in ONE job from one feature stream of the tiny Inkling target (recipes/tiny_cpu_bakeoff.yaml:
the same data, anchors, steps, seed and objective for each; DFlash also with D-PACE and
with the LK loss, one change each), then judged by real speculative decoding against the
n-gram drafter, per workload, every pair on the same prompts (paired intervals), DFlash2
also with its selector off, and per unit of draft compute.

1. the tiny Inkling target (cached) and its answers to `make quality`'s prompt mix (cached
   under .cache/quality/, shared with it)
2. one training job of --steps steps on --nproc ranks: the DSpark and its companions
   (resumed when interrupted, reused when finished with the same settings)
3. every export and the n-gram drafter decode the demo's four held-out workloads
   (--num-prompts each, greedy, lossless), sharing the references; 95% bootstrap
   intervals over prompts
4. draft cost per served verify step (evaluation/compute.py: context keys and values
   cached, attention counted by hand, the rest by torch's FLOP counter) and its time on
   this CPU, at the mean context length of the decoded prompts
Writes <out>/summary.json (per kind and workload: accept_length, accept_length_ci; per
kind: FLOPs per step and per drafted token, accept length per draft GFLOP; `settings`:
what differs between rows; `paired`: every pair's paired difference), summary.png,
and <out>/losses.md: where a kind's interval lies wholly below another's, the prompts it
loses most on, both decoded texts side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import demo  # noqa: E402  (scripts/demo.py: evaluation split, tables)
import quality  # noqa: E402  (scripts/quality.py: the cached on-policy answers)

RECIPE = "recipes/tiny_cpu_bakeoff.yaml"
BACKBONE = {"dflash2_no_selector": "dflash"}  # a drafter costed as the kind of its network
TRAIN = (
    "train.epochs=1000",  # train.max_steps decides
    "train.eval_interval=0",
    "train.served_eval.num_prompts=0",
    "checkpoint.save_interval=250",
    "export.formats=[sglang]",
)


def kinds(recipe) -> dict[str, str]:
    """Drafter name -> its folder under the run: the recipe's own DSpark, its companions."""
    return {"dspark": "", **{c.name: f"companions/{c.name}" for c in recipe.companions}}


def settings(recipe) -> dict[str, dict]:
    """Per drafter, what may differ between the bake-off's rows (named columns)."""
    from specforge_dspark.config.companions import companion_recipe

    recipes = {"dspark": recipe}
    recipes |= {c.name: companion_recipe(recipe, i) for i, c in enumerate(recipe.companions)}
    out = {}
    for name, r in recipes.items():
        d, o = r.draft, r.objective
        sliding = "sliding_attention" in (d.layer_types or [])
        out[name] = {"kind": d.kind, "block": d.block_size, "l1_weight": o.l1_weight,
                     "slot_weighting": o.slot_weighting, "divergence": o.divergence,
                     "window": d.sliding_window if sliding else None,
                     "selector": None if d.kind != "dflash2" else
                     ("detached" if o.selector_detach else "joint")}  # fmt: skip
    if "dflash2" in out:
        out["dflash2_no_selector"] = {**out["dflash2"], "selector": "off"}
    out["ngram"] = {"kind": "n-gram", "block": recipe.draft.block_size, "l1_weight": None,
                    "slot_weighting": None, "divergence": None, "window": None,
                    "selector": None}  # fmt: skip
    return out


def train(recipe, data: Path, steps: int, out: Path, nproc: int) -> dict:
    """The one job that trains every kind (quality.py's run of one budget: resumed when
    interrupted, kept when finished with the same settings); every kind's export."""
    trained = quality.train_budget(RECIPE, data, steps, out, nproc, TRAIN)
    exports = {k: str(out / sub / "export" / "sglang") for k, sub in kinds(recipe).items()}
    return {**{k: v for k, v in trained.items() if k != "export"}, "exports": exports}


def mean_context(eval_dir: Path, target: Path) -> int:
    """Mean context a verify step drafts over: the prompt's tokens (without the chat
    template's few) and half the output's, over the decoded prompts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    rows = [json.loads(x) for x in (eval_dir / "generations.jsonl").open()]
    return int(sum(len(tok(r["prompt"]).input_ids) + r["new_tokens"] / 2 for r in rows) / len(rows))


def losses_report(results: dict, workloads: list[str], out: Path, per: int = 2) -> list[dict]:
    """Where one kind's interval lies wholly below another's: the prompts with the largest
    per-prompt accept-length gap, both decoded texts (losses.md)."""
    found, lines = [], ["# Where a kind loses (decoded texts)", ""]
    names = [k for k in results if k != "ngram"]
    for w in workloads:
        for a in names:
            for b in [*names, "ngram"]:
                ra, rb = results[a]["workloads"][w], results[b]["workloads"][w]
                if a == b or not ra["accept_length_ci"][1] < rb["accept_length_ci"][0]:
                    continue
                ga, gb = (_generations(out / f"eval_{k}", w) for k in (a, b))
                gap = sorted(ga, key=lambda i: _al(ga[i]) - _al(gb[i]))[:per]
                found.append({"workload": w, "loser": a, "winner": b, "prompts": gap})
                lines += [f"## {w}: {a} {ra['accept_length']:.2f} below {b} "
                          f"{rb['accept_length']:.2f}", ""]  # fmt: skip
                for i in gap:
                    lines += [f"prompt {i}: {ga[i]['prompt'][:300]!r}", ""]
                    for k, g in ((a, ga[i]), (b, gb[i])):
                        steps = g["accepted_per_step"][:24]
                        said = f"accept length {_al(g):.2f}, accepted per step {steps}"
                        lines += [f"- {k} ({said}): {g['output'][:400]!r}"]
                    lines.append("")
    if not found:
        lines.append("No kind's interval lies wholly below another's on any workload.")
    (out / "losses.md").write_text("\n".join(lines) + "\n")
    return found


def cells(results: dict, name: str) -> dict:
    """Per workload and overall: accept length, its interval, and whether it lies wholly
    above the n-gram drafter's."""
    out = {}
    for w in [*results[name]["workloads"], "overall"]:
        r, n = (x["overall"] if w == "overall" else x["workloads"][w]
                for x in (results[name], results["ngram"]))  # fmt: skip
        out[w] = {k: r[k] for k in ("accept_length", "accept_length_ci")}
        out[w]["above_ngram"] = r["accept_length_ci"][0] > n["accept_length_ci"][1]
    return out


def paired(names: list[str], workloads: list[str], out: Path) -> list[dict]:
    """Every pair of drafters, per workload and overall: a's accept length minus b's on the
    same prompts with its paired 95% interval (evaluation.metrics.paired_difference);
    "better" only where the interval excludes 0."""
    from evaluation.metrics import prompt_units
    from specforge_dspark.decoding.intervals import paired_difference

    units = {name: prompt_units(out / f"eval_{name}") for name in names}
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for w in [*workloads, "overall"]:
                pick = [k for k in units[a] if w == "overall" or k[0] == w]
                ua, ub = ({k: units[x][k] for k in pick} for x in (a, b))
                d = paired_difference(ua, ub)
                better = {"a": a, "b": b, None: None}[d["better"]]
                rows.append({"a": a, "b": b, "workload": w, **d, "better": better})
    return rows


def _generations(eval_dir: Path, workload: str) -> dict[int, dict]:
    rows = (json.loads(x) for x in (eval_dir / "generations.jsonl").open())
    return {r["index"]: r for r in rows if r["workload"] == workload and r["turn"] == 0}


def _al(g: dict) -> float:
    return g["committed"] / max(g["verify_steps"], 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bakeoff")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--num-prompts", type=int, default=20, help="per workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    os.chdir(REPO)
    t0 = time.time()
    from evaluation.compute import step_flops
    from evaluation.figures import provenance
    from evaluation.report import write_comparison_plot
    from specforge_dspark.config.recipe import load_recipe
    from specforge_dspark.targets.target import build

    recipe = load_recipe(RECIPE)
    out = Path(a.out)
    demo.step("1/4 tiny Inkling target and its answers to the prompt mix")
    target = build(Path(recipe.target.path))
    demo.fresh_for_target(out, target)
    data = quality.regenerated(RECIPE, target)

    demo.step(f"2/4 {', '.join(kinds(recipe))} from one stream: {a.steps} steps")
    trained = train(recipe, data, a.steps, out / "train", a.nproc)

    demo.step("3/4 acceptance by speculative decoding (held-out prompts)")
    drafts = {**trained["exports"], "ngram": ("ngram", recipe.draft.block_size)}
    if "dflash2" in drafts:  # the same checkpoint with its selector off: the selector's gain
        drafts["dflash2_no_selector"] = f"no-selector:{drafts['dflash2']}"
    results, workloads, eval_seconds = demo.judge(
        drafts, target, a.num_prompts, a.max_new_tokens, out
    )

    demo.step("4/4 draft cost per served verify step (FLOPs and time on this CPU)")
    ctx = mean_context(out / "eval_dspark", target)
    compute = {}
    for kind, export in trained["exports"].items():
        al = results[kind]["overall"]["accept_length"]
        flops = step_flops(export, target, ctx, committed=al)
        compute[kind] = {**flops, "accept_length_per_gflop": al / (flops["flops_per_step"] / 1e9)}
        print(f"{kind:<8} {flops['flops_per_step'] / 1e6:7.1f} MFLOP, "
              f"{flops['draft_ms_per_step']:.2f} ms per served step, "
              f"{flops['flops_per_drafted_token'] / 1e6:5.2f} per drafted token, accept length "
              f"{al:.3f} = {compute[kind]['accept_length_per_gflop']:.1f} per GFLOP")  # fmt: skip
    lost = losses_report(results, workloads, out)
    pairs = paired(list(drafts), workloads, out)
    for r in (r for r in pairs if r["workload"] == "overall"):
        print(f"{r['a']} - {r['b']}: {r['difference']:+.3f} {r['ci']} "
              f"({r['better'] + ' better' if r['better'] else 'no difference shown'})")  # fmt: skip
    summary = {
        "kinds": {
            name: {
                **compute.get(name, compute.get(BACKBONE.get(name), {"flops_per_step": 0.0})),
                "workloads": cells(results, name),
            }  # fmt: skip
            for name in drafts
        },
        "losses": lost,
        "paired": pairs,
        "settings": settings(recipe),
        "context_tokens_for_flops": ctx,
        "training": {k: v for k, v in trained.items() if k != "exports"},
        "recipe": RECIPE,
        "training_data": str(data),
        "num_prompts": a.num_prompts,
        "max_new_tokens": a.max_new_tokens,
        "eval_seconds": round(eval_seconds, 1),
        "seconds": round(time.time() - t0, 1),
        "provenance": provenance(
            ["python", "scripts/bakeoff.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    write_comparison_plot(results, out / "summary.png")
    print(f"wrote {out}/summary.json, summary.png and losses.md ({summary['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
