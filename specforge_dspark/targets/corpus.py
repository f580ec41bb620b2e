"""The tiny targets' text: the ../shared/data files, the pre-training corpus and the
held-out sets (rows the evaluation reads are never trained on), and the loop test."""

from __future__ import annotations

import json
from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
EVAL_ROWS_RESERVED = 100  # MATH500 / HumanEval rows below this are evaluation-only
HELDOUT_GSM8K = 100
HELDOUT_SHAREGPT = 50
HELDOUT_MT_BENCH = 40


def data_files() -> list[Path]:
    train, ev = SHARED_DATA / "train", SHARED_DATA / "eval"
    return [
        train / "gsm8k_train.jsonl",
        train / "sharegpt_sample.json",
        ev / "math500_test.jsonl",
        ev / "humaneval.jsonl",
        ev / "gsm8k_test.jsonl",
        ev / "mt_bench_questions.jsonl",
    ]


def _jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _pair(user: str, assistant: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def corpus() -> tuple[list[list[dict]], dict[str, tuple[list[list[dict]], str]]]:
    """(pre-training conversations, {name: (held-out conversations, role scored)}).

    Pre-training: every GSM8K train pair, ShareGPT but its last HELDOUT_SHAREGPT
    conversations, and the MATH500 / HumanEval rows from EVAL_ROWS_RESERVED on (the
    evaluation reads the first rows of each workload, at most EVAL_ROWS_RESERVED).
    Held out: the answers of the first HELDOUT_GSM8K GSM8K test pairs, the first turns of
    HELDOUT_MT_BENCH MT-Bench questions (prose no training row holds) and the answers of
    the last HELDOUT_SHAREGPT ShareGPT conversations (templated, so the loss is low).
    """
    train, ev = SHARED_DATA / "train", SHARED_DATA / "eval"
    convs = [_pair(r["question"], r["answer"]) for r in _jsonl(train / "gsm8k_train.jsonl")]
    roles = {"human": "user", "gpt": "assistant"}
    share = [
        [{"role": roles.get(t["from"], "user"), "content": t["value"]} for t in c["conversations"]]
        for c in json.loads((train / "sharegpt_sample.json").read_text())
    ]
    convs += share[:-HELDOUT_SHAREGPT]
    math = _jsonl(ev / "math500_test.jsonl")[EVAL_ROWS_RESERVED:]
    convs += [_pair(r["problem"], r["solution"]) for r in math]
    code = _jsonl(ev / "humaneval.jsonl")[EVAL_ROWS_RESERVED:]
    convs += [_pair(r["prompt"], r["prompt"] + r["canonical_solution"]) for r in code]
    gsm_test = _jsonl(ev / "gsm8k_test.jsonl")[:HELDOUT_GSM8K]
    mt = _jsonl(ev / "mt_bench_questions.jsonl")[:HELDOUT_MT_BENCH]
    heldout = {
        "gsm8k_test_answers": ([_pair(r["question"], r["answer"]) for r in gsm_test], "assistant"),
        "mt_bench_questions": ([[{"role": "user", "content": r["turns"][0]}] for r in mt], "user"),
        "sharegpt_answers": (share[-HELDOUT_SHAREGPT:], "assistant"),
    }
    return convs, heldout


def loops(tokens: list[int], window: int = 48, max_period: int = 8) -> bool:
    """True if the last `window` tokens repeat with a period <= `max_period`."""
    if len(tokens) < window:
        return False
    tail = tokens[-window:]
    return any(
        all(tail[i] == tail[i + p] for i in range(window - p)) for p in range(1, max_period + 1)
    )
