"""Served requests, journaled exactly once with their provenance: the prompt, the engine's
answer (the target's own output, on-policy by construction), the engine's own acceptance
figures for that request, the drafter version that served it, the engine and the time.

A record is a `messages`-format row of the data pipeline (data_pipelines.prepare reads it
with `data.format: messages`; its `id` names the request), plus:
  served: {"completion_tokens", "verify_ct", "accepted_hist"}  (SGLang's meta_info:
          completion_tokens, spec_verify_ct, spec_correct_drafts_histogram; vLLM's
          metrics.speculative_decoding: num_spec_steps, acceptance_histogram)
  drafter, engine, workload, time
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from specforge_dspark.decoding.profile import acceptance_by_position


def served_figures(meta_info: dict[str, Any]) -> dict[str, Any]:
    """The acceptance figures of one request from SGLang's `meta_info`."""
    return {
        "completion_tokens": int(meta_info["completion_tokens"]),
        "verify_ct": int(meta_info.get("spec_verify_ct", 0)),
        "accepted_hist": list(meta_info.get("spec_correct_drafts_histogram") or []),
    }


def vllm_served_figures(output_ids: list[int], spec: dict[str, Any]) -> dict[str, Any]:
    """The same figures from vLLM's `metrics.speculative_decoding` of one response: its
    verify steps and its histogram of steps by drafts accepted (SGLang's meaning)."""
    return {
        "completion_tokens": len(output_ids),
        "verify_ct": int(spec["num_spec_steps"]),
        "accepted_hist": list(spec["acceptance_histogram"]),
    }


def served_accept_length(row: dict) -> float | None:
    """Committed tokens per verify step of a recorded request, as evaluation.serve_check
    pools it: (completion_tokens - 1) / verify_ct (the prefill makes the first token)."""
    s = row["served"]
    return (s["completion_tokens"] - 1) / s["verify_ct"] if s["verify_ct"] else None


def reached(figures: dict[str, Any], k: int) -> tuple[int, int]:
    """(verify steps of one request's figures that accepted at least k drafts, its verify
    steps): its marginal acceptance at draft position k as a unit of paired intervals."""
    hist = figures["accepted_hist"]
    return sum(hist[k:]), sum(hist)


def position_score(figures: dict[str, Any], weights: list[float]) -> float | None:
    """A request's marginal acceptance per draft position (1-based k: weights[k - 1])
    averaged with `weights`; None without verify steps."""
    steps = sum(figures["accepted_hist"])
    if not steps:
        return None
    weighted = sum(w * reached(figures, k)[0] for k, w in enumerate(weights, 1))
    return weighted / (steps * sum(weights))


def pooled_acceptance(figures: list[dict[str, Any]], drafts: int) -> list[float | None]:
    """Marginal acceptance per draft position of requests' served figures pooled: the
    share of their verify steps that accepted at least k + 1 drafts (index k)."""
    total = [0] * (drafts + 1)
    for f in figures:
        for j, count in enumerate(f["accepted_hist"][: drafts + 1]):
            total[j] += count
    return acceptance_by_position(total, drafts)["marginal_acceptance"]


def record(
    request_id: str,
    messages: list[dict],
    answer: str,
    served: dict[str, Any],
    drafter: str,
    engine: str,
    workload: str = "",
) -> dict[str, Any]:
    """One served request as a training row (the answer as the assistant's last turn)."""
    if not messages or messages[-1].get("role") != "user":
        raise ValueError(f"request {request_id}: the prompt must end with a user turn")
    return {
        "id": request_id,
        "messages": [*messages, {"role": "assistant", "content": answer}],
        "served": served,
        "drafter": drafter,
        "engine": engine,
        "workload": workload,
        "time": round(time.time(), 3),
    }


class Journal:
    """An append-only jsonl of records (one writer: the recorder). A request id is
    journaled once: appending it again is refused (returns False), so a resent request is
    never trained on twice; a line a kill left half-written is dropped when the journal is
    opened again."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch(exist_ok=True)
        with self.path.open("rb+") as f:  # a tail a kill left half-written is dropped
            data = f.read()
            f.truncate(data.rfind(b"\n") + 1)
        self.ids = {row["id"] for row in self.rows()}

    def rows(self) -> list[dict[str, Any]]:
        with self.path.open() as f:
            return [json.loads(line) for line in f if line.endswith("\n")]

    def append(self, row: dict[str, Any]) -> bool:
        if row["id"] in self.ids:
            return False
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.ids.add(row["id"])
        return True
