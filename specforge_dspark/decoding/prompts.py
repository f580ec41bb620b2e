"""Evaluation prompts: workloads are jsonl files read by field name.

A workload spec is either a built-in name (`gsm8k`, `math500`, `humaneval`, `mt_bench`,
read from ../shared/data/eval) or `name=path:field` for any jsonl of prompts. A field
holding a string is one single-turn prompt; a field holding a list of strings is one
multi-turn conversation (MT-Bench `turns`), each later turn conditioned on the target's
own earlier answers.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "eval"

# name -> (file under the data dir, prompt field)
BUILTIN_WORKLOADS: dict[str, tuple[str, str]] = {
    "gsm8k": ("gsm8k_test.jsonl", "question"),
    "math500": ("math500_test.jsonl", "problem"),
    "humaneval": ("humaneval.jsonl", "prompt"),
    "mt_bench": ("mt_bench_questions.jsonl", "turns"),
}


@dataclass(frozen=True)
class Workload:
    name: str
    path: Path
    field: str


@dataclass(frozen=True)
class Conversation:
    """User turns of one prompt; `index` is the row's position among the loaded prompts."""

    workload: str
    index: int
    turns: tuple[str, ...]


def parse_workload(spec: str, data_dir: Path | None = None) -> Workload:
    """`gsm8k` (built-in) or `name=path:field` (any jsonl)."""
    spec = spec.strip()
    if "=" in spec:
        name, _, rest = spec.partition("=")
        path, sep, field = rest.rpartition(":")
        if not name or not sep or not path or not field:
            raise ValueError(f"--workload {spec!r}: expected name=path:field")
        return Workload(name, Path(path), field)
    if spec not in BUILTIN_WORKLOADS:
        known = ", ".join(BUILTIN_WORKLOADS)
        raise ValueError(
            f"--workloads: unknown workload {spec!r} (built-in: {known}; or pass name=path:field)"
        )
    file, field = BUILTIN_WORKLOADS[spec]
    return Workload(spec, (data_dir or DEFAULT_DATA_DIR) / file, field)


def _turns(value: object) -> tuple[str, ...] | None:
    if isinstance(value, str):
        return (value,) if value.strip() else None
    if isinstance(value, list) and value and all(isinstance(t, str) and t.strip() for t in value):
        return tuple(value)
    return None


def load_conversations(workload: Workload, limit: int) -> list[Conversation]:
    """The first `limit` usable rows; malformed or empty rows are skipped with a warning."""
    if not workload.path.is_file():
        raise ValueError(f"workload {workload.name}: no such file {workload.path}")
    out: list[Conversation] = []
    skipped = 0
    with workload.path.open() as f:
        for line in f:
            if len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            turns = _turns(row.get(workload.field)) if isinstance(row, dict) else None
            if turns is None:
                skipped += 1
                continue
            out.append(Conversation(workload.name, len(out), turns))
    if skipped:
        warnings.warn(
            f"workload {workload.name}: skipped {skipped} rows without a usable "
            f"{workload.field!r} field in {workload.path}",
            stacklevel=2,
        )
    if not out:
        raise ValueError(f"workload {workload.name}: no prompts with field {workload.field!r}")
    return out


def render(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` in the target's chat template, ready for the assistant."""
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    return list(ids)


def answer_text(tokenizer, tokens: list[int], eos_ids: set[int]) -> str:
    """An assistant turn's text from its generated tokens (a final end-of-turn token
    dropped), for the next turn's conversation."""
    body = tokens[:-1] if tokens and tokens[-1] in eos_ids else tokens
    return tokenizer.decode(body, skip_special_tokens=True)
