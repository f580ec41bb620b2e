"""Write an evaluation summary: summary.json, per_position.csv, report.md and PNG plots.

per_position.csv has one row per (workload, position) with `acceptance_rate` equal to
summary.json's `per_position[position]`; the row `overall` is pooled over all verify
steps (draft-weighted). Plots: per_position.png (acceptance curve per workload),
calibration.png (reliability diagram per workload), accept_length_hist.png.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specforge_dspark.decoding.spec_decode import Generation

PLOTS = ("per_position.png", "calibration.png", "accept_length_hist.png")


def _rows(summary: dict) -> list[tuple[str, dict]]:
    return [*summary["workloads"].items(), ("overall", summary["overall"])]


def write_csv(summary: dict, path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["workload", "position", "acceptance_rate", "steps"])
        for name, stats in _rows(summary):
            for k, rate in enumerate(stats["per_position"]):
                w.writerow([name, k, repr(float(rate)), stats["steps"]])


def _num(x: float | None, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def write_markdown(summary: dict, path: Path) -> None:
    G = summary["block_size"]
    lines = [
        "# DSpark acceptance evaluation",
        "",
        f"- target: `{summary['target']}`",
        f"- draft: `{summary['draft']}` (block size G = {G}, "
        f"target layers {summary['target_layer_ids']})",
        f"- {summary['num_prompts']} prompts per workload, max {summary['max_new_tokens']} "
        f"new tokens, {_decoding(summary)}, {summary['device']} {summary['dtype']}, "
        f"cache rollback `{summary['cache_mode']}`",
        "- accept length = committed tokens / verify steps (the prefill's first token is "
        "not a step; a final step cut by end-of-turn or max-new-tokens counts what it "
        "committed). `overall` pools all verify steps (draft-weighted); "
        f"macro mean over workloads: {_num(summary['macro_accept_length'])}.",
        (
            "- every output was checked equal to plain target greedy decoding (lossless)."
            if not summary.get("temperature")
            else "- speculative sampling with SGLang DSPARK's chain rejection rule: lossless "
            "in distribution (tests/test_sampling_lossless.py), not comparable per output."
        ),
        "- padded drafts = drafted tokens with id >= the logical vocabulary "
        f"({summary.get('logical_vocab')}) / all drafted tokens: the draft's argmax runs over "
        "every LM-head row, as SGLang serves it, and such a draft is always rejected.",
        "",
        "| workload | gens | tokens | steps | accept length | padded drafts | ECE | AUROC "
        "| tok/s plain | tok/s spec | speedup | lossless |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in _rows(summary):
        cal = s["calibration"]
        lines.append(
            f"| {name} | {s.get('generations', '')} | {s.get('new_tokens', '')} | {s['steps']} "
            f"| {_num(s['accept_length'])} | {_num(s.get('padded_draft_rate'), 4)} "
            f"| {_num(cal['ece'])} | {_num(cal['auroc'])} "
            f"| {_num(s.get('tokens_per_s_plain'), 1)} | {_num(s.get('tokens_per_s_spec'), 1)} "
            f"| {_num(s.get('speedup'), 2)} | {s['lossless']} |"
        )
    head = " | ".join(f"pos {k}" for k in range(G))
    lines += [
        "",
        "Per-position acceptance P(slot k accepted):",
        "",
        f"| workload | {head} |",
        "|---|" + "---|" * G,
    ]
    for name, s in _rows(summary):
        lines.append(f"| {name} | " + " | ".join(_num(r) for r in s["per_position"]) + " |")
    head = " | ".join(str(c) for c in range(1, G + 2))
    lines += [
        "",
        "Steps by tokens committed:",
        "",
        f"| workload | {head} |",
        "|---|" + "---|" * (G + 1),
    ]
    for name, s in _rows(summary):
        hist = s["accept_length_hist"]
        lines.append(f"| {name} | " + " | ".join(str(hist[str(c)]) for c in range(1, G + 2)) + " |")
    lines += _context_lines(summary)
    lines += _budget_lines(summary)
    lines += ["", "Plots: " + ", ".join(f"![{p}]({p})" for p in PLOTS), ""]
    path.write_text("\n".join(lines))


def _context_lines(summary: dict) -> list[str]:
    """Accept length by the context position a verify step drafts from (95% intervals)."""
    lines = ["", "Accept length by context position (tokens before the step):", "",
             "| workload | context | steps | accept length |", "|---|---|---|---|"]  # fmt: skip
    for name, s in _rows(summary):
        for b in s.get("by_context", []):
            span = f"{b['from']}-{b['to']}" if b["to"] is not None else f"{b['from']}+"
            ci = b["accept_length_ci"]
            interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
            lines.append(f"| {name} | {span} | {b['steps']} | {b['accept_length']:.3f}{interval} |")
    return lines


def _decoding(summary: dict) -> str:
    t = summary.get("temperature") or 0.0
    return "greedy" if t == 0 else f"sampling at temperature {t} (seed {summary.get('seed')})"


def _budget_lines(summary: dict) -> list[str]:
    if summary.get("verify_token_cost") is None:
        return []
    lines = [
        "",
        "Confidence-budgeted verification (SGLang's ragged verify budget, evaluation/budget.py; "
        f"step time 1 + {summary['verify_token_cost']} x verified tokens; STS temperatures "
        f"{summary.get('sts_temperatures')}):",
        "",
        "| workload | mode | steps | accept length | drafts verified / step "
        "| tokens / verified token |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in _rows(summary):
        for mode, row in s.get("verify_budget", {}).items():
            lines.append(
                f"| {name} | {mode} | {row['steps']} | {_num(row['accept_length'])} "
                f"| {_num(row['drafts_verified_per_step'], 2)} "
                f"| {_num(row['tokens_per_verified_token'])} |"
            )
    return lines


def write_plots(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    G = summary["block_size"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in _rows(summary):
        style = "k--" if name == "overall" else "o-"
        ax.plot(range(G), s["per_position"], style, label=f"{name} ({_num(s['accept_length'], 2)})")
    ax.set(
        xlabel="draft position k",
        ylabel="P(position k accepted)",
        ylim=(0, 1.02),
        title="Per-position acceptance (accept length)",
    )
    ax.set_xticks(range(G))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "per_position.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 5))
    curves = [(name, "o-", s["calibration"]) for name, s in _rows(summary)]
    reliability(ax, curves, "confidence sigmoid(conf_k)", "Confidence calibration")
    fig.tight_layout()
    fig.savefig(out / "calibration.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(summary["workloads"])
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        hist = summary["workloads"][name]["accept_length_hist"]
        total = max(1, sum(hist.values()))
        xs = [c + (i - (len(names) - 1) / 2) * width for c in range(1, G + 2)]
        ax.bar(xs, [hist[str(c)] / total for c in range(1, G + 2)], width, label=name)
    ax.set(
        xlabel="tokens committed per verify step",
        ylabel="fraction of steps",
        title="Accept length distribution",
    )
    ax.set_xticks(range(1, G + 2))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accept_length_hist.png", dpi=100)
    plt.close(fig)


def reliability(ax, curves: list[tuple[str, str, dict]], xlabel: str, title: str) -> None:
    """A reliability diagram on `ax`: per (name, style, calibration) the observed acceptance
    of each confidence bin (`bins`), labelled with its ECE, beside the diagonal."""
    ax.plot([0, 1], [0, 1], color="grey", lw=1)
    for name, style, cal in curves:
        if cal["bins"]:
            x, y = [b["confidence"] for b in cal["bins"]], [b["accepted"] for b in cal["bins"]]
            ax.plot(x, y, style, label=f"{name} (ECE {_num(cal['ece'], 2)})")
    ax.set(xlabel=xlabel, ylabel="observed acceptance", xlim=(0, 1), ylim=(0, 1), title=title)
    ax.legend(fontsize=8)


def write_comparison_plot(results: dict[str, dict], path: Path, baseline: str = "ngram") -> None:
    """One figure of several drafters' pooled evaluation summaries (name -> summary with
    `workloads` and `overall`, as written by `write_report` or pooled over processes):
    accept length per workload and overall with 95% intervals, and per-position acceptance
    of each drafter against `baseline`, pooled over every verify step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if baseline not in results:
        raise KeyError(f"write_comparison_plot: no '{baseline}' among {sorted(results)}")
    names = list(results)
    workloads = [*next(iter(results.values()))["workloads"], "overall"]
    fig, (bars, curve) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=[3, 2])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        rows = [results[name]["workloads"].get(w) or results[name]["overall"] for w in workloads]
        mean = [r["accept_length"] for r in rows]
        ci = [r.get("accept_length_ci") or [m, m] for r, m in zip(rows, mean, strict=True)]
        err = [[m - lo for m, (lo, _) in zip(mean, ci, strict=True)],
               [hi - m for m, (_, hi) in zip(mean, ci, strict=True)]]  # fmt: skip
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(workloads))]
        bars.bar(xs, mean, width, yerr=err, capsize=3, label=name)
    bars.set_xticks(range(len(workloads)), workloads)
    bars.set(ylabel="accept length (tokens per verify step)", title="Accept length, 95% CI")
    bars.axhline(1.0, color="grey", lw=0.8)
    bars.legend(fontsize=8)
    for name in names:
        style = "k--" if name == baseline else "o-"
        per_position = results[name]["overall"]["per_position"]
        curve.plot(range(len(per_position)), per_position, style, label=name)
        curve.set_xticks(range(len(per_position)))
    curve.set(
        xlabel="draft position k",
        ylabel="P(position k accepted)",
        ylim=(0, 1.02),
        title=f"Per-position acceptance vs {baseline} (pooled)",
    )
    curve.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(summary: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    write_csv(summary, out / "per_position.csv")
    write_markdown(summary, out / "report.md")
    write_plots(summary, out)


def write_learning_curve(budgets: list[dict], path: Path) -> None:
    """Accept length against training, per workload and overall (scripts/quality.py's
    `budgets`: steps, training_tokens, train_seconds and per workload the dspark and ngram
    accept length with its 95% interval): the top row against supervised training tokens,
    the bottom row against training wall seconds; the n-gram drafter (no training) as a
    band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    workloads = list(budgets[0]["workloads"])
    fig, axes = plt.subplots(2, len(workloads), figsize=(3.2 * len(workloads), 6), squeeze=False)
    for col, w in enumerate(workloads):
        cells = [b["workloads"][w] for b in budgets]
        mean = [c["dspark"]["accept_length"] for c in cells]
        ci = [c["dspark"]["accept_length_ci"] for c in cells]
        err = [[m - lo for m, (lo, _) in zip(mean, ci, strict=True)],
               [hi - m for m, (_, hi) in zip(mean, ci, strict=True)]]  # fmt: skip
        ngram = cells[-1]["ngram"]
        for row, (key, label) in enumerate(
            (("training_tokens", "supervised tokens trained"), ("train_seconds", "training s"))
        ):
            ax = axes[row][col]
            xs = [b[key] for b in budgets]
            ax.errorbar(xs, mean, yerr=err, fmt="o-", capsize=3, label="dspark")
            for x, m, b in zip(xs, mean, budgets, strict=True):
                ax.annotate(f"{b['steps']}", (x, m), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))  # fmt: skip
            lo, hi = ngram["accept_length_ci"]
            ax.axhspan(lo, hi, color="grey", alpha=0.25)
            ax.axhline(ngram["accept_length"], color="k", ls="--", lw=1, label="n-gram")
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set(xlabel=label, title=w if row == 0 else None)
            if col == 0:
                ax.set_ylabel("accept length")
                ax.legend(fontsize=7)
    fig.suptitle("Accept length vs training (95% CI; labels: steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def generation_record(
    workload: str, index: int, turn: int, prompt: str, gen: Generation, target
) -> dict:
    """One line of generations.jsonl: the decoded text and its verify steps."""
    return {
        "workload": workload,
        "index": index,
        "turn": turn,
        "prompt": prompt,
        "output": target.tokenizer.decode(gen.tokens, skip_special_tokens=True),
        "prompt_tokens": len(gen.prompt_ids),  # where the context starts (by_context)
        "new_tokens": len(gen.tokens),
        "verify_steps": len(gen.steps),
        "committed": sum(st.committed for st in gen.steps),
        "accepted_per_step": [st.accepted for st in gen.steps],
    }
