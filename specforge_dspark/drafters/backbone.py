"""What every drafter kind shares (torch only): the decoder fields of its config and the
network around the decoder layers. SGLang serves both kinds with the same module names:
`fc` -> `hidden_norm` over the concatenated aux features, `layers.{i}.*`, the final `norm`
(`sglang/srt/models/dflash.py` `DFlashDraftModel`; dspark.py's docstring lists the files
checked). A kind adds its heads and its slot convention on top (dspark.py, dflash.py).

Shape legend as in dspark.py (B batch, S context, N blocks, G block size, Q = N*G queries,
K = S + Q keys, H hidden, D = m*H aux features).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specforge_dspark.drafters.io import (
    context_features,
    from_attributes,
    load_checked,
    read_config,
    save_layout,
)
from specforge_dspark.drafters.layers import (
    Attend,
    ContextKV,
    DecoderLayer,
    Masks,
    RMSNorm,
    context_kv,
    decode_blocks,
)

if TYPE_CHECKING:
    from specforge_dspark.config.recipe import DraftRecipe


@dataclass(kw_only=True)
class DecoderFields:
    """The config fields every drafter kind has; names are those of SGLang's config.json."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)
    """The target's RoPE scaling (drafters/rope.py); written into rope_parameters."""
    max_position_embeddings: int = 32768
    vocab_size: int
    """Rows of the target LM head (padded vocabulary)."""
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int

    @classmethod
    def from_recipe(cls, draft: DraftRecipe):
        """From a `recipe.DraftRecipe` (or anything with the same attribute names); the
        fields another kind's recipe leaves out keep their defaults."""
        return from_attributes(cls, draft)


class DraftBackbone(nn.Module):
    """The aux-feature projection, the decoder layers and the final norm; no embedding and
    no LM head (callers pass the frozen target's embeddings in and project through its
    head). A kind subclasses it with its heads, `num_drafts`, `masks` and `propose`."""

    LOAD_SKIPS: tuple[str, ...] = ("rotary_emb.",)
    """Tensor name prefixes a checkpoint may hold that the drafter does not load."""

    def __init__(self, config: DecoderFields) -> None:
        super().__init__()
        self.config = config
        H, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, eps)

    def context(self, aux_hidden_BSD: torch.Tensor) -> torch.Tensor:
        """Shared context features `[B, S, H]` = hidden_norm(fc(aux)), D = m*H."""
        return context_features(self.fc, self.hidden_norm, aux_hidden_BSD)

    def context_kv(self, ctx_BSH: torch.Tensor, ctx_pos_BS: torch.Tensor) -> ContextKV:
        """Each layer's context keys and values (`layers.context_kv`), for `decode`."""
        return context_kv(self, ctx_BSH, ctx_pos_BS)

    def decode(
        self,
        kv_ctx: ContextKV,
        block_emb_BNGH: torch.Tensor,
        block_pos_BNG: torch.Tensor,
        masks: Masks,
        attend: Attend | None = None,
        ranks: int = 1,
    ) -> torch.Tensor:
        """Final-normed hidden states `[B, N, G, H]` of every block row over the context
        of `kv_ctx` (`forward`'s other arguments; `attend`, `ranks`: `decode_blocks`)."""
        return decode_blocks(self, kv_ctx, block_emb_BNGH, block_pos_BNG, masks, attend, ranks)

    def forward(
        self,
        ctx_BSH: torch.Tensor,
        ctx_pos_BS: torch.Tensor,
        block_emb_BNGH: torch.Tensor,
        block_pos_BNG: torch.Tensor,
        masks: Masks,
    ) -> torch.Tensor:
        """Final-normed hidden states `[B, N, G, H]` of every block row.

        block_emb: frozen target embeddings of each block's tokens; keys are the S context
        positions then the N*G block positions; `masks` from `self.masks`. A query with no
        visible key gets attention output 0.
        """
        kv_ctx = self.context_kv(ctx_BSH, ctx_pos_BS)
        return self.decode(kv_ctx, block_emb_BNGH, block_pos_BNG, masks)

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """SGLang layout: config.json + model.safetensors (no embedding, no LM head)."""
        save_layout(self, self.config.to_dict(), path, dtype)

    @classmethod
    def load(cls, config_cls: type, path: str | Path, dtype: torch.dtype, device):
        """`cls` built from `config_cls.from_dict(config.json)` and loaded: like SGLang, a
        leading "model." is stripped and LOAD_SKIPS are skipped; any other name or shape
        that does not fit raises ValueError naming it (`io.load_checked`)."""
        with torch.device("meta"):
            model = cls(config_cls.from_dict(read_config(path)))
        return load_checked(model, path, cls.LOAD_SKIPS, device, dtype)
