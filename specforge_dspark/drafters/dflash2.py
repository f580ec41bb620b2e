"""The DFlash2 drafter: the DFlash backbone (dflash.py) plus SGLang 0.5.23's candidate
selector, served by its DFLASH worker as `DFlash2DraftModel`.

Read from the installed engine (`sglang/srt/models/dflash.py` `CandidateSelector`,
`DFlash2DraftModel`; `speculative/dflash_worker_v2.py` `_selector_lattice`,
`_propose_selector_block`; `speculative/dflash_utils.py` ~635-650 for the keys):
- the backbone drafts rows 1..G-1 of the block [bonus, MASK * (G-1)] as DFlash does;
- row i's candidates are the top-K (`selector_top_k`) tokens of the target LM head over
  its final-normed hidden h_i, their logits the unary scores U_i (times
  `output_multiplier`, SGLang `_transform_unary_logits`);
- slot e (row e+1) scores the pair (predecessor p, candidate c) as
  `U_e[c] + <A[p] * P(h_e), B[c]>` with A = `predecessor_codebook` [V, r],
  B = `successor_codebook` [V, r], P = `hidden_projection` (H -> r, no bias); the
  predecessor of slot 0 is the bonus (anchor) token, of slot e the candidates of slot e-1;
- greedy decoding walks the lattice: slot 0 takes the argmax over its candidates, slot e
  the argmax of the row of the token slot e-1 took (`CandidateSelector.sample_path`,
  the greedy rows of its CPU branch; the Triton walk on GPUs computes the same path).
The weight names are SGLang's (`candidate_selector.*` beside the DFlash backbone's), so
this class extends `DFlashDraft` the way SGLang's `DFlash2DraftModel` extends its
`DFlashDraftModel`. Not modelled (refused on load, as for DFlash): grouped convolutions,
softcapped unary logits.

muP: the engine's unary logits are `h @ W.T` times `output_multiplier`; ours are the
harness's `logits_fn(h)` = `lm_head(h / mup)`. The exporter writes `output_multiplier =
1 / mup` (export/dflash.py), so both score the same candidates with the same values.

Shapes: X blocks, G drafted slots (block_size - 1), K candidates, P predecessors per slot,
r selector rank, H hidden, V vocab rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specforge_dspark.drafters.dflash import DFLASH_KEYS, DFlashConfig, DFlashDraft
from specforge_dspark.drafters.dflash import SUPPORTED_VALUES as DFLASH_VALUES
from specforge_dspark.drafters.io import config_reader, read_decoder_fields, sglang_config

ARCHITECTURE = "DFlash2DraftModel"
"""config.json `architectures` entry SGLang serves a DFlash2 drafter as."""
SELECTOR_KEYS = ("selector_rank", "selector_top_k", "output_multiplier")
SUPPORTED_VALUES = {
    k: v for k, v in DFLASH_VALUES.items() if k not in ("selector_rank", "output_multiplier")
}


@dataclass(kw_only=True)
class DFlash2Config(DFlashConfig):
    """A DFlash config plus the selector's keys (SGLang's `dflash_config` names)."""

    selector_rank: int = 32
    """r: width of the predecessor / successor codes."""
    selector_top_k: int = 8
    """K: candidates per slot, from the target LM head's top-K."""
    output_multiplier: float = 1.0
    """Engine-side scale of the unary logits (1 / the target's muP multiplier, written by
    the exporter); our side scores `logits_fn(h)`, which divides by it already."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.selector_rank <= 0 or self.selector_top_k <= 0:
            raise ValueError(
                "DFlash2Config.selector_rank and selector_top_k must be > 0, got "
                f"{self.selector_rank} and {self.selector_top_k}"
            )
        if self.selector_top_k > self.vocab_size:
            raise ValueError(
                f"DFlash2Config.selector_top_k ({self.selector_top_k}) exceeds vocab_size "
                f"({self.vocab_size})"
            )
        if self.output_multiplier <= 0:
            raise ValueError("DFlash2Config.output_multiplier must be > 0")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlash2Config:
        """Read a SGLang DFlash2 config.json (dflash_config wins over the root)."""
        nested = d.get("dflash_config") or {}
        get = config_reader(d, nested, root_wins=False)
        decoder = read_decoder_fields(d, get, SUPPORTED_VALUES, "DFlash2Draft", block_size=16)
        return cls(
            **decoder,
            sliding_window=int(d.get("sliding_window") or 0),
            selector_rank=int(get("selector_rank")),
            selector_top_k=int(get("selector_top_k")),
            output_multiplier=float(get("output_multiplier", 1.0)),
        )

    def to_dict(self) -> dict[str, Any]:
        """SGLang's DFlash2 layout: the DFlash one with `DFlash2DraftModel` and the selector
        keys in dflash_config (and the root)."""
        window = {"use_sliding_window": False}
        if "sliding_attention" in self.layer_types:
            window = {"use_sliding_window": True, "sliding_window": self.sliding_window}
        return sglang_config(
            self,
            ARCHITECTURE,
            DFLASH_KEYS + SELECTOR_KEYS,
            omit=("sliding_window",),
            after_fields=window,
        )


class CandidateSelector(nn.Module):
    """Pair scores over adjacent slots' candidates (SGLang's `CandidateSelector` names)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        # Both codes random: with either one zero, neither gets a gradient (a saddle).
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(
        self,
        pred_ids_XGP: torch.Tensor,
        cand_ids_XGK: torch.Tensor,
        unary_XGK: torch.Tensor,
        h_XGH: torch.Tensor,
    ) -> torch.Tensor:
        """`[X, G, P, K]`: unary[c] + <A[p] * P(h), B[c]> for each predecessor p and
        candidate c of each slot, in float32 (SGLang's `_score_edges`)."""
        proj_XGr = self.hidden_projection(h_XGH.to(self.hidden_projection.weight.dtype))
        a_XGPr = self.predecessor_codebook[pred_ids_XGP] * proj_XGr[:, :, None]
        b_XGKr = self.successor_codebook[cand_ids_XGK]
        pair_XGPK = torch.einsum("xgpr,xgkr->xgpk", a_XGPr.float(), b_XGKr.float())
        return unary_XGK.float()[:, :, None] + pair_XGPK


def greedy_walk(scores_GPK: torch.Tensor, cand_ids_GK: torch.Tensor) -> torch.Tensor:
    """The greedy path through one block's lattice (slot 0's predecessor row is its
    first): index_0 = argmax scores[0, 0], index_e = argmax scores[e, index_{e-1}];
    returns the G tokens."""
    index = scores_GPK[0, 0].argmax(-1)
    path = [index]
    for e in range(1, scores_GPK.shape[0]):
        index = scores_GPK[e, index].argmax(-1)
        path.append(index)
    return cand_ids_GK.gather(1, torch.stack(path)[:, None])[:, 0]


class DFlash2Draft(DFlashDraft):
    """DFlash backbone + `candidate_selector` (SGLang's weight names)."""

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__(config)
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, config.selector_rank, config.selector_top_k
        )
        self.use_selector = True
        """False: draft each row's argmax as DFlash does (the same checkpoint, selector
        off), to measure what the selector itself adds."""

    def drafts(
        self,
        h_DH: torch.Tensor,
        bonus_token: int | torch.Tensor,
        logits_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Greedy drafts as SGLang's DFLASH worker makes them for a DFlash2 draft (`propose`
        of the DFlash backbone calls this with rows 1..G-1): their top-K candidates, the
        selector's lattice over them, walked greedily (the backbone's argmax with the
        selector off)."""
        if not self.use_selector:
            return super().drafts(h_DH, bonus_token, logits_fn)
        unary_DK, cand_DK = logits_fn(h_DH).float().topk(self.candidate_selector.top_k, -1)
        bonus = torch.as_tensor(bonus_token, device=cand_DK.device).reshape(1, 1)
        pred_DK = torch.cat((bonus.expand(1, cand_DK.shape[1]), cand_DK[:-1]))
        scores = self.candidate_selector.scores(
            pred_DK[None], cand_DK[None], unary_DK[None], h_DH[None]
        )[0]
        return greedy_walk(scores, cand_DK)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        """Load a SGLang DFlash2 directory (`DFlashDraft.from_pretrained`'s checks)."""
        return cls.load(DFlash2Config, path, dtype, device)
