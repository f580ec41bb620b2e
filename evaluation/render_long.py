"""Figures blocks of `make long` (scripts/long.py; docs/results/long.json): accept length
per context bucket of the long-trained (sequence parallel) and the short-trained drafter
and the n-gram drafter, paired, and the goal of issue 58."""

from __future__ import annotations

NAMES = {"long": "long", "short": "short", "ngram": "n-gram"}


def _span(row: dict) -> str:
    k = lambda n: f"{n // 1024}K" if n else "0"  # noqa: E731
    return f"{k(row['from'])}-{k(row['to'])}" if row["to"] else f"{k(row['from'])}+"


def _al(cell: dict) -> str:
    lo, hi = cell["accept_length_ci"] or (float("nan"), float("nan"))
    return f"{cell['accept_length']:.3f} [{lo:.2f}, {hi:.2f}]"


def _diff(d: dict) -> str:
    text = f"{d['difference']:+.3f} [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]"
    return f"**{text}**" if d["ci"][0] > 0 else text


def _table(res: dict) -> list[str]:
    lines = [
        "| context | prompts | long (2K, SP 2) | short (512) | n-gram | long - short | "
        "long - n-gram |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in res["buckets"]:
        cells = [_al(row[n]) for n in ("long", "short", "ngram")]
        diffs = [_diff(row["long-short"]), _diff(row["long-ngram"])]
        lines.append(
            f"| {_span(row)} | {row['long']['prompts']} | " + " | ".join(cells + diffs) + " |"
        )
    return lines


def _intro(res: dict) -> str:
    p = res["provenance"]
    tokens = res["eval_prompt_tokens"]
    return (
        f"SmolLM2-135M-Instruct as the target; one drafter config trained {res['steps']} "
        "optimizer steps twice on its own answers: short (data.max_length 512, 2 "
        "data-parallel ranks) and long (2,048, `dist.sequence_parallel: 2`). Accept length "
        f"per context bucket on {res['eval_prompts']} long-context prompts "
        f"({min(tokens)}-{max(tokens)} tokens: documents and sessions ending in a request "
        f"that needs them), {res['max_new_tokens']} new tokens, 95% intervals, differences "
        "paired on the same prompts (bold: above 0). Measured by "
        f"`{p['command']}` on a {p['machine']}, {p['date']}, commit {p['commit']} "
        "([docs/results/long.json](docs/results/long.json))."
    )


def _goal(res: dict) -> str:
    g = res["goal"]
    held = "holds" if g["holds"] else "does NOT hold"
    sep = "is" if g["separated"] else "is NOT"
    return (
        f"Goal {'met' if g['met'] else 'NOT met'}: the long drafter's deepest bucket is "
        f"{g['deepest_over_first']:.2f}x its first (0.9x {held}); it {sep} above the short "
        f"one there (paired interval from {g['long_minus_short_deepest_ci_low']:+.3f})."
    )


def render_long_brief(res: dict) -> str:
    """The README's block: one paragraph, the first and the deepest bucket and the goal."""
    p, first, deep = res["provenance"], res["buckets"][0], res["buckets"][-1]
    cells = lambda row: ", ".join(  # noqa: E731
        f"{label} {_al(row[name])}" for name, label in NAMES.items()
    )
    return (
        f"Accept length on SmolLM2 by context position, {res['eval_prompts']} long-context "
        f"prompts, both drafters trained {res['steps']} steps: {_span(first)} {cells(first)}; "
        f"{_span(deep)} {cells(deep)}, long - short {_diff(deep['long-short'])} (paired). "
        f"{_goal(res)} Measured by `{p['command']}` on a {p['machine']}, {p['date']}, commit "
        f"{p['commit']} ([docs/results/long.json](docs/results/long.json)); the table: "
        "[docs/long_context.md](docs/long_context.md#make-long).\n"
    )


def render_long(res: dict) -> str:
    """docs/long_context.md's block: the brief one, SGLang beside our harness, the time."""
    s = res["sglang_long"]
    agree = "exactly as" if s["agree"] else "NOT as"
    judged = (
        f"SGLang DSPARK served the long-trained export on the {s['num_prompts']} longest "
        f"prompts ({', '.join(map(str, s['prompt_tokens']))} tokens) {agree} our harness "
        f"decodes it: accept length SGLang {s['sglang_accept_length']:.3f}, harness "
        f"{s['harness_accept_length']:.3f}. The run took {res['seconds'] / 60:.1f} min once "
        "installed (" + ", ".join(f"{k} {v:.0f} s" for k, v in res["split_seconds"].items()) + ")."
    )
    lines = [_intro(res), "", *_table(res), "", _goal(res), "", judged]
    return "\n".join(lines) + "\n"
