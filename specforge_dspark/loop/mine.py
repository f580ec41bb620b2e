"""The next round's training mix from the recorded traffic (loop step 2): requests with
the lowest served accept length first, plus a replay share of the data the drafter was
trained on (so the old workloads are not forgotten). Every record is used once: the ids
trained on in earlier rounds are passed in `used`, and a fixed share of requests (chosen
by a hash of the id, so the same on every resume) is kept for the gate and never trained
on."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

from specforge_dspark.loop.records import (
    pooled_acceptance,
    position_score,
    served_accept_length,
)


def held_out(request_id: str, share: float) -> bool:
    """Whether a request belongs to the gate's held-out slice (stable across runs)."""
    h = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big")
    return h / 2**64 < share


def quantiles(values: list[float], qs=(0.1, 0.25, 0.5, 0.75, 0.9)) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    return {f"p{int(q * 100)}": round(v[min(len(v) - 1, int(q * len(v)))], 4) for q in qs}


def mine(
    traffic: list[dict[str, Any]],
    replay: list[dict[str, Any]],
    rows: int,
    replay_share: float,
    holdout_share: float,
    used: set[str],
    seed: int,
    position_weights: list[float] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the mix, a report). The mix: round(rows x (1 - replay_share)) recorded requests not
    in `used` nor held out, lowest served accept length first (with `position_weights`:
    lowest weighted acceptance per draft position; ties by id), then the replay rows drawn
    with `seed`; fewer when the traffic runs short (the report says)."""
    if not 0 <= replay_share <= 1 or rows < 1:
        raise ValueError(
            f"mine: rows {rows} must be >= 1 and replay_share {replay_share} in [0, 1]"
        )
    fresh = [r for r in traffic if r["id"] not in used and not held_out(r["id"], holdout_share)]
    scored = [(served_accept_length(r), r["id"], r) for r in fresh]
    scored = [s for s in scored if s[0] is not None]
    if position_weights:
        scored.sort(key=lambda s: (position_score(s[2]["served"], position_weights), s[1]))
    else:
        scored.sort(key=lambda s: (s[0], s[1]))
    want = round(rows * (1 - replay_share))
    drafts = max([len(s[2]["served"]["accepted_hist"]) for s in scored] or [1]) - 1
    picked = [r for _, _, r in scored[:want]]
    n_replay = min(len(replay), rows - want)
    replayed = random.Random(seed).sample(replay, n_replay)
    report = {
        "traffic_records": len(traffic),
        "not_yet_trained": len(fresh),
        "mined": len(picked),
        "replayed": n_replay,
        "short_by": max(0, want - len(picked)),
        "rank": f"position_weights {position_weights}"
        if position_weights
        else "served accept length",
        "served_accept_length": {
            "all_new_traffic": quantiles([s[0] for s in scored]),
            "mined": quantiles([served_accept_length(r) for r in picked]),
        },
        "served_acceptance_by_position": {  # marginal, per draft position, pooled
            "all_new_traffic": pooled_acceptance([s[2]["served"] for s in scored], drafts),
            "mined": pooled_acceptance([r["served"] for r in picked], drafts),
        },
    }
    return picked + replayed, report


def replay_rows(recipe, limit: int = 5000) -> list[dict]:
    """Rows of data.train_files (what the drafter learnt before) as `messages` rows."""
    from data_pipelines.formats import FormatConfig, RowError, normalize
    from data_pipelines.ingest import read_rows

    d = recipe.data
    cfg = FormatConfig(d.format, d.prompt_field, d.response_field, d.system_prompt)
    rows: list[dict] = []
    for path in d.train_files:
        for raw in read_rows(path):
            if raw.error is not None:
                continue
            try:
                conv = normalize(raw.value, cfg)
            except RowError:
                continue
            rows.append({"id": f"replay:{Path(path).name}:{raw.row}", "messages": conv.messages})
            if len(rows) >= limit:
                return rows
    return rows
