"""The serving engine as the judge: SGLang's own DSPARK (DSpark export) or DFLASH (DFlash
export) speculative decoding of an exported drafter, compared prompt by prompt with our
harness.

    python -m evaluation.serve_check --target T --draft EXPORT_DIR \
        --workloads gsm8k,mt_bench --num-prompts 8 --max-new-tokens 64 --out DIR

Starts `sglang.launch_server --speculative-algorithm DSPARK|DFLASH
--speculative-draft-model-path EXPORT_DIR` (the algorithm named by the export's
`architectures`, drafters.registry.kind_of_dir) for the target (SGLang's CPU engine on
CPU, in fp32 where both are exact; engines/cpu/sglang.py and its sglang_cpu_* modules have
the hooks it needs there) with `--sglang-python`, the interpreter of SGLang's own
environment (`make sglang-venv`), sends every prompt greedily, and
decodes the same prompts with decoding.spec_decode. They agree when, on every prompt,
the output tokens are equal, SGLang's verify count equals the harness's steps, and
SGLang's accepted-draft histogram equals the harness's. Accept length is pooled over
prompts the same way on both sides: sum(completion_tokens - 1) / sum(spec_verify_ct)
(the prefill's token is not a verify step's; SGLang's own `spec_accept_length` counts
it). Writes DIR/serve_check.json (`agree`, `prompts`, `sglang_accept_length`,
`harness_accept_length`); exits 0 only on agreement, and otherwise names the first
prompt that disagrees, the verify step, and both token streams.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import torch

from evaluation.judge import load_harness, side_by_side, write_report
from specforge_dspark.config.command_line import command_parser
from specforge_dspark.config.servers import SGLangServer, VLLMServer
from specforge_dspark.decoding.loading import DTYPES
from specforge_dspark.decoding.spec_decode import Generation
from specforge_dspark.drafters.registry import KINDS, kind_of_dir
from specforge_dspark.export.conventions import check_conventions
from specforge_dspark.loop.serve import generate as loop_generate
from specforge_dspark.serving.sglang import start_spec_server

STS_LOADED = "DSpark STS calibration loaded from"  # SGLang's log line (dspark_planner.py)


def generate(url: str, ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> dict:
    """One greedy /generate request; returns output_ids and the spec counters."""
    out = loop_generate(url, ids, max_new_tokens, stop_ids)
    meta = out["meta_info"]
    return {
        "tokens": list(out["output_ids"]),
        "verify_ct": int(meta.get("spec_verify_ct", 0)),
        "accepted_hist": list(meta.get("spec_correct_drafts_histogram") or []),
        "completion_tokens": int(meta["completion_tokens"]),
    }


def harness_hist(gen: Generation) -> list[int]:
    """Verify steps by accepted-draft count, as SGLang's spec_correct_drafts_histogram."""
    counts = Counter(s.accepted for s in gen.steps)
    return [counts.get(k, 0) for k in range(max(counts, default=-1) + 1)]


def _trim(hist: list[int]) -> list[int]:
    while hist and hist[-1] == 0:
        hist = hist[:-1]
    return hist


def compare(where: str, gen: Generation, served: dict) -> dict:
    """One prompt's verdict: equal tokens, verify counts and accepted-draft histograms."""
    ours, theirs = gen.tokens, served["tokens"]
    row = {
        "prompt": where,
        "tokens_equal": ours == theirs,
        "harness_steps": len(gen.steps),
        "sglang_verify_ct": served["verify_ct"],
        "harness_hist": harness_hist(gen),
        "sglang_hist": served["accepted_hist"],
        "new_tokens": len(ours),
    }
    row["agree"] = (
        row["tokens_equal"]
        and row["harness_steps"] == row["sglang_verify_ct"]
        and _trim(row["harness_hist"]) == _trim(row["sglang_hist"])
    )
    if not row["tokens_equal"]:
        i = next((j for j, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        i = min(len(ours), len(theirs)) if i is None else i
        made, step = 1, 0  # the prefill makes token 0; step s makes the next `committed`
        while step < len(gen.steps) and made + gen.steps[step].committed <= i:
            made += gen.steps[step].committed
            step += 1
        row["first_difference"] = {"token": i, "verify_step": step}
    if not row["agree"]:
        row["harness_tokens"], row["sglang_tokens"] = ours, theirs
    return row


def explain(row: dict) -> str:
    d = row.get("first_difference")
    where = f"at new token {d['token']} (verify step {d['verify_step']})" if d else ""
    return (
        f"{row['prompt']}: SGLang and the harness disagree {where}: verify steps "
        f"{row['sglang_verify_ct']} vs {row['harness_steps']}, accepted-draft histograms "
        f"{row['sglang_hist']} vs {row['harness_hist']}\n  sglang:  {row.get('sglang_tokens')}\n"
        f"  harness: {row.get('harness_tokens')}"
    )


def serve_check(
    target: str | Path,
    draft: str | Path,
    workloads: list[str],
    num_prompts: int,
    max_new_tokens: int,
    out_dir: str | Path,
    port: int = 30611,
    device: str = "cpu",
    dtype: str = "float32",
    log=print,
    sglang_python: str = SGLangServer.python,
    tp_size: int = 1,
) -> dict:
    """Serve `draft` with SGLang, decode with the harness, compare; returns the report.
    A DRAFT/sts_calibration.json (evaluation/calibrate.py) is served with it; the report's
    `sts_loaded` says whether SGLang logged loading it."""
    from specforge_dspark.decoding.sts import STS_FILE

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_conventions(draft, target_path=target)
    harness = load_harness(target, draft, device, dtype)
    eos, logical = harness.target.eos_ids, harness.head.logical_vocab

    sts = Path(draft) / STS_FILE
    sts = sts if sts.is_file() else None  # start_spec_server serves it with the draft
    t0 = time.monotonic()
    server, url = start_spec_server(target, draft, port, out / "sglang_server.log", device,
                                    dtype, sglang_python, tp_size)  # fmt: skip
    start_s = time.monotonic() - t0
    log(f"SGLang {KINDS[kind_of_dir(draft)].algorithm} server ready in {start_s:.0f}s ({url})")

    def judged(where: str, gen: Generation, served: dict) -> dict:
        row = compare(where, gen, served)
        row["sglang"] = served["completion_tokens"]
        row["drafted"] = sum(len(s.drafts) for s in gen.steps)
        row["padded_drafts"] = sum(t >= logical for s in gen.steps for t in s.drafts)
        return row

    try:
        rows, _, _ = side_by_side(
            harness, workloads, num_prompts, max_new_tokens,
            lambda ids: generate(url, ids, max_new_tokens, eos), judged,
        )  # fmt: skip
    finally:
        server.stop()

    verify_ct = sum(r["sglang_verify_ct"] for r in rows)
    steps = sum(r["harness_steps"] for r in rows)
    drafted = sum(r["drafted"] for r in rows)  # the harness's drafts (padded: ids >= logical)
    report = {
        "agree": bool(rows) and all(r["agree"] for r in rows),
        "prompts": rows,
        "num_prompts": len(rows),
        "sglang_accept_length": sum(r["sglang"] - 1 for r in rows) / verify_ct
        if verify_ct
        else None,
        "harness_accept_length": sum(r["new_tokens"] - 1 for r in rows) / steps if steps else None,
        "padded_draft_rate": sum(r["padded_drafts"] for r in rows) / drafted if drafted else None,
        "server_start_seconds": start_s,
        "sts_path": None if sts is None else str(sts),
        "sts_loaded": STS_LOADED in server.log_path.read_text(errors="replace"),
        "target": str(target),
        "draft": str(draft),
        "dtype": dtype,
        "max_new_tokens": max_new_tokens,
        "tp_size": tp_size,
    }
    figures = (
        f"accept length SGLang {report['sglang_accept_length']}, harness "
        f"{report['harness_accept_length']}"
    )
    return write_report(out, report, explain, "serve_check", figures, log)


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(
        "evaluation.serve_check",
        __doc__.split("\n\n")[0],
        (
            "python -m evaluation.serve_check --target .cache/tiny_target "
            "--draft runs/demo/export/sglang --out runs/serve_check"
        ),
    )
    ap.add_argument("--target", required=True, help="hf target directory SGLang can serve")
    ap.add_argument("--draft", required=True, help="SGLang export of the drafter")
    ap.add_argument("--workloads", default="gsm8k,mt_bench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--port", type=int, default=30611)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument(
        "--engine", choices=["sglang", "vllm"], default="sglang",
        help="vllm: --draft is the speculators export (evaluation/serve_vllm.py)",
    )  # fmt: skip
    ap.add_argument("--harness-draft", help="vllm: SGLang export of the same checkpoint")
    ap.add_argument("--vllm-python", default=VLLMServer.python, help="vLLM's interpreter")
    ap.add_argument("--sglang-python", default=SGLangServer.python, help="SGLang's interpreter")
    ap.add_argument("--tp-size", type=int, default=1, help="SGLang's tensor-parallel size")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # the server shares this machine's cores
    specs = [w for w in a.workloads.split(",") if w.strip()]
    if a.engine == "vllm":
        from evaluation.serve_vllm import serve_check_vllm

        report = serve_check_vllm(
            a.target, a.draft, specs, a.num_prompts, a.max_new_tokens, a.out, a.port,
            a.device, a.dtype, a.harness_draft, a.vllm_python,
        )  # fmt: skip
        return 0 if report["agree"] else 1
    report = serve_check(
        a.target, a.draft, specs, a.num_prompts, a.max_new_tokens, a.out, a.port, a.device,
        a.dtype, sglang_python=a.sglang_python, tp_size=a.tp_size,
    )  # fmt: skip
    return 0 if report["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
