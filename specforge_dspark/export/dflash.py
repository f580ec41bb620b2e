"""Serving export of a DFlash or DFlash2 draft: the SGLang DFLASH layout
(`--speculative-algorithm DFLASH`).

One directory, config.json + model.safetensors (bf16), as `sglang/srt/models/dflash.py`
`DFlashDraftModel` (or `DFlash2DraftModel`) loads it: `architectures`, `model_type:
"qwen3"`, `dflash_config` with `block_size`, `target_layer_ids`, `num_target_layers`,
`mask_token_id` (mirrored at the root; DFlash2 adds `selector_rank`, `selector_top_k` and
`output_multiplier`), `layer_types` and `sliding_window` at the root
(`dflash_utils.get_dflash_layer_types` / `get_dflash_attention_sliding_window_size`).
Weights `fc.weight`, `hidden_norm.weight`, `norm.weight`, `layers.{i}.self_attn.{q,k,v,o}_proj
.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`, `layers.{i}.mlp.{gate,up,down}_proj
.weight`, `layers.{i}.{input,post_attention}_layernorm.weight` (DFlash2: and
`candidate_selector.{predecessor,successor}_codebook`, `candidate_selector.
hidden_projection.weight`); SGLang's loader stacks q/k/v and gate/up itself and silently
skips unknown names, so tests compare the names and shapes with its own model's. No
embedding, no LM head (the target's are used), no speculators layout (served by SGLang
here). The `specforge_dspark` key records the conventions (slot, tap, layer ids, vocab)
as the DSpark export does.

DFlash2's `output_multiplier` is written as 1 / the target's muP multiplier: the engine
scales its unary logits `h @ W.T` by it, which makes them the `lm_head(h / mup)` we
train and decode with (drafters/dflash2.py).

    python -m specforge_dspark.cli.export --checkpoint RUN/ckpt/step-N --format sglang --out DIR
dispatches here when the checkpoint's recipe has `draft.kind: dflash` or `dflash2`.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch

from specforge_dspark.drafters import conventions as drafter_conventions
from specforge_dspark.drafters.dflash import DFlashConfig, DFlashDraft
from specforge_dspark.drafters.registry import KINDS, kind_of_dir
from specforge_dspark.export import ExportError
from specforge_dspark.export.sglang import write_sglang
from specforge_dspark.export.source import deepspeed_weights, resolve_checkpoint, step_recipe

SLOT_CONVENTION = (
    "dflash: block [x_a, MASK*(G-1)] at positions a..a+G-1; row i (1..G-1) predicts token a+i"
)


def conventions(cfg: DFlashConfig, target_path: str | Path | None = None) -> dict[str, Any]:
    """The conventions record of a DFlash draft (conventions.conventions with its slot rule)."""
    return drafter_conventions.conventions(
        cfg, target_path, sample_from_anchor=False, slot_convention=SLOT_CONVENTION
    )


def export_dflash(
    draft_or_state_dict: DFlashDraft | dict[str, torch.Tensor],
    cfg: DFlashConfig | None,
    out_dir: str | Path,
    target_path: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write the SGLang DFLASH layout of a DFlash or DFlash2 draft (its class by `cfg`'s
    type) to `out_dir` (replaced whole, atomically); returns it."""
    if isinstance(draft_or_state_dict, DFlashDraft):
        draft = draft_or_state_dict
    else:
        if cfg is None:
            raise ExportError("exporting a state_dict needs its DFlashConfig")
        with torch.device("meta"):
            draft = network_of(cfg)(cfg)
        try:
            draft.load_state_dict(draft_or_state_dict, strict=True, assign=True)
        except RuntimeError as e:
            raise ExportError(f"the weights do not fit the DFlash config: {e}") from None
    with torch.device("meta"):
        want = {k: v.shape for k, v in type(draft)(draft.config).state_dict().items()}
    bad = [k for k, v in draft.state_dict().items() if v.shape != want[k]]
    if bad:
        raise ExportError(f"tensors {bad[:3]} do not have their full shapes (ZeRO-3?)")
    if hasattr(draft.config, "output_multiplier") and target_path:  # the caller's draft kept
        from specforge_dspark.objective.frozen_head import mup_multiplier

        draft = copy.copy(draft)  # the same tensors, its own config
        scale = 1.0 / mup_multiplier(target_path)
        draft.config = dataclasses.replace(draft.config, output_multiplier=scale)
    return write_sglang(draft, out_dir, conventions(draft.config, target_path), dtype)


def network_of(cfg: DFlashConfig) -> type[DFlashDraft]:
    """The network class whose config class `cfg` is (drafters/registry.py)."""
    return next(k.network for k in KINDS.values() if type(cfg) is k.config)


def export_dflash_checkpoint(
    ckpt_dir: str | Path,
    fmt: str,
    out_dir: str | Path,
    target_path: str | Path | None = None,
    dtype: str | None = None,
) -> Path:
    """Export a DFlash / DFlash2 training checkpoint (or DFLASH export) as `fmt` ("sglang"
    only), its weights in `dtype` (default: the recipe's export.dtype)."""
    if fmt != "sglang":
        raise ExportError(
            f"--checkpoint {ckpt_dir}: a DFlash draft exports only as sglang (DFLASH), not {fmt}"
        )
    kind, resolved = resolve_checkpoint(Path(ckpt_dir))
    if kind == "export":
        draft = KINDS[kind_of_dir(resolved)].network.from_pretrained(resolved)
        return export_dflash(draft, None, out_dir, target_path, getattr(torch, dtype or "bfloat16"))
    recipe = step_recipe(resolved)
    cfg = KINDS[recipe.draft.kind].config.from_recipe(recipe.draft)
    weights = deepspeed_weights(resolved, recipe.dist.zero_stage)
    target = target_path or recipe.target.path or None
    weights_dtype = getattr(torch, dtype or recipe.export.dtype)
    return export_dflash(weights, cfg, out_dir, target, weights_dtype)
