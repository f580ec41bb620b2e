"""The DFlash draft network (torch only, layers from `layers.py`) and its SGLang config.

A DFlash drafter is a DSpark drafter without the Markov and confidence heads, served with
SGLang 0.5.23's `--speculative-algorithm DFLASH` under ITS slot convention. Checked against
the installed source (where this file and DSPARK_SPEC.md differ, the engine wins):
- `sglang/srt/speculative/dflash_worker_v2.py` (draft step of `forward_batch_generation`):
  the block is [bonus, MASK * (G-1)] at positions seq_len .. seq_len+G-1 (seq_len = the
  committed tokens, whose target hidden states are in the draft's KV cache); the drafts are
  the greedy argmax of the target LM head over hidden rows 1..G-1 (`draft_hidden[:, 1:]`,
  raw `lm_head.weight`, every row), so one block yields G-1 drafts and the target verifies
  the G tokens [bonus, d_1 .. d_{G-1}].
  DSpark instead drafts from all G rows (slot k predicts a+k+1, prev-token Markov head):
  here row k (k >= 1) predicts the token at a+k and row 0 predicts nothing.
- muP: DFLASH does NOT divide the draft hidden by the target's
  `logits_mup_width_multiplier` (only the target's own logits are divided,
  `models/inkling.py:1139-1143`). Its drafts are `argmax(h @ W[:num_org].T)` of the raw
  final-normed hidden (`models/dflash.py:877-884`, no scale): eager
  `dflash_worker_v2.py:2803-2808` -> `_greedy_sample_from_vocab_parallel_head`, tp=1 at
  :1690; CUDA graphs `_DflashDraftSampler.__call__` :189-191. The draft's logits never
  enter a softmax there (greedy verify compares drafts with the target's argmax, :2227;
  sampling verify takes them as a point-mass chain, `dflash_utils.py:893-912`), and
  `output_multiplier` scales only the DFlash2 selector's logits (`models/dflash.py:1284-1291`;
  refused below). We train and decode `lm_head(h / mult)` (FrozenHead.logits): for
  mult > 0 its argmax IS the engine's draft (h / 4 is even exact in binary floating
  point), so training serves what the engine serves; the multiplier only sets the
  training softmax on the teacher's own logit scale. tests/test_serve_dflash.py checks
  `propose` against `_DflashDraftSampler` and serves an export with SGLang's DFLASH.
- context K/V (`_append_target_hidden_sequential`): each layer's k_proj/v_proj of the shared
  hidden_norm(fc(aux)) WITHOUT the layer's input_layernorm, then k_norm, then RoPE at the
  context positions: the same KV injection as DSpark (`layers.DecoderLayer`).
- `sglang/srt/models/dflash.py` `_get_dflash_layer_attention_params`: "full_attention"
  layers are ENCODER_ONLY (bidirectional inside the block), "sliding_attention" layers are
  DECODER (causal inside the block) with `sliding_window - 1` keys to the left
  (`dflash_utils.get_dflash_attention_sliding_window_size`: HF windows include the current
  token); `config.is_causal` would override both and is refused here.
- `dflash_utils.parse_dflash_draft_config` for the keys (`block_size`, `target_layer_ids`,
  `num_target_layers`, `mask_token_id` in `dflash_config` or at the root).
- noise embedding: the target's `get_input_embeddings()` (Inkling's outer model: the raw
  `embed_tokens`, as for DSpark); the worker's `noise_embed_scale` is 1 for our targets.
Not modelled (refused on load): grouped convolutions, selector / Domino / LiLiCorr heads,
attention sinks, V scaling, a draft-owned embedding.

Shape legend as in dspark.py (B batch, S context, N blocks, G block size, Q = N*G queries,
K = S + Q keys, H hidden, D = m*H aux features, V vocab rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specforge_dspark.drafters.backbone import DecoderFields, DraftBackbone
from specforge_dspark.drafters.io import (
    check_decoder_fields,
    config_reader,
    read_decoder_fields,
    sglang_config,
)
from specforge_dspark.drafters.layers import build_visibility_mask

ARCHITECTURE = "DFlashDraftModel"
"""config.json `architectures` entry SGLang serves a DFlash drafter as."""
LAYER_TYPES = ("full_attention", "sliding_attention")
DFLASH_KEYS = ("block_size", "target_layer_ids", "num_target_layers", "mask_token_id")
"""Keys SGLang's `parse_dflash_draft_config` reads; written in dflash_config and mirrored
at the root."""

# dflash_config / root settings SGLang honours that change the math: key -> allowed values.
SUPPORTED_VALUES: dict[str, tuple] = {
    "conv_kernel_size": (0,),
    "selector_rank": (0,),
    "attention_sink_bias": (False,),
    "attention_value_scale": (),
    "output_multiplier": (1.0,),
    "final_logit_softcapping": (0, 0.0),
    "is_causal": (),
    "use_gemma_norm": (False,),
    "attention_bias": (False,),
    "has_embed_tokens": (False,),
    "partial_rotary_factor": (1.0,),
}


@dataclass(kw_only=True)
class DFlashConfig(DecoderFields):
    """Architecture of a DFlash drafter; field names are those of SGLang's config.json."""

    block_size: int = 16
    layer_types: list[str] = field(default_factory=list)
    """One entry per layer, "full_attention" or "sliding_attention"; empty = all full."""
    sliding_window: int = 0
    """Keys a sliding layer's query sees, itself included (HF convention); 0 = none."""

    def __post_init__(self) -> None:
        check_decoder_fields(self)
        if self.block_size < 2:
            raise ValueError(f"DFlashConfig.block_size must be >= 2, got {self.block_size}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"DFlashConfig.layer_types: unknown {unknown}; use {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and self.sliding_window < self.block_size:
            raise ValueError(
                f"DFlashConfig.sliding_window ({self.sliding_window}) must be >= block_size "
                f"({self.block_size}) for sliding_attention layers"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        """Read a SGLang DFlash config.json; dflash_config wins over the root, as in
        `parse_dflash_draft_config`; defaults as in `io.read_decoder_fields`, block_size 16.
        Settings served with other math raise ValueError."""
        get = config_reader(d, d.get("dflash_config") or {}, root_wins=False)
        decoder = read_decoder_fields(d, get, SUPPORTED_VALUES, "DFlashDraft", block_size=16)
        return cls(**decoder, sliding_window=int(d.get("sliding_window") or 0))

    def to_dict(self) -> dict[str, Any]:
        """SGLang DFLASH layout: `DFlashDraftModel`, DFlash keys in dflash_config (and the
        root), `layer_types` + `sliding_window` (with `use_sliding_window`) at the root."""
        # transformers' Qwen3Config (which SGLang parses this file with) keeps
        # sliding_window only with use_sliding_window; layer_types are kept as given.
        window = {"use_sliding_window": False}
        if "sliding_attention" in self.layer_types:
            window = {"use_sliding_window": True, "sliding_window": self.sliding_window}
        return sglang_config(
            self, ARCHITECTURE, DFLASH_KEYS, omit=("sliding_window",), after_fields=window
        )


# --------------------------------------------------------------------------- masks


def build_dflash_masks(
    anchors_BN: torch.Tensor,
    block_valid_BN: torch.Tensor,
    ctx_valid_BS: torch.Tensor,
    block_size: int,
    sliding_window: int,
    starts_BN: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Visibility `[B, N*G, S + N*G]` (True = visible) per layer type.

    full_attention: `layers.build_visibility_mask` (context starts <= c < anchor,
    bidirectional inside the block). sliding_attention: that AND causal (key position <=
    query position) AND inside the window (key position >= query position -
    (sliding_window - 1)); the positions are a+k for slot k of the block anchored at a, c
    for context key c (row indices: inside one packed conversation their differences are
    those of its own positions).
    """
    full = build_visibility_mask(anchors_BN, block_valid_BN, ctx_valid_BS, block_size, starts_BN)
    masks = {"full_attention": full}
    if sliding_window > 0:
        B, N = anchors_BN.shape
        S, dev = ctx_valid_BS.shape[1], anchors_BN.device
        q_pos_BQ = (anchors_BN[..., None] + torch.arange(block_size, device=dev)).reshape(B, -1)
        k_pos_BK = torch.cat((torch.arange(S, device=dev).expand(B, S), q_pos_BQ), dim=1)
        delta_BQK = q_pos_BQ[:, :, None] - k_pos_BK[:, None, :]
        masks["sliding_attention"] = full & (delta_BQK >= 0) & (delta_BQK < sliding_window)
    return masks


# --------------------------------------------------------------------------- model


class DFlashDraft(DraftBackbone):
    """The DFlash drafter; submodule names are SGLang's weight names (`fc`, `hidden_norm`,
    `layers.{i}.*`, `norm`); no embedding, no LM head."""

    confidence_head = None

    @property
    def num_drafts(self) -> int:
        """Drafted tokens per block: G - 1 (row 0 is the bonus token)."""
        return self.config.block_size - 1

    def masks(
        self,
        anchors_BN: torch.Tensor,
        block_valid_BN: torch.Tensor,
        ctx_valid_BS: torch.Tensor,
        starts_BN: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        cfg = self.config
        window = cfg.sliding_window if "sliding_attention" in cfg.layer_types else 0
        return build_dflash_masks(
            anchors_BN, block_valid_BN, ctx_valid_BS, cfg.block_size, window, starts_BN
        )

    def apply_heads(
        self, h_BNGH: torch.Tensor, base_logits_BNGV: torch.Tensor, prev_BNG: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """DFlash has no Markov or confidence head: the base logits are the draft logits."""
        return base_logits_BNGV, None

    @torch.no_grad()
    def propose(
        self,
        ctx_1SH: torch.Tensor,
        ctx_len: int,
        bonus_token: int | torch.Tensor,
        embed_fn: Callable[[torch.Tensor], torch.Tensor],
        logits_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, None]:
        """Greedy drafts of one block as SGLang's DFLASH worker makes them: draft i
        (i = 1 .. G-1) = argmax logits_fn(h[i]) of `block_hidden`, the guess for the
        token at ctx_len + i. Returns (G-1 drafts, None)."""
        h_GH = self.block_hidden(ctx_1SH, ctx_len, bonus_token, embed_fn)
        return self.drafts(h_GH[1:], bonus_token, logits_fn), None

    def drafts(
        self,
        h_DH: torch.Tensor,
        bonus_token: int | torch.Tensor,
        logits_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The D = G-1 drafts of the drafting rows' hidden `[D, H]`: each row's argmax."""
        return logits_fn(h_DH).argmax(-1)

    def block_hidden(
        self,
        ctx_1SH: torch.Tensor,
        ctx_len: int,
        bonus_token: int | torch.Tensor,
        embed_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Final-normed hidden rows `[G, H]` of the block [bonus, MASK * (G-1)] at
        positions ctx_len .. ctx_len+G-1 over context positions 0 .. ctx_len-1."""
        G, device = self.config.block_size, ctx_1SH.device
        ids_G = torch.full((G,), self.config.mask_token_id, device=device)
        ids_G[0] = torch.as_tensor(bonus_token, device=device).reshape(())
        masks = self.masks(
            torch.tensor([[ctx_len]], device=device),
            torch.ones(1, 1, dtype=torch.bool, device=device),
            torch.ones(1, ctx_len, dtype=torch.bool, device=device),
        )
        return self(
            ctx_1SH[:, :ctx_len],
            torch.arange(ctx_len, device=device)[None],
            embed_fn(ids_G)[None, None],
            (ctx_len + torch.arange(G, device=device))[None, None],
            masks,
        )[0, 0]

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> DFlashDraft:
        """Load a SGLang DFLASH directory (`DraftBackbone.load`)."""
        return cls.load(DFlashConfig, path, dtype, device)
