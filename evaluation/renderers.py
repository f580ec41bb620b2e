"""The figures blocks' renderers: one function per results file (docs/results/NAME.json ->
the markdown between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->`), registered in
evaluation/figures.py's `RENDER`, which publishes and checks them; the loop's and the
race's are in render_races.py."""

from __future__ import annotations

DEMO_NAMES = {
    "trained": "trained",
    "untrained": "untrained",
    "ngram": "n-gram (prompt lookup)",
}


def cell(value: float, ci: list[float] | None, bold: bool = False) -> str:
    text = f"**{value:.3f}**" if bold else f"{value:.3f}"
    return text + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def above(ci: list[float] | None, other: list[float] | None) -> bool:
    """An interval lies wholly above another."""
    return bool(ci and other and ci[0] > other[1])


def source_line(res: dict, name: str) -> str:
    p = res["provenance"]
    return (
        f"Measured by `{p['command']}` on a {p['machine']}, {p['date']}, commit {p['commit']} "
        f"([docs/results/{name}.json](docs/results/{name}.json)).\n"
    )


def drafters_table(res: dict, intro: str) -> tuple[list[str], str]:
    """The table of the trained, untrained and n-gram drafters (overall and per workload,
    95% intervals; bold where the interval lies wholly above the n-gram drafter's) after
    `intro`, and the sentence of what it shows (separation, positions, losslessness)."""
    workloads = list(res["trained"]["workloads"])
    ngram = res["ngram"]
    lines = [intro, "| drafter | overall | " + " | ".join(workloads) + " |",
             "|---" * (len(workloads) + 2) + "|"]  # fmt: skip
    for key, label in DEMO_NAMES.items():
        r = res[key]
        bold = key != "ngram" and above(r["accept_length_ci"], ngram["accept_length_ci"])
        cells = [cell(r["accept_length"], r["accept_length_ci"], bold)]
        for w in workloads:
            c, n = r["workloads"][w], ngram["workloads"][w]
            bold = key != "ngram" and above(c["accept_length_ci"], n["accept_length_ci"])
            cells.append(cell(c["accept_length"], c["accept_length_ci"], bold))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    trained = res["trained"]
    t_w, n_w = trained["workloads"], ngram["workloads"]
    separated = [
        w for w in workloads if above(t_w[w]["accept_length_ci"], n_w[w]["accept_length_ci"])
    ]
    positions = zip(trained["per_position"], ngram["per_position"], strict=True)
    higher = sum(t > n for t, n in positions)
    lossless = all(v["lossless"] for k in DEMO_NAMES for v in res[k]["workloads"].values())
    shows = (
        f"Bold: the interval lies wholly above the n-gram drafter's. The trained drafter is "
        f"separated from the n-gram drafter on {len(separated)} of {len(workloads)} workloads"
        + (f" ({', '.join(separated)})" if separated else "")
        + f" and accepts more at {higher} of {len(trained['per_position'])} draft positions; "
        + ("every generation was lossless. " if lossless else "NOT every generation was lossless. ")
    )
    return lines, shows


def render_demo(res: dict) -> str:
    """The demo's drafters table and what it shows, from runs/demo/summary.json."""
    intro = (
        f"Accept length (committed tokens per verify step) on held-out prompts, "
        f"{res['num_prompts']} per workload, {res['max_new_tokens']} new tokens, with 95% "
        "bootstrap intervals over prompts. " + source_line(res, "demo")
    )
    lines, shows = drafters_table(res, intro)
    lines += [
        "",
        shows + f"The run took {res['seconds'] / 60:.1f} min once installed "
        f"(target build, regeneration, training, evaluation: "
        + ", ".join(f"{v:.0f} s" for v in res["split_seconds"].values())
        + ").",
    ]
    return "\n".join(lines) + "\n"


def _real_intro(res: dict) -> str:
    t, tr = res["target"], res["training"]
    return (
        f"Accept length on SmolLM2-135M-Instruct ({t['package']} {t['version']}: "
        f"{t['weights']}), held-out prompts, {res['num_prompts']} per workload, "
        f"{res['max_new_tokens']} new tokens, 95% bootstrap intervals over prompts; the drafter "
        f"trained {tr['steps']} steps x 2 ranks online from SGLang's CPU engine on the "
        f"target's own answers to {tr['rows']} prompts. " + source_line(res, "real")
    )


def render_real_brief(res: dict) -> str:
    """The README's block of `make real`: the drafters table and what it shows."""
    lines, shows = drafters_table(res, _real_intro(res))
    judged = res["sglang"].values()
    agree = "exactly as" if all(s["agree"] for s in judged) else "NOT as"
    names = " and ".join(res["sglang"])
    lines += ["", shows + f"SGLang DSPARK decoded the {names} exports {agree} our harness "
              "(the first prompts of each workload); paired differences, time: "
              "[docs/real.md](docs/real.md#make-real)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def render_real(res: dict) -> str:
    """`make real` (runs/real/summary.json): the drafters table on the real target, the
    paired differences, what SGLang DSPARK served beside our harness, and the run's time."""
    lines, shows = drafters_table(res, _real_intro(res))
    workloads = list(res["trained"]["workloads"])
    pairs = {(p["a"], p["b"], p["workload"]): p for p in res["paired"]}
    lines += ["", "| paired, same prompts | overall | " + " | ".join(workloads) + " |",
              "|---" * (len(workloads) + 2) + "|"]  # fmt: skip
    for a, b in (("trained", "ngram"), ("trained", "untrained")):
        cells = []
        for w in ["overall", *workloads]:
            d = pairs[(a, b, w)]
            text = f"{d['difference']:+.3f} [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]"
            cells.append(f"**{text}**" if d["ci"][0] > 0 else text)
        lines.append(f"| {a} - {DEMO_NAMES[b]} | " + " | ".join(cells) + " |")
    judged = "; ".join(
        f"{name}: {s['num_prompts']} prompts, agree {s['agree']}, accept length SGLang "
        f"{s['sglang_accept_length']:.3f}, harness {s['harness_accept_length']:.3f}"
        for name, s in res["sglang"].items()
    )
    lines += [
        "",
        shows + "Bold difference: its paired interval lies above 0. SGLang DSPARK served each "
        f"export on the first {res['judge_prompts']} prompts of every workload beside our "
        f"harness (tokens, verify steps, accepted-draft histograms): {judged}. The run took "
        f"{res['seconds'] / 60:.1f} min once installed ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in res["split_seconds"].items())
        + ").",
    ]
    return "\n".join(lines) + "\n"


def render_bakeoff(res: dict) -> str:
    """The bake-off's table from runs/bakeoff/summary.json: per drafter its settings (each
    difference between rows a named column) and accept length per workload."""
    kinds, settings = res["kinds"], res.get("settings", {})
    workloads = list(next(iter(kinds.values()))["workloads"])
    columns = ("kind", "block", "l1_weight", "slot_weighting", "divergence", "window", "selector")
    shown = [c for c in columns if len({str(s.get(c)) for s in settings.values()}) > 1]
    lines = [
        f"Accept length on held-out prompts, {res['num_prompts']} per workload, "
        f"{res['max_new_tokens']} new tokens, 95% intervals; draft MFLOP and milliseconds "
        "(this CPU) per served verify step, context keys and values cached. "
        + source_line(res, "bakeoff"),
        "| drafter | " + " | ".join([*shown, *workloads]) + " | MFLOP / step | ms / step |",
        "|---" * (len(shown) + len(workloads) + 3) + "|",
    ]
    for name, k in kinds.items():
        label = "n-gram" if name == "ngram" else name
        setting = [str(settings.get(name, {}).get(c, "")).replace("None", "-") for c in shown]
        cells = [cell(k["workloads"][w]["accept_length"], k["workloads"][w]["accept_length_ci"])
                 for w in workloads]  # fmt: skip
        ms = k.get("draft_ms_per_step")
        cost = [f"{k['flops_per_step'] / 1e6:.1f}", "-" if ms is None else f"{ms:.2f}"]
        row = " | ".join([label, *setting, *cells, *cost])
        lines.append(f"| {row} |")
    lines += _bakeoff_pairs(res, shown)
    return "\n".join(lines) + "\n"


def _bakeoff_pairs(res: dict, shown: list[str]) -> list[str]:
    """The paired comparisons that answer one question each: every two drafters that
    differ in one setting (a block size, the selector, an objective), and the leader
    (highest overall) against every other drafter."""
    paired = {(r["a"], r["b"], r["workload"]): r for r in res.get("paired", [])}
    if not paired:
        return []

    def pair(a: str, b: str, w: str) -> dict | None:
        if (a, b, w) in paired:
            return paired[a, b, w]
        r = paired.get((b, a, w))
        if r is None:
            return None
        return {**r, "difference": -r["difference"], "ci": [-r["ci"][1], -r["ci"][0]]}

    settings, kinds = res.get("settings", {}), res["kinds"]
    names = list(kinds)

    def overall(n: str) -> float:
        k = kinds[n]
        return k["workloads"].get("overall", {}).get("accept_length", 0.0)

    def differs(a: str, b: str) -> list[str]:
        sa, sb = settings.get(a, {}), settings.get(b, {})
        return [c for c in shown if str(sa.get(c)) != str(sb.get(c))]

    leader = max((n for n in names if n != "ngram"), key=overall)
    chosen = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]
              if "ngram" not in (a, b) and len(differs(a, b)) == 1]  # fmt: skip
    chosen += [(leader, b) for b in names if b != leader and (leader, b) not in chosen
               and (b, leader) not in chosen]  # fmt: skip
    workloads = [w for w in next(iter(kinds.values()))["workloads"] if w != "overall"]
    label = {n: "n-gram" if n == "ngram" else n for n in names}
    lines = [
        "",
        f"Paired on the same prompts: a - b overall with its 95% interval; better only where "
        f"the interval excludes 0; the workloads where each side is better. Pairs: every two "
        f"drafters that differ in one setting, and the leader ({label[leader]}) against "
        "every other drafter.",
        "",
        "| a | b | differs in | a - b overall | better | workloads a better | workloads b better |",
        "|---|---|---|---|---|---|---|",
    ]
    for a, b in chosen:
        r = pair(a, b, "overall")
        if r is None:
            continue
        per = {w: pair(a, b, w) for w in workloads}
        wins = [[w for w, x in per.items() if x and x["better"] == side] for side in (a, b)]
        what = ", ".join(differs(a, b)) or "-"
        better = label[r["better"]] if r["better"] else "-"
        interval = f"{r['difference']:+.3f} [{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}]"
        won = [", ".join(x) or "-" for x in wins]
        cells = [label[a], label[b], what, interval, better, *won]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_quality(res: dict) -> str:
    """The learning curve's table from runs/quality/summary.json."""
    first = res["budgets"][0]["workloads"]
    workloads = list(first)
    lines = [
        f"DSpark accept length after each training budget, {res['num_prompts']} held-out "
        "prompts per workload, 95% intervals; bold where the interval lies wholly above the "
        "n-gram drafter's. " + source_line(res, "quality"),
        "| steps | " + " | ".join(workloads) + " |",
        "|---" * (len(workloads) + 1) + "|",
    ]
    for b in res["budgets"]:
        cells = [
            cell(b["workloads"][w]["accept_length"], b["workloads"][w]["accept_length_ci"],
                  b["workloads"][w]["separated"]) for w in workloads
        ]  # fmt: skip
        lines.append(f"| {b['steps']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
