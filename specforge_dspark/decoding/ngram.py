"""A training-free n-gram (prompt lookup) drafter: what SGLang and vLLM users get
without training anything, as the baseline a trained drafter has to beat.

Rule (vLLM's prompt lookup, at a fixed block size G): for n = max_ngram .. min_ngram,
find the latest earlier occurrence of the context's last n tokens; the drafts are the
G tokens that followed it. A copy that runs past the end of the context continues
through its own drafts (so a repeated phrase is drafted whole). With no match at any
n, the drafts repeat the last token (they cost a verify slot, never correctness).

It plugs into spec_decode's loop like DSparkDraft: `begin(prompt_ids)` starts a
conversation, and `propose` rebuilds the committed context from `ctx_len` (the verifier
kept the previous bonus token and the first `ctx_len - len(history) - 1` drafts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NgramConfig:
    block_size: int
    target_layer_ids: tuple[int, ...] = (0,)  # the loop asks the target for some aux
    max_ngram: int = 3
    min_ngram: int = 1


def lookup(history: list[int], G: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """G drafts continuing `history` by its latest earlier n-gram match (pure)."""
    L = len(history)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = history[L - n :]
        for start in range(L - n - 1, -1, -1):  # latest earlier occurrence first
            if history[start : start + n] == suffix:
                ext = list(history)
                src = start + n
                while len(ext) < L + G:
                    ext.append(ext[src])
                    src += 1
                return ext[L:]
    return [history[-1]] * G if history else [0] * G


class NgramDrafter:
    """Prompt-lookup drafts; no weights, no confidence head."""

    def __init__(self, block_size: int, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"n-gram drafter: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        self.config = NgramConfig(block_size, max_ngram=max_ngram, min_ngram=min_ngram)
        self.history: list[int] = []
        self._last: list[int] = []  # [bonus, drafts...] of the previous proposal

    @property
    def num_drafts(self) -> int:
        """Drafted tokens per block: G (as DSpark)."""
        return self.config.block_size

    def begin(self, prompt_ids: list[int]) -> None:
        self.history = list(prompt_ids)
        self._last = []

    def context(self, aux_BSD: torch.Tensor) -> torch.Tensor:
        return aux_BSD.new_zeros(aux_BSD.shape[0], aux_BSD.shape[1], 0)

    def propose(
        self,
        ctx_1SH: torch.Tensor,
        ctx_len: int,
        bonus_token: int,
        embed_fn: Callable | None = None,
        logits_fn: Callable | None = None,
    ) -> tuple[torch.Tensor, None]:
        kept = ctx_len - len(self.history)  # tokens the verifier kept since last time
        if kept < 0 or kept > len(self._last):
            raise RuntimeError(
                f"n-gram drafter: context length {ctx_len} does not follow its history "
                f"({len(self.history)} tokens); call begin(prompt_ids) per generation"
            )
        self.history += self._last[:kept]
        G = self.config.block_size
        drafts = lookup(
            [*self.history, bonus_token], G, self.config.max_ngram, self.config.min_ngram
        )
        self._last = [bonus_token, *drafts]
        return torch.tensor(drafts, dtype=torch.long), None
