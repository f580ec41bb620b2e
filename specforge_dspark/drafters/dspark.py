"""The DSpark draft network, self-contained (torch only), and its SGLang config.json.

Its layers live in `layers.py` and its files in `io.py`; together they import nothing but
torch (and safetensors to save and load).

A DSpark drafter (DSPARK_SPEC.md sections 1, 2, 4, 6) proposes a block of G tokens in one
parallel pass over features of a frozen target, then a small Markov head fixes the
dependencies inside the block and a confidence head predicts each slot's acceptance.
It owns no embedding and no LM head: callers pass the frozen target's embeddings in and
project `h` through the target's LM head themselves (`specforge_dspark.objective.frozen_head`).

Checked against the installed SGLang 0.5.23 source, which serves what this file trains:
- `sglang/srt/models/dflash.py`: `DFlashDraftModel` (fc -> hidden_norm on the concatenated
  aux states; pre-norm Qwen3 layers; final norm), `DFlashAttention.forward` (q/k RMSNorm
  per head, then RoPE; scale head_dim**-0.5; no biases), `kv_proj_only` /
  `DSparkDraftMixin.write_target_hidden_kv` in `models/dspark.py` (context K/V come from
  each layer's k_proj/v_proj applied to the shared context WITHOUT the layer's
  input_layernorm, then k_norm, then RoPE at the context positions),
  `_get_dflash_layer_attention_params` ("full_attention" layers are non-causal inside the
  block), `DFlashMLP` (SiluAndMul on [gate; up]).
- `sglang/srt/layers/layernorm.py` `RMSNorm.forward_native`: statistics in fp32, the weight
  multiplied in fp32, then cast back; `layers/rotary_embedding/base.py` + `utils.py`:
  neox style (rotate halves), inv_freq = theta ** -(2i / head_dim), cos/sin cast to the
  input dtype before use.
- `sglang/srt/models/dspark.py` `VanillaMarkov`, `GatedMarkovHead`, `RNNHead`
  (parameter names, shapes and step math), `DSparkConfidenceHead` (`proj` on
  [h ; markov_w1[prev]], bias), `build_markov_head` / `build_confidence_head` (read from
  the config ROOT), `compute_base_logits` (the confidence head and the gated/rnn heads see
  the final-normed `h`, undivided by the muP multiplier).
- `sglang/srt/speculative/dspark_components/dspark_draft.py`: with `sample_from_anchor`
  (the default), the block is [bonus, MASK * (G-1)] at positions seq_len .. seq_len+G-1,
  all G rows give base logits, the Markov head runs step by step from prev = bonus, and
  prev of slot k is draft k-1. `dspark_config.py` `parse_dspark_draft_config` for the keys.

Shape legend:
  B batch, S context positions, N blocks (anchors) per sequence, G block size,
  Q = N*G block queries, K = S + Q keys, H hidden, D = m*H concatenated aux features,
  A attention heads, C key/value heads, E head_dim, F intermediate (FFN), V vocab
  columns, R Markov rank, T any number of rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from specforge_dspark.drafters.backbone import DecoderFields, DraftBackbone
from specforge_dspark.drafters.io import (
    DECODER_SIZES,
    check_decoder_fields,
    config_reader,
    read_decoder_fields,
    sglang_config,
)
from specforge_dspark.drafters.layers import ConfidenceHead, MarkovHead, build_visibility_mask

ARCHITECTURE = "Qwen3DSparkModel"
"""config.json `architectures` entry SGLang serves a DSpark drafter as."""
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
DSPARK_KEYS = (
    "block_size",
    "target_layer_ids",
    "num_target_layers",
    "mask_token_id",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "layer_types",
)
"""Keys SGLang reads for DSpark; written at the config root and mirrored in dflash_config."""

# Settings SGLang honours that would change the math this file implements: key -> the
# values that keep it (absent or None is always fine).
_SUPPORTED_VALUES: dict[str, tuple] = {
    "sample_from_anchor": (True,),  # False is the DFlash slot convention
    "attention_bias": (False,),
    "use_gemma_norm": (False,),
    "is_causal": (False,),
    "partial_rotary_factor": (1.0,),
    "rope_is_neox_style": (True,),
    "is_neox_style": (True,),
    "conv_kernel_size": (0,),
    "attention_sink_bias": (False,),
    "attention_value_scale": (),
    "selector_rank": (0,),
}
_SIZES = (*DECODER_SIZES, "block_size", "markov_rank")
"""Fields that must be > 0."""


# --------------------------------------------------------------------------- config


@dataclass(kw_only=True)
class DSparkConfig(DecoderFields):
    """Architecture of a DSpark drafter; field names are those of SGLang's config.json."""

    block_size: int = 7
    markov_rank: int
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    layer_types: list[str] = field(default_factory=list)
    """One entry per draft layer; empty means all "full_attention"."""

    def __post_init__(self) -> None:
        check_decoder_fields(self, _SIZES)
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"DSparkConfig.markov_head_type must be one of {MARKOV_HEAD_TYPES}, "
                f"got {self.markov_head_type!r}"
            )
        if set(self.layer_types) != {"full_attention"}:
            raise ValueError(
                f"DSparkConfig.layer_types must all be 'full_attention', got {self.layer_types}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DSparkConfig:
        """Read a SGLang DSpark config.json (the published layouts).

        DSpark keys are read at the root or inside `dflash_config` / `dspark_config`;
        the root wins (SGLang builds its Markov and confidence heads from the root) and a
        disagreement is warned about. Defaults follow SGLang (`io.read_decoder_fields`),
        block_size 7 (DEFAULT_DSPARK_GAMMA), enable_confidence_head true,
        confidence_head_with_markov = markov_rank > 0.
        mask_token_id, markov_rank, markov_head_type and target_layer_ids are required,
        as are settings SGLang would serve with different math (ValueError names them).
        """
        nested = {**(d.get("dflash_config") or {}), **(d.get("dspark_config") or {})}
        get = config_reader(d, nested, root_wins=True)
        decoder = read_decoder_fields(d, get, _SUPPORTED_VALUES, "DSparkDraft", block_size=7)
        markov_rank = int(get("markov_rank"))
        return cls(
            **decoder,
            markov_rank=markov_rank,
            markov_head_type=str(get("markov_head_type")).lower(),
            enable_confidence_head=bool(get("enable_confidence_head", True)),
            confidence_head_with_markov=bool(get("confidence_head_with_markov", markov_rank > 0)),
        )

    def to_dict(self) -> dict[str, Any]:
        """SGLang layout (DSPARK_SPEC.md s.6): DSpark keys at the root AND in dflash_config."""
        settings = {"sample_from_anchor": True}
        return sglang_config(self, ARCHITECTURE, DSPARK_KEYS, settings=settings)


# --------------------------------------------------------------------------- model


class DSparkDraft(DraftBackbone):
    """The DSpark drafter; submodule names are SGLang's weight names (DSPARK_SPEC.md s.6)."""

    LOAD_SKIPS = ("embed_tokens.", "lm_head.", "rotary_emb.")  # the target's, or caches

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__(config)
        self.markov_head = MarkovHead(config)
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None
        # Start as a no-op bias on the base logits: the Markov head learns a correction.
        nn.init.zeros_(self.markov_head.markov_w2.weight)

    @property
    def num_drafts(self) -> int:
        """Drafted tokens per block: G (slot k drafts the token after row k's position)."""
        return self.config.block_size

    def masks(
        self,
        anchors_BN: torch.Tensor,
        block_valid_BN: torch.Tensor,
        ctx_valid_BS: torch.Tensor,
        starts_BN: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention mask `forward` takes for these blocks (`build_visibility_mask`)."""
        G = self.config.block_size
        return build_visibility_mask(anchors_BN, block_valid_BN, ctx_valid_BS, G, starts_BN)

    def apply_heads(
        self, h_BNGH: torch.Tensor, base_logits_BNGV: torch.Tensor, prev_BNG: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced Markov bias and confidence for every slot in parallel.

        base_logits: lm_head(h / mup) over the first V columns (V <= vocab_size; the bias
        is cropped to match); prev: the previous token of each slot (x_a for slot 0).
        Returns (base + W2 z(prev), confidence logits `[B, N, G]` or None).
        """
        vocab = base_logits_BNGV.shape[-1]
        if vocab > self.config.vocab_size:
            raise ValueError(
                f"base logits have {vocab} columns > vocab_size {self.config.vocab_size}"
            )
        e_BNGR, z_BNGR = self.markov_head.latents(prev_BNG, h_BNGH)
        logits_BNGV = base_logits_BNGV + self.markov_head.bias(z_BNGR, vocab)
        if self.confidence_head is None:
            return logits_BNGV, None
        return logits_BNGV, self.confidence_head(h_BNGH, e_BNGR)

    @torch.no_grad()
    def propose(
        self,
        ctx_1SH: torch.Tensor,
        ctx_len: int,
        bonus_token: int | torch.Tensor,
        embed_fn: Callable[[torch.Tensor], torch.Tensor],
        logits_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy drafts of one block (DSPARK_SPEC.md section 4; SGLang `sample_from_anchor`).

        Block [bonus, MASK * (G-1)] at positions ctx_len .. ctx_len+G-1 over context
        positions 0 .. ctx_len-1; base logits `logits_fn(h)` (over every LM-head row, as
        SGLang serves) for every slot; the Markov head then runs slot by slot with prev of
        slot 0 = bonus and prev of slot k = draft k-1. Draft k is the guess for the token at
        ctx_len + k + 1.
        Returns (G draft tokens, G confidence logits or None).
        """
        G, device = self.config.block_size, ctx_1SH.device
        bonus = torch.as_tensor(bonus_token, device=device).reshape(1)
        ids_G = torch.full((G,), self.config.mask_token_id, device=device)
        ids_G[0] = bonus[0]
        anchors_11 = torch.tensor([[ctx_len]], device=device)
        visible = build_visibility_mask(
            anchors_11,
            torch.ones(1, 1, dtype=torch.bool, device=device),
            torch.ones(1, ctx_len, dtype=torch.bool, device=device),
            G,
        )
        h_GH = self(
            ctx_1SH[:, :ctx_len],
            torch.arange(ctx_len, device=device)[None],
            embed_fn(ids_G)[None, None],
            (ctx_len + torch.arange(G, device=device))[None, None],
            visible,
        )[0, 0]
        base_GV = logits_fn(h_GH)
        head, prev, state = self.markov_head, bonus, self.markov_head.init_state(h_GH[:1])
        drafts = []
        for k in range(G):
            z_1R, state = head.step(head.markov_w1(prev), h_GH[k : k + 1], state)
            prev = (base_GV[k] + head.bias(z_1R, base_GV.shape[-1])[0]).argmax(-1, keepdim=True)
            drafts.append(prev)
        tokens_G = torch.cat(drafts)
        if self.confidence_head is None:
            return tokens_G, None
        prev_G = torch.cat((bonus, tokens_G[:-1]))
        return tokens_G, self.confidence_head(h_GH, head.markov_w1(prev_G))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> DSparkDraft:
        """Load a SGLang-layout drafter (`DraftBackbone.load`: the target's embed_tokens and
        lm_head are skipped too)."""
        return cls.load(DSparkConfig, path, dtype, device)
