"""The figures blocks of the races: the closed loop (runs/loop*/summary.json) and ours
against SpecForge's trainer (runs/incumbent*/summary.json); the helpers are renderers.py's."""

from __future__ import annotations

from evaluation.renderers import cell, source_line

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
        f"requests; every answer the target's own: {res['lossless']}. " + source_line(res, name),
        "| requests | n | base |" + head,
        "|---|---|---|" + "---|---|" * len(names),
    ]
    for group, row in res["table"].items():
        cells = [
            group,
            str(row["requests"]),
            cell(row["base"]["accept_length"], row["base"]["ci"]),
        ]
        for name in names:
            d = row[name]["minus_base"]
            cells.append(cell(row[name]["accept_length"], row[name]["ci"]))
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


def _signed(d: dict) -> str:
    text = f"{d['difference']:+.3f} [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]"
    return f"**{text}**" if d["ci"][0] > 0 else text


def render_incumbent(res: dict, name: str = "incumbent") -> str:
    """Ours against SpecForge's trainer (runs/incumbent/summary.json; `name` incumbent_real:
    runs/incumbent_real/, on the real target): each side pooled over its seeds, then each
    variant of ours minus SpecForge paired on the same prompts (bold where the interval lies
    above 0), seed by seed, and seconds per step."""
    sides = res["sides"]
    workloads = [w for w in sides["specforge"] if w != "overall"]
    seeds = ", ".join(map(str, res["seeds"]))
    target = {"smollm2": "SmolLM2-135M-Instruct"}.get(res.get("target"), "the tiny Inkling")
    data = ""  # the training prompts, where the results file names them
    if res.get("training_prompts"):
        data = f" (the target's answers to {res['rows']} prompts: "
        data += ", ".join(res["training_prompts"]) + ")"
    lines = [
        f"Accept length on the demo's held-out prompts ({res['num_prompts']} per workload, "
        f"{res['max_new_tokens']} new tokens), target {target}, each side trained "
        f"{res['steps']} steps x 2 ranks with seeds {seeds} and pooled over them{data}, 95% "
        "intervals. " + source_line(res, name),
        "| trainer | overall | " + " | ".join(workloads) + " |",
        "|---" * (len(workloads) + 2) + "|",
    ]
    for name, s in sides.items():
        cells = [
            cell(s[w]["accept_length"], s[w]["accept_length_ci"]) for w in ["overall", *workloads]
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
        f"{mean_step('specforge')}; ours "
        + ", ".join(f"{v} {mean_step(v)}" for v in res["paired"] if v not in reexported)
        + (" (offline: the same features from disk" if "offline" in res["paired"] else " (")
        + ("; every other variant" if "offline" in res["paired"] else "every variant")
        + " online from the live target).",
    ]
    if res.get("extras"):
        costs = ", ".join(f"{k} {e['cost_per_step']:+.4f} s" for k, e in res["extras"].items())
        lines.append(f"Each extra of the demo's run alone on markov_keep (seed 0), its cost "
                     f"per step against that run without it: {costs} (offline: the same "
                     "features read from disk, not the live target; one run each, so a "
                     "difference inside the seeds' range above is noise).")  # fmt: skip
    return "\n".join(lines) + "\n"
