"""Regeneration backends: an OpenAI-compatible chat server, or the local hf target.

Both answer a list of chat messages (the conversation so far, ending on a user turn) with
an `Answer`: content, reasoning content (kept apart), finish reason.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any


@dataclass
class Answer:
    content: str
    reasoning_content: str | None
    finish_reason: str


class RequestError(Exception):
    """A request that failed after its retries; `reason` goes to the errors file."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    @property
    def transient(self) -> bool:
        """The server or machine, not the row, failed: a resumed run tries the row again."""
        return self.reason in TRANSIENT or self.reason.startswith("http_5")


TRANSIENT = {"connection_error", "timeout", "http_429", "generate_failed"}


def chat_url(url: str) -> str:
    """The /v1/chat/completions endpoint of a server base URL (or the endpoint itself)."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


def parse_openai_response(data: Any) -> Answer:
    """Answer from a chat.completion body; RequestError('bad_response') if malformed."""
    try:
        choice = data["choices"][0]
        msg = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise RequestError("bad_response", str(data)[:300]) from None
    reasoning = msg.get("reasoning_content") or msg.get("reasoning") or None
    content = msg.get("content") or ""
    if not isinstance(content, str) or not isinstance(reasoning, str | None):
        raise RequestError("bad_response", "content / reasoning_content is not a string")
    return Answer(content, reasoning, choice.get("finish_reason") or "unknown")


class OpenAIBackend:
    """Async client for `/v1/chat/completions` with retries; use inside `async with`."""

    def __init__(self, rc, concurrency: int, retries: int = 3) -> None:
        self.url = chat_url(rc.url)
        self.rc = rc
        self.concurrency = concurrency
        self.retries = retries
        self.session = None

    async def __aenter__(self) -> OpenAIBackend:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.concurrency),
            timeout=aiohttp.ClientTimeout(total=self.rc.request_timeout_s),
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    def body(self, messages: list[dict]) -> dict[str, Any]:
        rc = self.rc
        body = {
            "model": rc.model,
            "messages": messages,
            "max_tokens": rc.max_new_tokens,
            "temperature": rc.temperature,
            "top_p": rc.top_p,
            "stream": False,
        }
        if rc.chat_template_kwargs:
            body["chat_template_kwargs"] = rc.chat_template_kwargs
        return body

    async def answer(self, messages: list[dict]) -> Answer:
        """POST one request; retry connection errors, timeouts, 429 and 5xx."""
        import aiohttp

        last = RequestError("request_failed")
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(10.0, 0.5 * 2**attempt) * (0.5 + random.random()))
            try:
                async with self.session.post(self.url, json=self.body(messages)) as resp:
                    text = await resp.text()
                    if resp.status == 429 or resp.status >= 500:
                        last = RequestError(f"http_{resp.status}", text[:300])
                        continue
                    if resp.status != 200:
                        raise RequestError(f"http_{resp.status}", text[:300])
                    try:
                        data = await resp.json(content_type=None)
                    except ValueError:
                        raise RequestError("bad_response", text[:300]) from None
                    return parse_openai_response(data)
            except TimeoutError:
                last = RequestError("timeout", f"after {self.rc.request_timeout_s}s")
            except aiohttp.ClientError as e:
                last = RequestError("connection_error", f"{type(e).__name__}: {e}")
        raise last


class HFBackend:
    """Batched greedy/sampled `generate` on the local target (left padding); an answer
    may open with sampled tokens (data.regenerate.opening_tokens)."""

    def __init__(self, target_path: str, rc, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.rc = rc
        self.tok = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
        self.tok.padding_side = "left"
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(target_path, local_files_only=True)
        self.model.to(device).eval()
        self.device = device
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.eos_ids.add(self.tok.eos_token_id)
        self.think_end = self._token_id("</think>")
        self.think_start = self._token_id("<think>")
        self.generated_tokens = 0  # up to and with each answer's end of turn

    def _token_id(self, text: str) -> int | None:
        ids = self.tok.convert_tokens_to_ids([text])
        return ids[0] if ids and ids[0] != self.tok.unk_token_id else None

    def answer_batch(
        self, conversations: list[list[dict]], openings: list[int] | None = None
    ) -> list[Answer]:
        """One answer per conversation; `openings[i]` > 0 opens answer i with that many
        sampled tokens (rc.opening_temperature) before the configured decoding."""
        openings = openings or [0] * len(conversations)
        answers: list[Answer | None] = [None] * len(conversations)
        for k in sorted(set(openings)):
            rows = [i for i, o in enumerate(openings) if o == k]
            texts = [
                self.tok.apply_chat_template(
                    conversations[i], tokenize=False, add_generation_prompt=True,
                    **self.rc.chat_template_kwargs,
                )
                for i in rows
            ]  # fmt: skip
            enc = self.tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)
            new = self.generate_ids(enc["input_ids"], enc["attention_mask"], k)
            self.generated_tokens += sum(self._length(ids) for ids in new)
            for i, ids in zip(rows, new, strict=True):
                answers[i] = self._parse(ids)
        return answers

    def generate_ids(self, ids_BS, mask_BS, opening: int = 0) -> list[list[int]]:
        """The new token ids of each left-padded prompt row, at most rc.max_new_tokens:
        the first `opening` sampled from the full distribution at rc.opening_temperature,
        the rest decoded as configured (greedy at temperature 0)."""
        torch, rc = self.torch, self.rc
        ids_BS, mask_BS = ids_BS.to(self.device), mask_BS.to(self.device)
        prompt_len, budget = ids_BS.shape[1], rc.max_new_tokens
        with torch.no_grad():
            if opening:
                ids_BS = self.model.generate(
                    input_ids=ids_BS, attention_mask=mask_BS, max_new_tokens=opening,
                    do_sample=True, temperature=rc.opening_temperature, top_p=1.0, top_k=0,
                    pad_token_id=self.tok.pad_token_id,
                )  # fmt: skip
                grown = ids_BS.shape[1] - mask_BS.shape[1]  # < opening if every row ended
                mask_BS = torch.cat([mask_BS, mask_BS.new_ones(len(mask_BS), grown)], dim=1)
                budget -= grown
            sample = rc.temperature > 0
            kwargs = {"temperature": rc.temperature, "top_p": rc.top_p} if sample else {}
            out = self.model.generate(
                input_ids=ids_BS, attention_mask=mask_BS, max_new_tokens=budget,
                do_sample=sample, pad_token_id=self.tok.pad_token_id, **kwargs,
            )  # fmt: skip
        return out[:, prompt_len:].tolist()

    def _length(self, ids: list[int]) -> int:
        stop = next((k for k, t in enumerate(ids) if t in self.eos_ids), None)
        return len(ids) if stop is None else stop + 1

    def _parse(self, ids: list[int]) -> Answer:
        """Cut at the first end-of-turn id; split reasoning at </think> if present."""
        stop = next((k for k, t in enumerate(ids) if t in self.eos_ids), None)
        finish = "length" if stop is None else "stop"
        ids = ids if stop is None else ids[:stop]
        reasoning = None
        if self.think_end is not None and self.think_end in ids:
            k = ids.index(self.think_end)
            head = [t for t in ids[:k] if t != self.think_start]
            reasoning = self.tok.decode(head, skip_special_tokens=True)
            ids = ids[k + 1 :]
        content = self.tok.decode(ids, skip_special_tokens=True)
        return Answer(content, reasoning or None, finish)
