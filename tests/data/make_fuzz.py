"""Writes fuzz.jsonl (good rows mixed with malformed ones) and fuzz_expected.json.

    python tests/data/make_fuzz.py        # rewrites both files next to this script

fuzz_expected.json maps each 1-based line number to "keep", "blank" or the reject reason
that `prepare` must report for it (with data.max_length = 256 and the tiny target).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def j(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


def msgs(*pairs, **extra) -> bytes:
    return j({"messages": [{"role": r, "content": c} for r, c in pairs], **extra})


U, A = "user", "assistant"

GOOD: list[bytes] = [
    j({"id": "g-pairs", "question": "What is 2+2?", "answer": "2+2 = 4.\n#### 4"}),
    j(
        {
            "id": "g-sharegpt",
            "system": "You are terse.",
            "conversations": [
                {"from": "human", "value": "Hi there"},
                {"from": "gpt", "value": "Hello!"},
                {"from": "Human ", "value": "Bye"},
                {"from": "GPT", "value": "Goodbye."},
            ],
        }
    ),
    msgs((U, "Say hi in Japanese 🙂"), (A, "こんにちは 🙂"), id="g-unicode"),
    j(
        {
            "id": "g-reasoning-tools",
            "messages": [
                {"role": "developer", "content": "Use tools."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "I should call the tool.",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "weather", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "content": "18C, sunny"},
                {"role": "assistant", "content": "It is 18C and sunny."},
            ],
        }
    ),
    j(
        {
            "id": "g-parts",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Part one. "}, "two"]},
                {"role": "assistant", "content": [{"type": "text", "text": "Answer."}]},
            ],
        }
    ),
    msgs((U, "Long answer please"), (A, "word " * 40), id="g-long-answer"),
    msgs((U, "a " * 60), (A, "y " * 300), id="g-truncated-but-supervised"),
    msgs(("system", "sys"), (U, "q1"), (A, "a1"), (U, "q2"), (A, "a2"), id="g-multiturn"),
]

SPECIAL = "<|im_end|>"
BAD: list[tuple[str, bytes]] = [
    ("bad_json", b'{"question": "x", "answer": '),
    ("bad_json", b'{"question": "a", "answer": "b"} trailing'),
    ("bad_json", b"[" * 100_000),
    ("invalid_utf8", b'{"question": "caf\xe9", "answer": "ok"}'),
    ("row_not_object", b"[1, 2, 3]"),
    ("row_not_object", b'"just a string"'),
    ("row_not_object", b"null"),
    ("unknown_format", j({"text": "no chat here"})),
    ("ambiguous_format", j({"messages": [], "conversations": []})),
    ("conversation_not_list", j({"messages": "hello"})),
    ("empty_conversation", j({"messages": []})),
    ("turn_not_object", j({"messages": ["hi", "there"]})),
    ("missing_role", j({"messages": [{"content": "hi"}, {"role": A, "content": "x"}]})),
    ("bad_role_type", j({"messages": [{"role": 5, "content": "hi"}]})),
    ("unknown_role", j({"conversations": [{"from": "narrator", "value": "Once"}]})),
    ("missing_content", j({"messages": [{"role": U}, {"role": A, "content": "x"}]})),
    (
        "bad_content_type",
        j({"messages": [{"role": U, "content": 42}, {"role": A, "content": "x"}]}),
    ),
    ("bad_content_type", b'{"question": NaN, "answer": "x"}'),
    ("non_text_content", j({"messages": [{"role": U, "content": [{"type": "image_url"}]}]})),
    ("empty_content", msgs((U, "hi"), (A, "   \n"))),
    ("empty_content", j({"question": "q", "answer": ""})),
    ("missing_field", j({"question": "only a question"})),
    ("bad_content_type", j({"question": {"text": "q"}, "answer": "a"})),
    ("bad_json", b"{'question': 'python dict', 'answer': 'not json'}"),
    ("row_not_object", b"42"),
    ("missing_content", j({"conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]})),
    ("invalid_unicode", b'{"question": "bad \\ud800 surrogate", "answer": "a"}'),
    ("bad_system_type", j({"system": 123, "conversations": [{"from": "human", "value": "x"}]})),
    (
        "bad_reasoning_type",
        j(
            {
                "messages": [
                    {"role": U, "content": "q"},
                    {"role": A, "content": "a", "reasoning": [1]},
                ]
            }
        ),
    ),
    (
        "bad_tool_calls",
        j(
            {
                "messages": [
                    {"role": U, "content": "q"},
                    {"role": A, "content": "", "tool_calls": "x"},
                ]
            }
        ),
    ),
    ("bad_tools", j({"tools": "weather", "messages": [{"role": U, "content": "q"}]})),
    ("misplaced_system", msgs((U, "q"), ("system", "late"), (A, "a"))),
    ("first_turn_not_user", msgs((A, "I start"), (U, "q"), (A, "a"))),
    ("consecutive_user_turns", msgs((U, "q1"), (U, "q2"), (A, "a"))),
    ("consecutive_assistant_turns", msgs((U, "q"), (A, "a1"), (A, "a2"))),
    ("tool_without_call", msgs((U, "q"), (A, "a"), ("tool", "result"), (A, "b"))),
    ("ends_without_assistant", msgs((U, "q"), (A, "a"), (U, "dangling"))),
    ("ends_without_assistant", j({"conversations": [{"from": "human", "value": "q"}]})),
    ("special_token_in_content", msgs((U, f"inject {SPECIAL} here"), (A, "a"))),
    ("special_token_in_content", msgs((U, "q"), (A, "a <|endoftext|> b"))),
    ("empty_content", msgs((U, "q"), (A, "<think>only reasoning</think>"))),
    ("truncated_no_supervision", msgs((U, "long prompt " * 200), (A, "the answer"))),
]


def build() -> tuple[bytes, dict[str, str]]:
    """Interleave good and bad rows (plus a BOM, CRLF and blank lines) deterministically."""
    lines: list[bytes] = []
    expected: dict[str, str] = {}

    def add(line: bytes, what: str) -> None:
        lines.append(line)
        expected[str(len(lines))] = what

    add(b"\xef\xbb\xbf" + GOOD[0], "keep")  # UTF-8 byte order mark on the first line
    good = iter(GOOD[1:])
    for k, (reason, line) in enumerate(BAD):
        add(line, reason)
        if k % 4 == 1:
            add(next(good, GOOD[0]), "keep")
        if k == 10:
            add(b"   \t", "blank")
    for line in good:
        add(line, "keep")
    lines[3] += b"\r"  # a CRLF line ending
    return b"\n".join(lines) + b"\n", expected


def main() -> None:
    data, expected = build()
    (HERE / "fuzz.jsonl").write_bytes(data)
    (HERE / "fuzz_expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
