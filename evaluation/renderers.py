"""The figures blocks' renderers: one function per results file (docs/results/NAME.json ->
the markdown between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->`), in `RENDER`.
evaluation/figures.py publishes and checks them."""

from __future__ import annotations

DEMO_NAMES = {
    "trained": "trained",
    "untrained": "untrained",
    "ngram": "n-gram (prompt lookup)",
}


def _cell(value: float, ci: list[float] | None, bold: bool = False) -> str:
    text = f"**{value:.3f}**" if bold else f"{value:.3f}"
    return text + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def _above(ci: list[float] | None, other: list[float] | None) -> bool:
    """An interval lies wholly above another."""
    return bool(ci and other and ci[0] > other[1])


def _source_line(res: dict, name: str) -> str:
    p = res["provenance"]
    return (
        f"Measured by `{p['command']}` on a {p['machine']}, {p['date']}, commit {p['commit']} "
        f"([docs/results/{name}.json](docs/results/{name}.json)).\n"
    )


def render_demo(res: dict) -> str:
    """The demo's table (trained, untrained, n-gram; overall and per workload, 95%
    intervals; bold where the interval lies wholly above the n-gram drafter's) and what it
    shows, from runs/demo/summary.json."""
    workloads = list(res["trained"]["workloads"])
    ngram = res["ngram"]
    lines = [
        f"Accept length (committed tokens per verify step) on held-out prompts, "
        f"{res['num_prompts']} per workload, {res['max_new_tokens']} new tokens, with 95% "
        "bootstrap intervals over prompts. " + _source_line(res, "demo"),
        "| drafter | overall | " + " | ".join(workloads) + " |",
        "|---" * (len(workloads) + 2) + "|",
    ]
    for key, label in DEMO_NAMES.items():
        r = res[key]
        bold = key != "ngram" and _above(r["accept_length_ci"], ngram["accept_length_ci"])
        cells = [_cell(r["accept_length"], r["accept_length_ci"], bold)]
        for w in workloads:
            c, n = r["workloads"][w], ngram["workloads"][w]
            bold = key != "ngram" and _above(c["accept_length_ci"], n["accept_length_ci"])
            cells.append(_cell(c["accept_length"], c["accept_length_ci"], bold))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    trained = res["trained"]
    t_w, n_w = trained["workloads"], ngram["workloads"]
    above = [w for w in workloads if _above(t_w[w]["accept_length_ci"], n_w[w]["accept_length_ci"])]
    positions = zip(trained["per_position"], ngram["per_position"], strict=True)
    higher = sum(t > n for t, n in positions)
    lossless = all(v["lossless"] for k in DEMO_NAMES for v in res[k]["workloads"].values())
    lines += [
        "",
        f"Bold: the interval lies wholly above the n-gram drafter's. The trained drafter is "
        f"separated from the n-gram drafter on {len(above)} of {len(workloads)} workloads"
        + (f" ({', '.join(above)})" if above else "")
        + f" and accepts more at {higher} of {len(trained['per_position'])} draft positions; "
        + ("every generation was lossless. " if lossless else "NOT every generation was lossless. ")
        + f"The run took {res['seconds'] / 60:.1f} min once installed "
        f"(target build, regeneration, training, evaluation: "
        + ", ".join(f"{v:.0f} s" for v in res["split_seconds"].values())
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
        + _source_line(res, "bakeoff"),
        "| drafter | " + " | ".join([*shown, *workloads]) + " | MFLOP / step | ms / step |",
        "|---" * (len(shown) + len(workloads) + 3) + "|",
    ]
    for name, k in kinds.items():
        label = "n-gram" if name == "ngram" else name
        setting = [str(settings.get(name, {}).get(c, "")).replace("None", "-") for c in shown]
        cells = [_cell(k["workloads"][w]["accept_length"], k["workloads"][w]["accept_length_ci"])
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
        "n-gram drafter's. " + _source_line(res, "quality"),
        "| steps | " + " | ".join(workloads) + " |",
        "|---" * (len(workloads) + 1) + "|",
    ]
    for b in res["budgets"]:
        cells = [
            _cell(b["workloads"][w]["accept_length"], b["workloads"][w]["accept_length_ci"],
                  b["workloads"][w]["separated"]) for w in workloads
        ]  # fmt: skip
        lines.append(f"| {b['steps']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_drift(res: dict) -> str:
    """The quantized target's drift and the two drafters on it, from runs/drift/summary.json."""
    q = res["quant"]
    lines = [
        f"The tiny target against its {q} copy (top-1 agreement, KL per token on the original's "
        "answers), and accept length on the copy of drafter (a), trained from the original, "
        f"and (b), trained online from the copy (same data, steps, seed); {res['num_prompts']} "
        "prompts per workload, 95% intervals, (b) - (a) paired on the same prompts. "
        + _source_line(res, "drift"),
        f"| workload | top-1 agreement | KL (nats/token) | (a) on {q} | (b) on {q} | (b) - (a) "
        "| (a) on the original |",
        "|---|---|---|---|---|---|---|",
    ]
    a, b, full = res["on_quant"]["a"], res["on_quant"]["b"], res["a_on_full"]

    def al(x: dict, w: str) -> str:  # a drafter's accept length on workload w, or overall
        f = x if w == "overall" else x["workloads"][w]
        return _cell(f["accept_length"], f["accept_length_ci"])

    for w in [w for w in [*res["targets"], "overall"] if w in res["b_minus_a_on_quant"]]:
        t, d = res["targets"].get(w), res["b_minus_a_on_quant"][w]
        cells = [f"{t['top1_agreement']:.4f}", f"{t['kl_a_b']:.5f}"] if t else ["", ""]
        diff = f"{d['difference']:+.3f} [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]"
        lines.append(
            f"| {w} | " + " | ".join([*cells, al(a, w), al(b, w), diff, al(full, w)]) + " |"
        )
    return "\n".join(lines) + "\n"


LOOP_NAMES = {"loop": "loop", "loop_positions": "loop, mined by position"}


def render_loop(res: dict, name: str = "loop") -> str:
    """The closed loop on shifted traffic, from runs/loop/summary.json (runs/loop_vllm/: the
    same with vLLM, `name` loop_vllm)."""
    st = res["settings"]
    engine = {"sglang": "SGLang", "vllm": "vLLM"}[st.get("engine", "sglang")]
    first = next(iter(res["table"].values()))
    names = [n for n in first if n not in ("requests", "base")]
    head = "".join(f" {LOOP_NAMES.get(n, n)} | {LOOP_NAMES.get(n, n)} - base |" for n in names)
    lines = [
        f"{engine}'s accept length (95% intervals; each paired against the base on the same "
        f"requests) of the base drafter, the control (the base trained "
        f"{st['rounds'] * st['steps_per_round']} more steps on its original mix) and the "
        f"loop's serving drafter after {st['rounds']} rounds of {st['requests_per_round']} "
        f"requests; every answer the target's own: {res['lossless']}. " + _source_line(res, name),
        "| requests | n | base |" + head,
        "|---|---|---|" + "---|---|" * len(names),
    ]
    for group, row in res["table"].items():
        cells = [
            group,
            str(row["requests"]),
            _cell(row["base"]["accept_length"], row["base"]["ci"]),
        ]
        for name in names:
            d = row[name]["minus_base"]
            cells.append(_cell(row[name]["accept_length"], row[name]["ci"]))
            cells.append(f"{d['difference']:+.3f} [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]")
        lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines) + "\n"
    for group, row in res["table"].items():
        d = row.get("loop_positions", {}).get("minus_loop")
        if d:
            out += (f"\nloop, mined by position - loop ({group}, paired): {d['difference']:+.3f} "
                    f"[{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}].\n")  # fmt: skip
    for name in (n for n in names if n.startswith("loop") and "positions" in first[n]):
        p = first[name]["positions"]  # per draft position, on the first group (held out)
        gains = ", ".join(
            f"{k} {g['difference']:+.3f} [{g['ci'][0]:+.2f}, {g['ci'][1]:+.2f}]"
            for k, g in enumerate(p["paired_gain"], 1)
        )
        out += (f"\n{LOOP_NAMES.get(name, name)} - base, marginal acceptance per draft position "
                f"({next(iter(res['table']))}): {gains}; improved at {p['improved'] or 'none'}, "
                f"worse at {p['worse'] or 'none'}.\n")  # fmt: skip
    for name, v in res.get("variants", {"loop": {"rounds": res["rounds"]}}).items():
        rounds = "; ".join(
            f"round {r['round']}: {'promoted' if r['promoted'] else 'kept'} "
            f"({sum(r['seconds'].values()):.0f} s: "
            + ", ".join(f"{k} {v:.0f}" for k, v in r["seconds"].items())
            + ")"
            for r in v["rounds"]
        )
        out += f"\n{LOOP_NAMES.get(name, name)}: {rounds}.\n"
    s = res.get("stream")
    if s:
        out += (
            f"\nOther users' requests through the loop's address while it ran "
            f"({LOOP_NAMES['loop']}): {s['requests']} sent, {s['answered']} answered, "
            f"**{s['failed']} failed or dropped**; {s['started_during_a_swap']} started during "
            f"its {s['swaps']} swap phases, {s['in_flight_across_a_swap_edge']} in flight "
            f"across a swap's start or end; each prompt answered the same every time: "
            f"{s['same_answer_to_each_prompt']}.\n"
        )
    return out


RENDER = {"demo": render_demo, "bakeoff": render_bakeoff, "quality": render_quality}
RENDER["drift"] = render_drift
RENDER["loop"] = render_loop
RENDER["loop_vllm"] = lambda res: render_loop(res, "loop_vllm")


def _signed(d: dict) -> str:
    text = f"{d['difference']:+.3f} [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]"
    return f"**{text}**" if d["ci"][0] > 0 else text


def render_incumbent(res: dict) -> str:
    """Ours against SpecForge's trainer (runs/incumbent/summary.json): each side pooled
    over its seeds, then each variant of ours minus SpecForge paired on the same prompts
    (bold where the interval lies above 0), seed by seed, and seconds per step."""
    sides = res["sides"]
    workloads = [w for w in sides["specforge"] if w != "overall"]
    seeds = ", ".join(map(str, res["seeds"]))
    lines = [
        f"Accept length on the demo's held-out prompts ({res['num_prompts']} per workload, "
        f"{res['max_new_tokens']} new tokens), each side trained {res['steps']} steps x 2 "
        f"ranks with seeds {seeds} and pooled over them, 95% intervals. "
        + _source_line(res, "incumbent"),
        "| trainer | overall | " + " | ".join(workloads) + " |",
        "|---" * (len(workloads) + 2) + "|",
    ]
    for name, s in sides.items():
        cells = [
            _cell(s[w]["accept_length"], s[w]["accept_length_ci"]) for w in ["overall", *workloads]
        ]
        label = "SpecForge 0.2.0" if name == "specforge" else f"ours: {name}"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    head = "| ours minus SpecForge, paired | overall | " + " | ".join(workloads)
    lines += ["", head + " | by seed |", "|---" * (len(workloads) + 3) + "|"]
    step_s = res["seconds_per_step"]
    for v, p in res["paired"].items():
        by_seed = ", ".join(f"{d['difference']:+.2f}" for d in p["by_seed"].values())
        cells = [_signed(p["pooled"][w]) for w in ["overall", *workloads]]
        lines.append(f"| {v} ({', '.join(res['variants'][v]) or 'the demo recipe'}) | "
                     + " | ".join(cells) + f" | {by_seed} |")  # fmt: skip
    first = {v: p["demo_prompts"] for v, p in res["paired"].items() if "demo_prompts" in p}
    if first:
        n = res["demo_prompts"]
        lines += ["", f"| the same on the first {n} prompts of each (the demo's evaluation) | "
                  "overall | " + " | ".join(workloads) + " |",
                  "|---" * (len(workloads) + 2) + "|"]  # fmt: skip
        for v, p in first.items():
            cells = [_signed(p[w]) for w in ["overall", *workloads]]
            lines.append(f"| {v} | " + " | ".join(cells) + " |")

    if res.get("alone"):
        lines += ["", "| change, measured alone | against | overall, paired |", "|---|---|---|"]
        for v, d in res["alone"].items():
            what = ", ".join(res["variants"][v])
            lines.append(f"| {v} ({what}) | {d['against']} | {_signed(d)} |")

    reexported = {v for v, c in res["variants"].items() if c and c[0].startswith("base re-")}

    def mean_step(prefix: str) -> str:
        vals = [t for n, t in step_s.items() if n.rsplit("_s", 1)[0] == prefix]
        return f"{sum(vals) / len(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})"

    lines += [
        "",
        "Bold: the paired interval lies wholly above 0. Seconds per step (wall clock of each "
        "run, start-up included, / steps; mean and range over the seeds): SpecForge offline "
        f"{mean_step('specforge')}; ours online from the live target "
        + ", ".join(f"{v} {mean_step(v)}" for v in res["paired"] if v not in reexported)
        + ".",
    ]
    if res.get("extras"):
        costs = ", ".join(f"{k} {e['cost_per_step']:+.4f} s" for k, e in res["extras"].items())
        lines.append(f"Each extra of the demo's run alone on markov_keep (seed 0), its cost "
                     f"per step against that run without it: {costs} (offline: the same "
                     "features read from disk, not the live target; one run each, so a "
                     "difference inside the seeds' range above is noise).")  # fmt: skip
    return "\n".join(lines) + "\n"


RENDER["incumbent"] = RENDER["incumbent_ladder"] = render_incumbent
