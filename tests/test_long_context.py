"""The long-context prompts (data_pipelines/long_context.py): each ends in a request that
needs what came before, at the length asked for, from rows the other split never reads."""

from __future__ import annotations

import re

from data_pipelines.long_context import prompts, sources, spread


def words(text: str) -> int:  # a stand-in tokenizer: the pipeline counts with any
    return len(text.split())


def test_documents_and_sessions_end_in_a_request_that_needs_them():
    lengths = spread(200, 1200, 6)
    rows = prompts("eval", lengths, words, seed=3)
    assert [r["kind"] for r in rows] == ["document", "session"] * 3
    for row, length in zip(rows, lengths, strict=True):
        text = row["prompt"]
        assert row["prompt_tokens"] == words(text) <= length
        assert row["prompt_tokens"] >= 0.5 * length or row["kind"] == "session"
        if row["kind"] == "document":
            asked = int(re.search(r"Solve problem (\d+) above", text).group(1))
            listed = [int(n) for n in re.findall(r"^Problem (\d+): ", text, re.M)]
            assert listed == list(range(1, len(listed) + 1)) and asked in listed
        else:
            first = re.search(r"\n\nUser: (.*)", text).group(1)
            quoted = re.search(r'My very first message was: "(.*?)\.\.\."', text).group(1)
            assert first.startswith(quoted[:40])  # the request reaches back to the start
    assert max(r["prompt_tokens"] for r in rows) > 0.75 * max(lengths)
    assert prompts("eval", lengths, words, seed=3) == rows  # seeded


def test_evaluation_and_training_read_different_problems():
    eval_problems, eval_convs = sources("eval")
    train_problems, train_convs = sources("train")
    assert not set(eval_problems) & set(train_problems)
    assert eval_convs and train_convs  # ShareGPT split by row (its texts repeat across rows)
