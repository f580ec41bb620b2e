"""The conventions a drafter directory or a training checkpoint records, and the check of
either against a recipe or target before a run starts from it or an export re-exports it
(the record itself: drafters/conventions.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specforge_dspark.config.recipe import Recipe, recipe_from_dict
from specforge_dspark.drafters.conventions import check_against, conventions, served_conventions
from specforge_dspark.drafters.dspark import DSparkConfig
from specforge_dspark.export.source import resolve_checkpoint


def recorded_conventions(path: str | Path) -> dict[str, Any]:
    """The conventions a drafter directory or training checkpoint records, as far as it
    records them (absent = unknown). An export's `specforge_dspark` record, with the draft
    fields its config root serves; a training checkpoint's recipe draft, with the tap of
    its features fingerprint. {} for anything else."""
    kind, resolved = resolve_checkpoint(Path(path))
    if kind == "training":
        state_file = resolved / "train_state.json"
        state = json.loads(state_file.read_text()) if state_file.is_file() else {}
        if "recipe" not in state:
            return {}
        recipe = recipe_from_dict(state["recipe"], source=str(state_file))
        record = conventions(DSparkConfig.from_recipe(recipe.draft))
        features = (state.get("fingerprint") or {}).get("features") or {}
        return record | {"tap_convention": features.get("tap_convention")}
    return served_conventions(resolved) if kind == "export" else {}


def check_conventions(
    path: str | Path, recipe: Recipe | None = None, target_path: str | Path | None = None
) -> None:
    """Refuse (ConventionsError naming the field and both values) a drafter directory or
    training checkpoint whose recorded conventions disagree with `recipe` or, without a
    recipe, with the target at `target_path` (drafters.conventions.check_against). Call it
    before loading a drafter to evaluate or to export again."""
    check_against(recorded_conventions(path), str(path), recipe, target_path)
