"""Serve and record (loop step 1): send requests to the serving engine as a user's
traffic would reach it, and journal each request's prompt, the engine's answer and its own
acceptance figures (records.py). The demo's and the tests' traffic source replays a
workload's conversations; in production the same journal takes records from request logs.

The engines (`ENGINES`, recipe key loop.engine) each take the chat-rendered token ids and
return the answer's ids with their own figures for that one request: SGLang's native
`/generate` in `meta_info` (completion_tokens, spec_verify_ct,
spec_correct_drafts_histogram), vLLM's `/v1/completions` in `metrics.speculative_decoding`
(with --per-request-spec-decode-metrics: num_spec_steps, acceptance_histogram).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from specforge_dspark.decoding.prompts import (
    answer_text,
    load_conversations,
    parse_workload,
    render,
)
from specforge_dspark.engines.api_key import auth_headers
from specforge_dspark.loop.records import Journal, record, served_figures, vllm_served_figures
from specforge_dspark.serving.sglang import start_spec_server
from specforge_dspark.serving.vllm import start_vllm_spec_server, update_draft, vllm_generate


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


def ask_sglang(url: str, ids: list[int], max_new_tokens: int, stop_ids: set[int],
               key: str | None = None) -> tuple[list[int], dict]:  # fmt: skip
    """(answer token ids, SGLang's figures for the request)."""
    out = generate(url, ids, max_new_tokens, stop_ids, key)
    return list(out["output_ids"]), served_figures(out["meta_info"])


def ask_vllm(url: str, ids: list[int], max_new_tokens: int, stop_ids: set[int],
             key: str | None = None) -> tuple[list[int], dict]:  # fmt: skip
    """(answer token ids, vLLM's figures for the request)."""
    tokens, spec = vllm_generate(url, ids, max_new_tokens, stop_ids, key)
    return tokens, vllm_served_figures(tokens, spec)


@dataclass(frozen=True)
class Engine:
    """A serving engine of the loop: how to start it on an export, which export layout it
    serves, and how to ask it one request (answer ids and its own figures)."""

    start: Callable[..., tuple]  # (target, export dir, port, log, device, dtype, python)
    ask: Callable[..., tuple[list[int], dict]]
    layout: str  # the export format it serves: export/<layout>/
    python: Callable[[Any], str]  # its interpreter, from recipe.target
    update: Callable[..., None] | None = None  # (url, export dir, version): in place


ENGINES = {
    "sglang": Engine(start_spec_server, ask_sglang, "sglang", lambda t: t.sglang.python),
    "vllm": Engine(
        start_vllm_spec_server, ask_vllm, "speculators", lambda t: t.vllm.python, update_draft
    ),  # fmt: skip
}


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
    yet through `engine` and journal it; returns how many were recorded and how many were
    already there."""
    counts = {"recorded": 0, "already": 0}
    for request_id, messages, workload in requests:
        if request_id in journal.ids:  # a resumed round does not send it again
            counts["already"] += 1
            continue
        ids = render(tokenizer, messages)
        output_ids, figures = ENGINES[engine].ask(url, ids, max_new_tokens, stop_ids, key)
        answer = answer_text(tokenizer, output_ids, stop_ids)
        row = record(request_id, messages, answer, figures, drafter, engine, workload)
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
