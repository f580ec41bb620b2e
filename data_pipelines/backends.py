"""Regeneration backends: an OpenAI-compatible chat server, an SGLang server's native
/generate on token ids, or the local hf target.

Each answers a conversation (the messages so far, ending on a user turn) with an
`Answer`: content, reasoning content (kept apart), finish reason. The server backends
(`answer`, async, inside `async with`) share one client with retries; sglang and hf
render the prompt and read the answer with the target's tokenizer (`ChatTokens`), which
lets them open an answer with sampled tokens and continue from exactly those ids.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from specforge_dspark.engines.api_key import auth_headers, from_env


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


class _Client:
    """An aiohttp session posting JSON with retries (connection errors, timeouts, 429 and
    5xx); a server backend is one, used inside `async with`."""

    def __init__(self, rc, retries: int = 3) -> None:
        self.rc = rc
        self.retries = retries
        self.session = None

    async def __aenter__(self):
        import aiohttp

        key = from_env(self.rc.api_key_env, "data.regenerate.api_key_env")
        self.session = aiohttp.ClientSession(
            headers=auth_headers(key),
            connector=aiohttp.TCPConnector(limit=self.rc.concurrency),
            timeout=aiohttp.ClientTimeout(total=self.rc.request_timeout_s),
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def post(self, url: str, body: dict[str, Any]) -> Any:
        """The JSON body of the reply to one request; RequestError after the retries."""
        import aiohttp

        last = RequestError("request_failed")
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(10.0, 0.5 * 2**attempt) * (0.5 + random.random()))
            try:
                async with self.session.post(url, json=body) as resp:
                    text = await resp.text()
                    if resp.status == 429 or resp.status >= 500:
                        last = RequestError(f"http_{resp.status}", text[:300])
                        continue
                    if resp.status != 200:
                        raise RequestError(f"http_{resp.status}", text[:300])
                    try:
                        return await resp.json(content_type=None)
                    except ValueError:
                        raise RequestError("bad_response", text[:300]) from None
            except TimeoutError:
                last = RequestError("timeout", f"after {self.rc.request_timeout_s}s")
            except aiohttp.ClientError as e:
                last = RequestError("connection_error", f"{type(e).__name__}: {e}")
        raise last


class OpenAIBackend(_Client):
    """`/v1/chat/completions` of an OpenAI-compatible server (data.regenerate.url)."""

    def __init__(self, rc, retries: int = 3, target_path: str = "") -> None:
        super().__init__(rc, retries)  # target_path: unused, the server tokenizes
        self.url = chat_url(rc.url)

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

    async def answer(self, messages: list[dict], opening: int = 0) -> Answer:
        """One chat completion (`opening` must be 0: regenerate._check refuses it here)."""
        assert opening == 0, "a chat server cannot continue a partial answer token-exactly"
        return parse_openai_response(await self.post(self.url, self.body(messages)))


class SGLangBackend(_Client):
    """An SGLang server's native `/generate` on token ids: the prompt rendered here with
    the target's chat template (target.path), an opening of `opening` tokens sampled by
    the server from the full distribution at rc.opening_temperature, then those very ids
    appended to the prompt and continued as configured (greedy at temperature 0): the
    hf backend's answers, token for token up to kernel numerics."""

    def __init__(self, rc, retries: int = 3, target_path: str = "") -> None:
        super().__init__(rc, retries)
        self.url = rc.url.rstrip("/") + "/generate"
        self.chat = ChatTokens(target_path, rc.chat_template_kwargs)

    def body(self, ids: list[int], max_new: int, temperature: float, top_p: float) -> dict:
        params = {
            "max_new_tokens": max_new,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": -1,  # the full distribution, as the hf backend samples
            "stop_token_ids": sorted(self.chat.eos_ids),
        }
        return {"input_ids": ids, "sampling_params": params, "stream": False}

    async def generate(self, ids: list[int], max_new: int, temperature: float, top_p: float):
        """(new token ids, finish reason) of one `/generate` request."""
        data = await self.post(self.url, self.body(ids, max_new, temperature, top_p))
        try:
            new, finish = data["output_ids"], data["meta_info"]["finish_reason"]
        except (KeyError, TypeError):
            raise RequestError("bad_response", str(data)[:300]) from None
        finish = finish if isinstance(finish, dict) else {"type": str(finish)}
        if finish.get("type") == "abort":  # refused by the server (a prompt too long, ...)
            raise RequestError("aborted", str(finish.get("message", ""))[:300])
        return list(new), finish.get("type", "unknown")

    async def answer(self, messages: list[dict], opening: int = 0) -> Answer:
        """One answer: `opening` sampled tokens (unless 0), then the configured decoding
        of the rest from prompt + those ids, in one budget of rc.max_new_tokens."""
        rc = self.rc
        prompt = self.chat.prompt_ids(messages)
        new, finish = [], "length"
        if opening:
            new, finish = await self.generate(prompt, opening, rc.opening_temperature, 1.0)
        ended = finish == "stop" or any(t in self.chat.eos_ids for t in new)
        if not ended and len(new) == opening:
            budget = rc.max_new_tokens - len(new)
            rest, finish = await self.generate(prompt + new, budget, rc.temperature, rc.top_p)
            new += rest
        answer = self.chat.parse(new)
        if finish == "stop":  # the server may leave the matched stop token out
            answer.finish_reason = "stop"
        return answer


class ChatTokens:
    """The target's tokenizer as regeneration uses it: a conversation to the prompt's
    ids, new ids to an Answer (cut at the first end-of-turn id, reasoning split at
    </think>)."""

    def __init__(self, target_path: str, chat_template_kwargs: dict, eos=None) -> None:
        """`eos`: the end-of-turn id(s) (default: the checkpoint's generation config's)."""
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
        self.kwargs = chat_template_kwargs
        if eos is None:
            eos = _generation_eos(target_path)
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.eos_ids.add(self.tok.eos_token_id)
        self.think_end = self._token_id("</think>")
        self.think_start = self._token_id("<think>")

    def _token_id(self, text: str) -> int | None:
        ids = self.tok.convert_tokens_to_ids([text])
        return ids[0] if ids and ids[0] != self.tok.unk_token_id else None

    def prompt_text(self, messages: list[dict]) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.kwargs
        )

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.tok(self.prompt_text(messages), add_special_tokens=False)["input_ids"]

    def length(self, ids: list[int]) -> int:
        """Tokens up to and with the first end-of-turn id."""
        stop = next((k for k, t in enumerate(ids) if t in self.eos_ids), None)
        return len(ids) if stop is None else stop + 1

    def parse(self, ids: list[int]) -> Answer:
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


def _generation_eos(target_path: str):
    """The checkpoint's end-of-turn id(s), as transformers would load them for generate."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(target_path, local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json: what the model config says
        config = AutoConfig.from_pretrained(target_path, local_files_only=True)
        return GenerationConfig.from_model_config(config).eos_token_id


class HFBackend:
    """Batched greedy/sampled `generate` on the local target (left padding); an answer
    may open with sampled tokens (data.regenerate.opening_tokens)."""

    def __init__(self, target_path: str, rc, device: str = "cpu") -> None:
        import torch

        from specforge_dspark.engines.quant_targets import load_causal_lm

        self.torch = torch
        self.rc = rc
        self.model = load_causal_lm(target_path, local_files_only=True)
        self.model.to(device).eval()
        self.device = device
        eos = self.model.generation_config.eos_token_id
        self.chat = ChatTokens(target_path, rc.chat_template_kwargs, eos)
        self.tok = self.chat.tok
        self.tok.padding_side = "left"
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        self.generated_tokens = 0  # up to and with each answer's end of turn

    def answer_batch(
        self, conversations: list[list[dict]], openings: list[int] | None = None
    ) -> list[Answer]:
        """One answer per conversation; `openings[i]` > 0 opens answer i with that many
        sampled tokens (rc.opening_temperature) before the configured decoding."""
        openings = openings or [0] * len(conversations)
        answers: list[Answer | None] = [None] * len(conversations)
        for k in sorted(set(openings)):
            rows = [i for i, o in enumerate(openings) if o == k]
            texts = [self.chat.prompt_text(conversations[i]) for i in rows]
            enc = self.tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)
            new = self.generate_ids(enc["input_ids"], enc["attention_mask"], k)
            self.generated_tokens += sum(self.chat.length(ids) for ids in new)
            for i, ids in zip(rows, new, strict=True):
                answers[i] = self.chat.parse(ids)
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
