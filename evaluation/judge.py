"""What every engine's judge does alike (serve_check.py: SGLang, serve_vllm.py: vLLM): load
the harness, decode each prompt turn with it and the engine (a later turn after the
harness's own answer), write the report. Each engine says how it serves and compares."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specforge_dspark.decoding.hf_target import HFTarget
from specforge_dspark.decoding.loading import DTYPES, check_pair, head_fns, load_drafter
from specforge_dspark.decoding.prompts import load_conversations, parse_workload, render
from specforge_dspark.decoding.spec_decode import Generation, speculative_generate


@dataclass
class Harness:
    """Our side of the judgement: the drafter (an SGLang export), the target and its head."""

    drafter: Any
    target: HFTarget
    head: Any
    embed_fn: Callable
    logits_fn: Callable


def load_harness(target: str | Path, draft: str | Path, device: str, dtype: str) -> Harness:
    """The harness for `draft` (an SGLang-layout export) against `target`."""
    from specforge_dspark.objective.frozen_head import load_frozen_head

    drafter = load_drafter(draft, device, DTYPES[dtype])
    hf = HFTarget.load(target, list(drafter.config.target_layer_ids), "crop", device, DTYPES[dtype])
    check_pair(drafter, hf)
    head = load_frozen_head(target, device=device, dtype=DTYPES[dtype])
    return Harness(drafter, hf, head, *head_fns(head))


def side_by_side(
    harness: Harness,
    workloads: list[str],
    num_prompts: int,
    max_new_tokens: int,
    serve: Callable[[list[int]], Any],
    compare: Callable[[str, Generation, Any], dict],
) -> tuple[list[dict], float, float]:
    """(one row per prompt turn, harness seconds, served seconds): each turn decoded by the
    harness and by `serve(ids)`, then `compare(where, generation, served)` makes its row."""
    hf, rows, harness_s, served_s = harness.target, [], 0.0, 0.0
    for spec in workloads:
        workload = parse_workload(spec)
        for conv in load_conversations(workload, num_prompts):
            messages: list[dict] = []
            for turn, text in enumerate(conv.turns):
                messages.append({"role": "user", "content": text})
                ids = render(hf.tokenizer, messages)
                t0 = time.monotonic()
                gen = speculative_generate(
                    hf, harness.drafter, ids, max_new_tokens, harness.embed_fn, harness.logits_fn
                )
                t1 = time.monotonic()
                served = serve(ids)
                served_s, harness_s = served_s + time.monotonic() - t1, harness_s + t1 - t0
                where = f"workload {workload.name} prompt {conv.index} turn {turn + 1}"
                rows.append(compare(where, gen, served))
                body = gen.tokens[:-1] if gen.tokens[-1] in hf.eos_ids else gen.tokens
                answer = hf.tokenizer.decode(body, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": answer})
    return rows, harness_s, served_s


def write_report(
    out: Path, report: dict, explain: Callable[[dict], str], label: str, figures: str, log=print
) -> dict:
    """`report` to out/serve_check.json; to `log`, how many prompts agree (under `label`)
    with `figures`, then the first disagreeing ones. Returns the report."""
    (out / "serve_check.json").write_text(json.dumps(report, indent=1))
    rows = report["prompts"]
    disagree = [r for r in rows if not r["agree"]]
    log(f"{label}: {len(rows) - len(disagree)}/{len(rows)} prompts agree; {figures}")
    for r in disagree[:3]:
        log(explain(r))
    return report
