"""Render conversations with the target's own chat template and mask assistant tokens.

The loss mask comes from the rendering itself, for any template, without knowing its
markers: for assistant turn i we render

    prompt_i = render(messages[:i], add_generation_prompt=True)
    upto_i   = render(messages[:i+1])
    empty_i  = render(messages[:i] + [turn i with content ""])

The turn starts where `prompt_i` and `upto_i` part (so generation-prompt extras such as
an empty think block are not supervised); its content ends where `upto_i` and `empty_i`
stop sharing their suffix; after the content, the turn's end-of-turn special token(s)
are supervised too and trailing separators (a newline after `<|im_end|>`) are not.
When the template renders an earlier turn differently once later turns follow (e.g. it
drops earlier reasoning), the turn ends at the first occurrence, in the full rendering,
of the end-of-turn token that `upto_i` shows. Character spans become token masks through
the fast tokenizer's offsets of the full rendering, tokenised once; a token that
straddles a span boundary (BPE merged a template space into the first content token)
is supervised, since it carries content the model must produce.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_pipelines.formats import Conversation, Message, RowError


@dataclass
class Layout:
    """A rendered conversation and the supervised character spans [start, end)."""

    text: str
    spans: list[tuple[int, int]]


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool
    has_pair: bool
    """Two consecutive tokens are supervised (at least one next-token target)."""

    @property
    def num_supervised(self) -> int:
        return sum(self.loss_mask)


GENERIC_TOKENIZER_CLASSES = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}


def load_tokenizer(path: str | Path):
    """The target's fast tokenizer from a local directory (offline).

    When AutoTokenizer would pick the generic fast class anyway, that class is loaded
    directly: same tokenizer, without AutoTokenizer's import of torch (~10 s on CPU)."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"target.path: tokenizer directory not found: {path}")
    try:
        cls_name = json.loads((p / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        cls_name = "unknown"
    if (p / "tokenizer.json").is_file() and cls_name in GENERIC_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast as Loader
    else:
        from transformers import AutoTokenizer as Loader
    tok = Loader.from_pretrained(str(p), local_files_only=True)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"target.path {path}: need a fast tokenizer (character offsets)")
    if not tok.chat_template:
        raise ValueError(f"target.path {path}: the tokenizer has no chat_template")
    return tok


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on equal prefixes (C-speed slices, not a char loop)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    return _common_prefix(a[::-1][:limit], b[::-1][:limit])


class ChatRenderer:
    """Renders and encodes conversations for one tokenizer and chat-template kwargs."""

    def __init__(self, tokenizer, template_kwargs: dict[str, Any] | None = None) -> None:
        self.tok = tokenizer
        self.kwargs = dict(template_kwargs or {})
        specials = sorted(
            {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
            | set(tokenizer.all_special_tokens),
            key=len,
            reverse=True,
        )
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    # ----------------------------------------------------------------- rendering

    def render(self, messages: list[Message], tools: list | None, generation: bool) -> str:
        try:
            return self.tok.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=generation,
                **self.kwargs,
            )
        except Exception as e:  # jinja raise_exception, TypeError, ...: the row's problem
            raise RowError("template_error", f"{type(e).__name__}: {e}") from None

    def check_specials(self, conv: Conversation) -> None:
        """Reject text that spells a special token (it would tokenise as a control token)."""
        if self._special_re is None:
            return
        for i, m in enumerate(conv.messages):
            for key in ("content", "reasoning_content", "tool_calls"):
                value = m.get(key)
                if value is None:
                    continue
                text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                hit = self._special_re.search(text)
                if hit:
                    raise RowError("special_token_in_content", f"turn {i} {key}: {hit.group()!r}")
        if conv.tools:
            hit = self._special_re.search(json.dumps(conv.tools, ensure_ascii=False))
            if hit:
                raise RowError("special_token_in_content", f"tools: {hit.group()!r}")

    def layout(self, conv: Conversation) -> Layout:
        """Render `conv` and locate every assistant turn's supervised characters."""
        msgs, tools = conv.messages, conv.tools
        full = self.render(msgs, tools, generation=False)
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt = self.render(msgs[:i], tools, generation=True)
            upto = full if i == len(msgs) - 1 else self.render(msgs[: i + 1], tools, False)
            start = _common_prefix(prompt, upto)
            eot, content_end = self._last_special(upto, start), len(upto)
            if eot is None or upto[eot.end() :].strip():
                # the turn may not end on a special token: find where its content ends
                content_end = self._content_end(msgs, i, tools, upto, start)
                eot = self._last_special(upto, content_end)
            if full.startswith(upto):
                end = eot.end() if eot else content_end
            elif full.startswith(upto[:start]) and eot:
                pos = full.find(eot.group(), start)
                if pos < 0:
                    raise RowError("template_inconsistent", f"turn {i}: end of turn not found")
                end = pos + len(eot.group())
            else:
                raise RowError("template_inconsistent", f"turn {i}: prefix renders differ")
            if end > start:
                spans.append((start, end))
        return Layout(full, spans)

    def _content_end(self, msgs: list[Message], i: int, tools, upto: str, start: int) -> int:
        """Where turn i's content ends in `upto`: render it with empty content, compare."""
        try:
            empty = self.render(msgs[:i] + [{**msgs[i], "content": ""}], tools, False)
        except RowError:  # a template may refuse empty content: all of the turn counts
            return len(upto)
        return len(upto) - _common_suffix(upto, empty, len(upto) - start)

    def _last_special(self, text: str, begin: int) -> re.Match | None:
        if self._special_re is None:
            return None
        matches = list(self._special_re.finditer(text, begin))
        return matches[-1] if matches else None

    # ----------------------------------------------------------------- encoding

    def encode(self, layouts: list[Layout], max_length: int) -> list[Encoded]:
        """Tokenise the full renderings once (batched) and build the loss masks."""
        encs = self.tok.backend_tokenizer.encode_batch(
            [lay.text for lay in layouts], add_special_tokens=False
        )
        out = []
        for lay, enc in zip(layouts, encs, strict=True):
            ids = enc.ids
            starts = [o[0] for o in enc.offsets]
            ends = [o[1] for o in enc.offsets]
            mask = bytearray(len(ids))
            runs = []
            for start, end in lay.spans:  # supervised: tokens that overlap a span
                a, b = bisect_right(ends, start), bisect_left(starts, end)
                mask[a:b] = b"\x01" * (b - a)
                runs.append((a, min(b, max_length)))
            truncated = len(ids) > max_length
            pair = any(b - a >= 2 for a, b in runs)
            out.append(Encoded(ids[:max_length], list(mask[:max_length]), truncated, pair))
        return out
