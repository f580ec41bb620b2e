"""Serve and record (loop step 1): send requests to the serving engine as a user's
traffic would reach it, and journal each request's prompt, the engine's answer and its own
acceptance figures (records.py). The demo's and the tests' traffic source replays a
workload's conversations; in production the same journal takes records from request logs.

SGLang's native `/generate` takes the chat-rendered token ids and returns the answer's
`output_ids` with `meta_info` (completion_tokens, spec_verify_ct,
spec_correct_drafts_histogram): the engine's own figures for that one request.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable

from specforge_dspark.decoding.prompts import (
    answer_text,
    load_conversations,
    parse_workload,
    render,
)
from specforge_dspark.engines.api_key import auth_headers
from specforge_dspark.loop.records import Journal, record, served_figures


def generate(url: str, ids: list[int], max_new_tokens: int, stop_ids: set[int],
             key: str | None = None, timeout_s: float = 600.0) -> dict:  # fmt: skip
    """One greedy `/generate` request (the target's own answer: on-policy)."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                            "stop_token_ids": sorted(stop_ids)},
    }  # fmt: skip
    headers = {"Content-Type": "application/json", **auth_headers(key)}
    req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def record_traffic(
    url: str,
    tokenizer,
    stop_ids: set[int],
    requests: Iterable[tuple[str, list[dict], str]],
    journal: Journal,
    drafter: str,
    max_new_tokens: int,
    engine: str = "sglang",
    key: str | None = None,
) -> dict[str, int]:
    """Serve every (request id, messages ending with a user turn, workload) not journaled
    yet and journal it; returns how many were recorded and how many were already there."""
    counts = {"recorded": 0, "already": 0}
    for request_id, messages, workload in requests:
        if request_id in journal.ids:  # a resumed round does not send it again
            counts["already"] += 1
            continue
        out = generate(url, render(tokenizer, messages), max_new_tokens, stop_ids, key)
        answer = answer_text(tokenizer, list(out["output_ids"]), stop_ids)
        row = record(request_id, messages, answer, served_figures(out["meta_info"]), drafter,
                     engine, workload)  # fmt: skip
        counts["recorded" if journal.append(row) else "already"] += 1
    return counts


def traffic_requests(workloads: list[str], per_round: int, rnd: int) -> list[tuple]:
    """Round `rnd`'s (request id, messages, workload): the next per_round / len(workloads)
    first-turn prompts of each workload (ids `workload:index`, the same on every resume)."""
    n = -(-per_round // len(workloads))
    out = []
    for spec in workloads:
        w = parse_workload(spec)
        for conv in load_conversations(w, (rnd + 1) * n)[rnd * n :]:
            out.append((f"{w.name}:{conv.index}", [{"role": "user", "content": conv.turns[0]}],
                        w.name))  # fmt: skip
    return out


def stop_token_ids(path: str, tokenizer) -> set[int]:
    """The target's end-of-answer token ids (its generation config, else its tokenizer)."""
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    from specforge_dspark.decoding.hf_target import eos_token_ids

    try:
        gen = GenerationConfig.from_pretrained(path)
    except OSError:
        gen = None
    model = SimpleNamespace(generation_config=gen, config=AutoConfig.from_pretrained(path))
    return eos_token_ids(model, tokenizer)
