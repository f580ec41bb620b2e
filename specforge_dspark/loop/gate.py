"""Promotion of a candidate drafter (loop step 4) and the versions kept (lineage).

The engine decodes the held-out recorded requests with the serving drafter and with the
candidate; both give, per request, (committed tokens, verify steps). The candidate is
promoted only if its paired gain over the serving drafter (decoding/intervals.py, the
same requests resampled for both) has an interval above 0, and no workload loses more
than `forget_margin` of accept length."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specforge_dspark.decoding.intervals import paired_difference
from specforge_dspark.decoding.prompts import load_conversations, parse_workload
from specforge_dspark.loop.mine import held_out
from specforge_dspark.loop.records import pooled_acceptance, reached


@dataclass
class Decision:
    promote: bool
    why: str
    overall: dict[str, Any]
    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)


def gate(
    candidate: dict,
    serving: dict,
    workload_of: dict,
    forget_margin: float,
    level: float = 0.95,
) -> Decision:
    """`candidate`, `serving`: request -> (committed, verify steps) on the same requests;
    `workload_of`: request -> its workload."""
    overall = paired_difference(candidate, serving, level=level)
    per = {}
    for w in sorted(set(workload_of.values())):
        keys = [k for k in candidate if workload_of[k] == w]
        per[w] = paired_difference(
            {k: candidate[k] for k in keys}, {k: serving[k] for k in keys}, level=level
        )
    d, ci, n = overall["difference"], overall["ci"], overall["units"]
    gain = f"paired gain {d:+.3f} {ci} over {n} requests"
    if overall["better"] != "a":
        return Decision(False, f"{gain}: the interval does not lie above 0", overall, per)
    lost = {w: r["difference"] for w, r in per.items() if r["difference"] < -forget_margin}
    if lost:
        said = ", ".join(f"{w} {d:+.3f}" for w, d in lost.items())
        return Decision(False, f"{gain}, but {said} (forget_margin {forget_margin})", overall, per)
    return Decision(True, f"{gain}; no workload loses more than {forget_margin}", overall, per)


def gate_items(rows: list[dict], lp) -> tuple[list[tuple[str, list[dict]]], dict[str, str]]:
    """The gate's requests, (id, messages) and id -> workload: every held-out recorded
    request (`rows`: the journal's) and `lp.guard_prompts` of each `lp.guard_workloads`."""
    items, workload_of = [], {}
    for row in rows:
        if held_out(row["id"], lp.holdout_share):
            items.append((row["id"], row["messages"][:-1]))
            workload_of[row["id"]] = row["workload"]
    for spec in lp.guard_workloads:
        w = parse_workload(spec)
        for conv in load_conversations(w, lp.guard_prompts):
            rid = f"guard:{w.name}:{conv.index}"
            items.append((rid, [{"role": "user", "content": conv.turns[0]}]))
            workload_of[rid] = w.name
    return items, workload_of


def positions(serving: dict, candidate: dict, level: float = 0.95) -> dict:
    """Per draft position, each drafter's marginal acceptance pooled over the same requests
    (request -> the engine's figures with `accepted_hist`), up to the most drafts any step
    accepted; the candidate's paired gain at each position (units: a request's steps that
    reached it, its steps) and the positions (1-based) whose interval lies above 0 (improved)
    or below (worse)."""
    figs = [f for d in (serving, candidate) for f in d.values()]
    drafts = max([len(f["accepted_hist"]) for f in figs] or [1]) - 1
    s, c = (pooled_acceptance(list(d.values()), drafts) for d in (serving, candidate))
    gain = [
        paired_difference(*({r: reached(f, k) for r, f in d.items()} for d in (candidate, serving)),
                          level=level)
        for k in range(1, drafts + 1)
    ]  # fmt: skip
    return {
        "serving": s, "candidate": c, "paired_gain": gain,
        "improved": [k for k, g in enumerate(gain, 1) if g["better"] == "a"],
        "worse": [k for k, g in enumerate(gain, 1) if g["better"] == "b"],
    }  # fmt: skip


class Lineage:
    """Every drafter version with its parent, export, gate decision and figures
    (lineage.json, rewritten whole by rename); the serving version is the newest promoted."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.versions: list[dict[str, Any]] = (
            json.loads(self.path.read_text()) if self.path.is_file() else []
        )

    def add(self, export: str, parent: int | None, decision: Decision | None, **info) -> int:
        """A new version (`info`: more figures to keep with it, e.g. its round)."""
        version = len(self.versions)
        self.versions.append({
            "version": version, "parent": parent, "export": export,
            "promoted": decision is None or decision.promote,
            "gate": None if decision is None else asdict(decision), **info,
        })  # fmt: skip
        self._write()
        return version

    def roll_back(self, version: int, why: str) -> None:
        """`version` leaves service (a served regression after its swap): no longer
        promoted, the reason kept; the newest promoted version before it serves again."""
        self.versions[version].update(promoted=False, rolled_back=why)
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.versions, indent=1))
        os.replace(tmp, self.path)

    def serving(self) -> dict[str, Any] | None:
        promoted = [v for v in self.versions if v["promoted"]]
        return promoted[-1] if promoted else None
