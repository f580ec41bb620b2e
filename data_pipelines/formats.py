"""Chat row formats: detect, normalise to OpenAI-style messages, validate.

Accepted rows (one JSON object each):
- sharegpt: `{"conversations": [{"from": "human", "value": "..."}, ...], "system"?: str}`
- messages: `{"messages": [{"role", "content", "reasoning_content"?, "tool_calls"?,
  "name"?, "tool_call_id"?}, ...], "tools"?: [...]}`; content may be a string or a list
  of `{"type": "text", "text": ...}` parts; assistant content that starts with an inline
  `<think>...</think>` block has it moved to `reasoning_content`.
- pairs: `{<prompt_field>: str, <response_field>: str, "system"?: str}` (GSM8K:
  question/answer).

Every problem raises `RowError(reason, detail)`; `reason` is a short stable key that the
prepare report counts (see `REASONS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

Format = Literal["auto", "sharegpt", "messages", "pairs"]
THINK = ("<think>", "</think>")
"""Inline reasoning markers split off assistant content into `reasoning_content`."""

ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "prompter": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
}

REASONS = {
    "invalid_utf8": "the line is not valid UTF-8",
    "bad_json": "the line is not valid JSON",
    "unreadable_file": "the rest of the file could not be read",
    "row_not_object": "the row is not a JSON object",
    "unknown_format": "no conversations / messages / prompt-response fields",
    "ambiguous_format": "the row has both conversations and messages",
    "missing_field": "a field the format needs is missing",
    "conversation_not_list": "conversations / messages is not a list",
    "empty_conversation": "the conversation has no turns",
    "turn_not_object": "a turn is not a JSON object",
    "missing_role": "a turn has no role / from",
    "bad_role_type": "a role is not a string",
    "unknown_role": "a role is not one of system, user, assistant, tool (or an alias)",
    "missing_content": "a turn has no content / value",
    "bad_content_type": "content is not a string (or a list of text parts)",
    "non_text_content": "content has a non-text part (image, audio, ...)",
    "empty_content": "content is empty or whitespace",
    "invalid_unicode": "text has lone surrogates (not encodable as UTF-8)",
    "bad_system_type": "the row's system field is not a string",
    "bad_reasoning_type": "reasoning_content is not a string",
    "bad_tool_calls": "tool_calls is not a list of {function: {name, arguments}}",
    "bad_tools": "tools is not a list of objects",
    "misplaced_system": "a system turn is not the first turn",
    "first_turn_not_user": "the first non-system turn is not a user turn",
    "consecutive_user_turns": "two user turns in a row",
    "consecutive_assistant_turns": "two assistant turns in a row",
    "tool_without_call": "a tool turn does not follow an assistant tool call",
    "ends_without_assistant": "the conversation does not end on an assistant turn",
    "special_token_in_content": "text contains a special token of the tokenizer",
    "template_error": "the chat template failed to render the conversation",
    "template_inconsistent": "assistant turns could not be located in the rendering",
    "too_few_supervised_tokens": "fewer than two consecutive supervised tokens",
    "truncated_no_supervision": "after truncation to max_length no two supervised tokens remain",
    "unexpected_error": "an error nobody foresaw (a bug to report; the run goes on)",
    # regeneration only
    "no_user_turn": "the row has no user turn to answer",
    "tool_turns_unsupported": "tool turns cannot be regenerated (their results would not match)",
    "duplicate_id": "the row's id was used by an earlier row",
}


class RowError(ValueError):
    """A row that cannot be used; `reason` is a key of REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class FormatConfig:
    """The recipe's data fields that shape normalisation."""

    format: Format = "auto"
    prompt_field: str = "question"
    response_field: str = "answer"
    system_prompt: str = ""


Message = dict[str, Any]


@dataclass
class Conversation:
    messages: list[Message]
    tools: list[dict] | None = None


def detect_format(row: dict, cfg: FormatConfig) -> str:
    """The format of one row (cfg.format unless it is auto)."""
    if cfg.format != "auto":
        return cfg.format
    if "conversations" in row and "messages" in row:
        raise RowError("ambiguous_format")
    if "conversations" in row:
        return "sharegpt"
    if "messages" in row:
        return "messages"
    if cfg.prompt_field in row or cfg.response_field in row:
        return "pairs"
    keys = ", ".join(list(map(str, row))[:8])
    raise RowError("unknown_format", f"keys: {keys}")


def normalize(row: Any, cfg: FormatConfig) -> Conversation:
    """Turn one parsed row into a validated conversation; raise RowError."""
    if not isinstance(row, dict):
        raise RowError("row_not_object", f"got {type(row).__name__}")
    fmt = detect_format(row, cfg)
    if fmt == "pairs":
        messages = _pairs(row, cfg)
        tools = None
    else:
        key = "conversations" if fmt == "sharegpt" else "messages"
        if key not in row:
            raise RowError("missing_field", key)
        turns = row[key]
        if not isinstance(turns, list):
            raise RowError("conversation_not_list", f"{key} is {type(turns).__name__}")
        messages = [parse_turn(t, i) for i, t in enumerate(turns)]
        system = row.get("system")
        if system not in (None, "") and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": _system(system)})
        tools = _tools(row.get("tools"))
    if cfg.system_prompt and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    check_order(messages)
    return Conversation(messages, tools)


def _system(value: Any) -> str:
    if not isinstance(value, str):
        raise RowError("bad_system_type", f"got {type(value).__name__}")
    return _text(value, "system")


def _pairs(row: dict, cfg: FormatConfig) -> list[Message]:
    out = []
    if row.get("system") not in (None, ""):
        out.append({"role": "system", "content": _system(row["system"])})
    for name, role in ((cfg.prompt_field, "user"), (cfg.response_field, "assistant")):
        if name not in row:
            other = next((k for k in ("conversations", "messages") if k in row), None)
            hint = f" (the row has {other!r}: check data.format / --format)" if other else ""
            raise RowError("missing_field", name + hint)
        out.append({"role": role, "content": _content(row[name], name)})
    return out


def parse_turn(turn: Any, i: int) -> Message:
    """One turn ({role|from, content|value, ...}) as a normalised message; RowError."""
    where = f"turn {i}"
    if not isinstance(turn, dict):
        raise RowError("turn_not_object", f"{where} is {type(turn).__name__}")
    role_key = "role" if "role" in turn else "from"
    if role_key not in turn:
        raise RowError("missing_role", where)
    role = turn[role_key]
    if not isinstance(role, str):
        raise RowError("bad_role_type", f"{where}: {role!r}")
    norm = ROLE_ALIASES.get(role.strip().lower())
    if norm is None:
        raise RowError("unknown_role", f"{where}: {role!r}")
    msg: Message = {"role": norm}
    tool_calls = turn.get("tool_calls")
    if tool_calls is not None:
        if norm != "assistant":
            raise RowError("bad_tool_calls", f"{where}: tool_calls on a {norm} turn")
        msg["tool_calls"] = _tool_calls(tool_calls, where)
    content_key = "content" if "content" in turn else "value"
    content = turn.get(content_key)
    if content is None and tool_calls is not None:
        msg["content"] = ""
    elif content_key not in turn or content is None:
        raise RowError("missing_content", where)
    else:
        msg["content"] = _content(content, where, allow_empty=tool_calls is not None)
    reasoning = turn.get("reasoning_content", turn.get("reasoning"))
    if reasoning is None and norm == "assistant" and msg["content"].lstrip().startswith(THINK[0]):
        reasoning = _split_think(msg, where)
    if reasoning is not None:
        if norm != "assistant" or not isinstance(reasoning, str):
            raise RowError("bad_reasoning_type", f"{where}: {type(reasoning).__name__}")
        if reasoning.strip():
            msg["reasoning_content"] = _text(reasoning, where)
    for extra in ("name", "tool_call_id"):
        if isinstance(turn.get(extra), str):
            msg[extra] = turn[extra]
    return msg


def _split_think(msg: Message, where: str) -> str | None:
    """Inline `<think>...</think>answer` content: move the reasoning to its own field."""
    head, sep, tail = msg["content"].lstrip()[len(THINK[0]) :].partition(THINK[1])
    if not sep:
        return None
    if not tail.strip() and "tool_calls" not in msg:
        raise RowError("empty_content", f"{where}: only reasoning, no answer")
    msg["content"] = tail.lstrip()
    return head.strip()


def _content(value: Any, where: str, allow_empty: bool = False) -> str:
    if isinstance(value, list):
        parts = []
        for part in value:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text":
                if not isinstance(part.get("text"), str):
                    raise RowError("bad_content_type", f"{where}: text part without text")
                parts.append(part["text"])
            elif isinstance(part, dict):
                raise RowError("non_text_content", f"{where}: part type {part.get('type')!r}")
            else:
                raise RowError("bad_content_type", f"{where}: part is {type(part).__name__}")
        value = "".join(parts)
    if not isinstance(value, str):
        kind = "NaN" if isinstance(value, float) and math.isnan(value) else type(value).__name__
        raise RowError("bad_content_type", f"{where}: {kind}")
    if not value.strip() and not allow_empty:
        raise RowError("empty_content", where)
    return _text(value, where)


def _text(value: str, where: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError("invalid_unicode", f"{where}: {e.reason} at {e.start}") from None
    return value


def _tool_calls(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RowError("bad_tool_calls", f"{where}: expected a non-empty list")
    out = []
    for call in value:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RowError("bad_tool_calls", f"{where}: a call without function.name")
        args = fn.get("arguments", {})
        if not isinstance(args, str | dict):
            raise RowError("bad_tool_calls", f"{where}: arguments is {type(args).__name__}")
        out.append({**call, "type": call.get("type", "function")})
    return out


def _tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise RowError("bad_tools", f"got {type(value).__name__}")
    return value or None


def check_order(messages: list[Message]) -> None:
    """System first (if any), then user; user/assistant alternate; tool turns only after
    an assistant tool call; the last turn is an assistant turn."""
    if not messages:
        raise RowError("empty_conversation")
    prev = None
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "system":
            if i != 0:
                raise RowError("misplaced_system", f"turn {i}")
        elif prev in (None, "system"):
            if role != "user":
                raise RowError("first_turn_not_user", f"turn {i} is {role}")
        elif role == prev == "user":
            raise RowError("consecutive_user_turns", f"turn {i}")
        elif role == "assistant" and prev == "assistant":
            raise RowError("consecutive_assistant_turns", f"turn {i}")
        elif role == "tool" and not (prev == "tool" or messages[i - 1].get("tool_calls")):
            raise RowError("tool_without_call", f"turn {i}")
        prev = role
    if prev != "assistant":
        raise RowError("ends_without_assistant", f"last turn is {prev}")
