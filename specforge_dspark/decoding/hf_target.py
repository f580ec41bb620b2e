"""The hf target as the verifier: greedy tokens and aux hidden states with a KV cache.

Legend: S tokens in one forward, D = m*H concatenated aux features.

Rollback after a partial acceptance. Inkling's cache holds more than keys and values:
sliding-window layers keep only the last window-1 keys and every layer keeps
short-convolution states of the last kernel-size inputs, so dropping the rejected tail
of a verify pass is not a slice of the keys. Two modes, both exact:
- `crop`: `cache.activate_past_recording()` after the prefill makes those layers keep
  the full states of each forward until `cache.crop(-n)` drops the last n tokens and
  trims back to the working size (transformers' own assisted-decoding rollback).
- `rerun`: copy the cache before verifying; afterwards restore the copy and run the
  committed tokens again (two forwards per step, for caches `crop` can't roll back, such
  as recurrent states).
Measured on the tiny Inkling target: both give output equal to plain greedy token for
token, for accept counts 0..G, for ends inside a step, and for decoding that crosses the
sliding window (tests/test_evaluation_decoding.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from specforge_dspark.engines.tap import AuxTap

CacheMode = Literal["crop", "rerun"]


@dataclass
class Forward:
    next_tokens: list[int]  # [S] greedy token after each input position
    aux_SD: torch.Tensor  # the aux taps of layer_ids (AuxTap), concatenated


class HFTarget:
    """A causal LM loaded from a path, verifying one sequence at a time (batch 1)."""

    def __init__(self, model, tokenizer, layer_ids: list[int], cache_mode: CacheMode = "crop"):
        if cache_mode not in ("crop", "rerun"):
            raise ValueError(f"cache_mode must be 'crop' or 'rerun', got {cache_mode!r}")
        n_layers = model.config.num_hidden_layers
        if any(k < 0 or k >= n_layers - 1 for k in layer_ids):
            raise ValueError(
                f"target_layer_ids {layer_ids} must lie in [0, {n_layers - 2}] "
                f"(the target has {n_layers} layers; the last can't be captured)"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.layer_ids = list(layer_ids)
        self.tap = AuxTap(model, self.layer_ids)  # the engine's tap, per forward
        self.cache_mode = cache_mode
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.device = next(model.parameters()).device
        self._cache = None
        self._saved = None

    @classmethod
    def load(
        cls,
        path: str | Path,
        layer_ids: list[int],
        cache_mode: CacheMode = "crop",
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> HFTarget:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        from specforge_dspark.engines.quant_targets import load_causal_lm

        model = load_causal_lm(path, dtype=dtype).to(device)  # a quantized copy as served
        return cls(model, tok, layer_ids, cache_mode)

    @torch.inference_mode()
    def _forward(self, ids: list[int], cache) -> list[int]:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, past_key_values=cache, use_cache=True)
        # the target's greedy choice over the rows it serves: transformers' Inkling crops its
        # logits to unpadded_vocab_size (as SGLang's Inkling LogitsProcessor does); a Qwen3
        # model returns all rows (and SGLang crops Qwen3 only to config.vocab_size, all rows)
        return out.logits[0].argmax(-1).tolist()

    def _forward_aux(self, ids: list[int], cache) -> Forward:
        """Greedy tokens and aux features `[S, D]` of `ids` appended to `cache`."""
        with self.tap:
            tokens = self._forward(ids, cache)
        return Forward(tokens, torch.cat(self.tap.taps(), dim=-1)[0])

    def prefill(self, ids: list[int]) -> Forward:
        """Start a new sequence; returns greedy tokens and aux features of `ids`."""
        from transformers import DynamicCache

        self._cache = DynamicCache(config=self.model.config)
        fwd = self._forward_aux(ids, self._cache)
        if self.cache_mode == "crop":
            if not getattr(self._cache, "is_croppable", True):
                raise ValueError(
                    "--cache-mode crop: this target's cache has recurrent states that crop "
                    "can't roll back; use --cache-mode rerun"
                )
            # after the prefill, so a long prompt is not recorded in full
            self._cache.activate_past_recording()
        return fwd

    def verify(self, ids: list[int]) -> Forward:
        """Append `ids` after the committed prefix (call `commit` afterwards)."""
        if self.cache_mode == "rerun":
            self._saved = copy.deepcopy(self._cache)
        return self._forward_aux(ids, self._cache)

    def commit(self, ids: list[int], n_keep: int) -> torch.Tensor | None:
        """Keep the first `n_keep` of the last verified `ids` in the cache.

        Returns fresh aux features of the kept tokens in `rerun` mode, else None.
        """
        if self.cache_mode == "crop":
            self._cache.crop(-(len(ids) - n_keep))
            return None
        self._cache = self._saved
        self._saved = None
        return self._forward_aux(ids[:n_keep], self._cache).aux_SD

    def cache_length(self) -> int:
        return self._cache.get_seq_length()

    @torch.inference_mode()
    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Plain greedy decoding, one token per forward: the lossless reference."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = [self._forward(ids, cache)[-1]]
        while len(out) < max_new_tokens and out[-1] not in self.eos_ids:
            out.append(self._forward(out[-1:], cache)[-1])
        return out


def eos_token_ids(model, tokenizer) -> set[int]:
    """End-of-turn ids: generation_config's eos (int or list) plus the tokenizer's."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def batched_greedy(
    model, prompts: list[list[int]], max_new_tokens: int, eos: set[int], pad: int
) -> list[list[int]]:
    """Plain greedy continuations of `prompts` decoded as one left-padded batch, each cut
    after its first token in `eos`. A batch can round differently from one-by-one
    decoding: callers that need exactness decode again one by one where it matters."""
    width = max(map(len, prompts))
    ids_BT = torch.tensor([[pad] * (width - len(q)) + q for q in prompts])
    mask_BT = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts])
    new_BT = model.generate(
        ids_BT,
        attention_mask=mask_BT,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(eos),
        pad_token_id=pad,
    )[:, width:].tolist()
    out = []
    for new in new_BT:
        stop = next((i for i, t in enumerate(new) if t in eos), None)
        out.append(new[:max_new_tokens] if stop is None else new[: stop + 1])
    return out
