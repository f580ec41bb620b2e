"""The drift blocks (`make drift`, docs/results/drift.json): training online from a quantized
copy of the target, three sides with several seeds each, decoded on the copy.

`render_drift` is the overall table, one row per format (the README's block);
`render_drift_workloads` each pair seed by seed and everything per workload (docs/engines.md)."""

from __future__ import annotations

from evaluation.renderers import cell, source_line

SIDES = ("a", "b", "c")
PAIRS = ("b_minus_a", "c_minus_a", "c_minus_b")
HEAD = "| (a) | (b) | (c) | (b) - (a) | (c) - (a) | (c) - (b) |"


def signed(d: dict) -> str:
    """A paired difference and its 95% interval; bold where the interval excludes 0."""
    lo, hi = d["ci"]
    text = f"{d['difference']:+.3f} [{lo:+.2f}, {hi:+.2f}]"
    return f"**{text}**" if lo > 0 or hi < 0 else text


def _agreement(targets: dict, workloads: list[str]) -> tuple[float, float]:
    """Top-1 agreement and KL per token over `workloads`, weighted by their tokens."""
    rows = [targets[w] for w in workloads]
    n = sum(r["tokens"] for r in rows)
    top1 = sum(r["top1_agreement"] * r["tokens"] for r in rows) / n
    return top1, sum(r["kl_a_b"] * r["tokens"] for r in rows) / n


def _cells(fmt: dict, w: str) -> list[str]:
    sides = [cell(fmt["sides"][s][w]["accept_length"], fmt["sides"][s][w]["accept_length_ci"])
             for s in SIDES]  # fmt: skip
    return [*sides, *(signed(fmt["paired"][p]["pooled"][w]) for p in PAIRS)]


def _intro(res: dict) -> str:
    n = len(res["seeds"])
    orig = res["a_on_original"]["overall"]
    return (
        "The tiny target against its quantized copies (exact emulations; top-1 agreement and "
        "KL per token on the original's answers), and accept length on each copy of three "
        f"drafters, each trained online with {n} seeds ({res['steps']} steps, the demo's recipe): "
        "(a) from the original on the original's answers, (b) from the copy on the same "
        "answers, (c) from the copy on the copy's own answers. Each side pooled over its seeds, "
        f"{res['num_prompts']} prompts per workload, 95% intervals, differences paired on the "
        "same prompts (bold: the interval excludes 0); (a) on the original itself: "
        f"{cell(orig['accept_length'], orig['accept_length_ci'])}. " + source_line(res, "drift")
    )


def render_drift(res: dict) -> str:
    """Overall, one row per format (the README's block)."""
    workloads = [w for w in next(iter(res["formats"].values()))["sides"]["a"] if w != "overall"]
    lines = [
        _intro(res),
        "| format | top-1 agreement | KL (nats/token) " + HEAD,
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, fmt in res["formats"].items():
        top1, kl = _agreement(fmt["targets"], workloads)
        cells = [f"{top1:.4f}", f"{kl:.5f}", *_cells(fmt, "overall")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_drift_workloads(res: dict) -> str:
    """Each pair's overall difference seed by seed, then every side and pair per workload."""
    seeds = [str(s) for s in res["seeds"]]
    lines = [
        "Seed by seed (overall, each seed's three sides paired on the same prompts) and per "
        "workload (pooled over seeds), from the runs of the README's table; "
        + source_line(res, "drift"),
        "| format | pair, overall | " + " | ".join(f"seed {s}" for s in seeds) + " | pooled |",
        "|---|---|" + "---|" * (len(seeds) + 1),
    ]
    for name, fmt in res["formats"].items():
        for p in PAIRS:
            pair = fmt["paired"][p]
            by_seed = [signed(pair["by_seed"][s]) for s in seeds]
            label = p.replace("_minus_", ") - (")
            lines.append(f"| {name} | ({label}) | " + " | ".join(
                [*by_seed, signed(pair["pooled"]["overall"])]) + " |")  # fmt: skip
    lines += [
        "",
        "| format | workload | top-1 agreement | KL (nats/token) " + HEAD,
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, fmt in res["formats"].items():
        for w, t in fmt["targets"].items():
            agree = [f"{t['top1_agreement']:.4f}", f"{t['kl_a_b']:.5f}"]
            lines.append(f"| {name} | {w} | " + " | ".join([*agree, *_cells(fmt, w)]) + " |")
    return "\n".join(lines) + "\n"
