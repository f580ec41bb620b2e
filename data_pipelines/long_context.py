"""Long-context prompts from ../shared/data: a request at the end that needs what came before.

    python -m data_pipelines.long_context --tokenizer DIR --out DIR [--eval-prompts 24]

Two kinds, alternating:
- document: a numbered list of problems (GSM8K, MATH-500) filled up to a token length, then
  "Solve problem j above" for a j drawn uniformly: the answer must find problem j in it.
- session: a transcript of earlier exchanges (ShareGPT conversations, user and assistant
  turns) filled up to a token length, then a request about the session's first question:
  the answer must reach back to its beginning.

Writes into --out:
  long_eval.jsonl   {"id", "kind", "prompt", "prompt_tokens"}: the evaluation workload
                    (`long=DIR/long_eval.jsonl:prompt`), lengths spread evenly over
                    [--eval-min, --eval-max] tokens in the tokenizer's count
  train_short.jsonl, train_long.jsonl
                    {"id", "messages": [user turn]} for the regeneration: prompts of
                    [--short-min, --short-max] and [--long-min, --long-max] tokens
The evaluation reads rows that training never does: GSM8K test and MATH-500 rows below
targets/corpus.py EVAL_ROWS_RESERVED and ShareGPT rows from 250 on; training reads GSM8K
train, MATH-500 from EVAL_ROWS_RESERVED on and ShareGPT rows below 250. Seeded: the same
files for the same arguments and tokenizer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from specforge_dspark.config.command_line import command_parser
from specforge_dspark.targets.corpus import EVAL_ROWS_RESERVED, SHARED_DATA

SESSION_SPLIT = 250
"""ShareGPT rows below this are training's, the rest evaluation's."""


def _jsonl(rel: str, field: str) -> list[str]:
    path = SHARED_DATA / rel
    return [json.loads(line)[field] for line in path.open() if line.strip()]


def sources(split: str) -> tuple[list[str], list[list[tuple[str, str]]]]:
    """(problems, conversations as [(role, text)]) of `split` ("eval" or "train")."""
    math = _jsonl("eval/math500_test.jsonl", "problem")
    chats = json.loads((SHARED_DATA / "train/sharegpt_sample.json").read_text())
    role = {"human": "User"}
    convs = [
        [(role.get(t["from"], "Assistant"), t["value"].strip()) for t in c["conversations"]]
        for c in chats
    ]
    convs = [c for c in convs if len(c) >= 2 and all(text for _, text in c)]
    if split == "eval":
        problems = _jsonl("eval/gsm8k_test.jsonl", "question") + math[:EVAL_ROWS_RESERVED]
        return problems, convs[SESSION_SPLIT:]
    problems = _jsonl("train/gsm8k_train.jsonl", "question") + math[EVAL_ROWS_RESERVED:]
    return problems, convs[:SESSION_SPLIT]


def document(problems: list[str], length: int, count, rng: random.Random) -> str:
    """Numbered problems up to `length` tokens (`count(text)`), then a request for one."""
    picked, used = [], 0
    for text in rng.sample(problems, len(problems)):
        n = count(text) + 8
        if picked and used + n > length - 24:
            break
        picked.append(text)
        used += n
    j = rng.randrange(len(picked)) + 1
    body = "\n\n".join(f"Problem {i}: {p}" for i, p in enumerate(picked, 1))
    return (
        f"Here are {len(picked)} problems.\n\n{body}\n\n"
        f"Solve problem {j} above step by step, and give the final answer."
    )


def session(convs: list, length: int, count, rng: random.Random) -> str:
    """Earlier exchanges up to `length` tokens, then a question about the first one."""
    turns, used = [], 0
    for conv in rng.sample(convs, len(convs)):
        for role, text in conv:
            line = f"{role}: {text}"
            n = count(line) + 2
            if turns and used + n > length - 40:
                break
            turns.append(line)
            used += n
        if used > length - 80:
            break
    first = turns[0].removeprefix("User: ")[:160]
    return (
        "Here is our conversation so far.\n\n" + "\n\n".join(turns) + "\n\n"
        f'My very first message was: "{first}..." Remind me, in two or three sentences, '
        "what you answered to it."
    )


def prompts(split: str, lengths: list[int], count, seed: int) -> list[dict]:
    """One prompt per target length, the kinds alternating."""
    problems, convs = sources(split)
    rng, rows = random.Random(seed), []
    for i, length in enumerate(lengths):
        kind = ("document", "session")[i % 2]
        make = document if kind == "document" else session
        text = make(problems if kind == "document" else convs, length, count, rng)
        rows.append({"id": f"{split}-{kind}-{i}", "kind": kind, "prompt": text,
                     "prompt_tokens": count(text)})  # fmt: skip
    return rows


def spread(lo: int, hi: int, n: int) -> list[int]:
    """n lengths evenly over [lo, hi]."""
    return [round(lo + (hi - lo) * i / max(n - 1, 1)) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(
        "data_pipelines.long_context",
        __doc__.split("\n\n")[0],
        "python -m data_pipelines.long_context --tokenizer .cache/smollm2 --out runs/long/data",
    )
    ap.add_argument("--tokenizer", required=True, help="the target's directory (counts tokens)")
    ap.add_argument("--out", required=True, help="folder for the three jsonl files")
    ap.add_argument("--eval-prompts", type=int, default=24, help="evaluation prompts")
    ap.add_argument("--eval-min", type=int, default=256, help="shortest evaluation prompt")
    ap.add_argument("--eval-max", type=int, default=1900, help="longest evaluation prompt")
    ap.add_argument("--train-rows", type=int, default=96, help="training prompts per length")
    ap.add_argument("--short-min", type=int, default=96, help="short training prompts from")
    ap.add_argument("--short-max", type=int, default=384, help="... up to (tokens)")
    ap.add_argument("--long-min", type=int, default=1024, help="long training prompts from")
    ap.add_argument("--long-max", type=int, default=1900, help="... up to (tokens)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = prompts("eval", spread(a.eval_min, a.eval_max, a.eval_prompts), count, a.seed)
    _write(out / "long_eval.jsonl", rows)
    for name, lo, hi in (("short", a.short_min, a.short_max), ("long", a.long_min, a.long_max)):
        rng = random.Random(a.seed + 1)
        lengths = [rng.randint(lo, hi) for _ in range(a.train_rows)]
        train = prompts("train", lengths, count, a.seed + len(name))
        _write(out / f"train_{name}.jsonl", [
            {"id": r["id"], "messages": [{"role": "user", "content": r["prompt"]}]} for r in train
        ])  # fmt: skip
    said = [r["prompt_tokens"] for r in rows]
    print(f"wrote {out}: {len(rows)} evaluation prompts of {min(said)}-{max(said)} tokens, "
          f"{a.train_rows} training prompts per length")  # fmt: skip
    return 0


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    raise SystemExit(main())
