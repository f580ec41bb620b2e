"""Records from a gateway's request log: the users' own traffic as the deployment served
it, journaled like the replayed traffic (records.py), each request once.

A log is a jsonl file, one served chat completion per line, as a gateway in front of the
engine writes it:
  {"id": str, "request": {...}, "response": {...}, "drafter": str (optional)}
  request   the OpenAI chat completion request body: `messages`, ending with a user turn
  response  the engine's response body: the answer in `choices[0].message.content`,
            `usage.completion_tokens`, and the engine's own figures for the request:
            vLLM   `metrics.speculative_decoding` (server flag
                   --per-request-spec-decode-metrics): num_spec_steps, acceptance_histogram
            SGLang `sglext.spec_tokens_details` (request field
                   "return_spec_tokens_details": true): spec_verify_ct,
                   spec_correct_drafts_histogram
  drafter   the loop's version that served it ("v3"); the serving version when absent

A last line without its newline is a line the gateway is still writing: it is left for
the next read. A malformed line stops the read with its file, line and key named; the lines
before it are journaled (a rerun journals none of them twice).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specforge_dspark.loop.records import Journal, record


def _figures(response: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(engine, the request's served figures) from one response body."""
    completion = int(response["usage"]["completion_tokens"])
    spec = (response.get("metrics") or {}).get("speculative_decoding")
    if spec is not None:
        verify, hist, engine = spec["num_spec_steps"], spec["acceptance_histogram"], "vllm"
    else:
        details = (response.get("sglext") or {}).get("spec_tokens_details")
        if isinstance(details, list):  # n > 1: one entry per choice; the log keeps choice 0
            details = details[0] if details else None
        if details is None:
            raise KeyError(
                "metrics.speculative_decoding (vLLM: --per-request-spec-decode-metrics) or "
                "sglext.spec_tokens_details (SGLang: request return_spec_tokens_details=true)"
            )
        verify, hist = details["spec_verify_ct"], details["spec_correct_drafts_histogram"]
        engine = "sglang"
    return engine, {"completion_tokens": completion, "verify_ct": int(verify),
                    "accepted_hist": list(hist)}  # fmt: skip


def log_record(line: dict[str, Any], serving: str) -> dict[str, Any]:
    """One logged exchange as a record (records.record), `serving` its drafter by default."""
    response = line["response"]
    engine, served = _figures(response)
    answer = response["choices"][0]["message"]["content"]
    row = record(str(line["id"]), line["request"]["messages"], answer, served,
                 line.get("drafter") or serving, engine, "log")  # fmt: skip
    if line.get("time") is not None:
        row["time"] = float(line["time"])
    return row


def ingest_logs(paths: list[str], journal: Journal, serving: str) -> dict[str, int]:
    """Journal every complete line of the logs `paths` not journaled yet; returns how many
    were recorded and how many were already there."""
    counts = {"recorded": 0, "already": 0}
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(f"loop.request_logs: cannot read {path}: {e}") from e
        for n, raw in enumerate(text.splitlines(keepends=True), 1):
            if not raw.endswith("\n") or not raw.strip():
                continue  # still being written, or blank
            try:
                row = log_record(json.loads(raw), serving)
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
                what = f"missing {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
                raise ValueError(
                    f"{path}:{n}: not a logged chat completion ({what}); the format is in "
                    "specforge_dspark/loop/logs.py"
                ) from e
            counts["recorded" if journal.append(row) else "already"] += 1
    return counts
