"""The two drafter kinds (`draft.kind`): network, loss and loader by kind, one small dict each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from specforge_dspark.recipe import DraftRecipe


def new_draft(draft: DraftRecipe) -> nn.Module:
    """A freshly initialised drafter of `draft.kind` (builds on the current default device)."""
    if draft.kind == "dflash":
        from specforge_dspark.drafters.dflash import DFlashConfig, DFlashDraft

        return DFlashDraft(DFlashConfig.from_recipe(draft))
    from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft

    return DSparkDraft(DSparkConfig.from_recipe(draft))


def load_draft(path: str | Path) -> nn.Module:
    """An exported SGLang-layout drafter, DSpark or DFlash by its `architectures`."""
    config = json.loads((Path(path) / "config.json").read_text())
    if "DFlashDraftModel" in (config.get("architectures") or []):
        from specforge_dspark.drafters.dflash import DFlashDraft

        return DFlashDraft.from_pretrained(path)
    from specforge_dspark.drafters.dspark import DSparkDraft

    return DSparkDraft.from_pretrained(path)


def loss_fn(kind: str):
    """`compute_loss` (DSpark) or `compute_dflash_loss` (same signature)."""
    if kind == "dflash":
        from specforge_dspark.objective.dflash import compute_dflash_loss

        return compute_dflash_loss
    from specforge_dspark.objective.dspark import compute_loss

    return compute_loss
