"""Typed training recipes: one dataclass per YAML section, loaded strictly.

A recipe is a YAML file whose top-level keys are the sections below. Every key is
checked: an unknown key fails with its dotted path and the closest valid key, wrong
types and cross-field problems are collected and reported together in one
`RecipeError`. Defaults live here and nowhere else. Command-line overrides
(`objective.num_anchors=256`) go through the same checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from specforge_dspark.config.companions import check_companions
from specforge_dspark.config.sections import (
    CheckpointRecipe,
    CompanionRecipe,
    DataRecipe,
    DistRecipe,
    DraftRecipe,
    ExportRecipe,
    ObjectiveRecipe,
    OptimRecipe,
    Recipe,
    RecipeError,
    ServedEvalRecipe,
    TargetRecipe,
    TrackingRecipe,
    TrainRecipe,
)
from specforge_dspark.config.strict_load import apply_override, build_dataclass
from specforge_dspark.config.validate import validate

__all__ = [  # the sections are imported from here by name (config/sections.py defines them)
    "CheckpointRecipe",
    "CompanionRecipe",
    "DataRecipe",
    "DistRecipe",
    "DraftRecipe",
    "ExportRecipe",
    "ObjectiveRecipe",
    "OptimRecipe",
    "Recipe",
    "RecipeError",
    "ServedEvalRecipe",
    "TargetRecipe",
    "TrackingRecipe",
    "TrainRecipe",
    "load_recipe",
    "recipe_from_dict",
    "resolved_dirs",
    "validate",
]


# --------------------------------------------------------------------------- loading

REQUIRED_SECTIONS = {
    "target": "which model the drafter serves, and how its features are read",
    "draft": "the drafter's shape, which must match the target's (aux layers, vocabulary)",
}
"""Sections a recipe file must have: their defaults describe no real target, and a run
on them would fail only once the target is built."""


def load_recipe(
    path: str | Path,
    overrides: list[str] | None = None,
    required: dict[str, str] = REQUIRED_SECTIONS,
) -> Recipe:
    """Load `path`, apply `key.sub=value` overrides, validate; raise RecipeError. The
    sections of `required` must be in the file (a tool that reads only some sections,
    such as the data pipelines, passes fewer)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: top level must be a mapping of sections")
    errors: list[str] = []
    for item in overrides or []:
        apply_override(raw, item, errors)
    recipe = build_dataclass(Recipe, raw, "", errors)
    errors += _cross_checks(recipe, errors)
    errors += [
        f"{name}: missing section ({why})" for name, why in required.items() if name not in raw
    ]
    if errors:
        raise RecipeError(_format(path, errors))
    recipe.source = str(path)
    return recipe


def recipe_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Recipe:
    """Build and validate a recipe from a plain dict (tests, tools)."""
    errors: list[str] = []
    recipe = build_dataclass(Recipe, raw, "", errors)
    errors += _cross_checks(recipe, errors)
    if errors:
        raise RecipeError(_format(Path(source), errors))
    recipe.source = source
    return recipe


def _cross_checks(recipe: Recipe, errors: list[str]) -> list[str]:
    """Cross-field problems, leaving out keys that already failed their type check."""
    bad = {m.split(":")[0].split()[-1].split("[")[0] for m in errors}
    found = validate(recipe) + check_companions(recipe)
    return [m for m in found if not any(b and b in m for b in bad)]


def _format(path: Path, errors: list[str]) -> str:
    lines = [f"recipe {path} has {len(errors)} problem(s):"]
    lines += [f"  - {e}" for e in errors]
    return "\n".join(lines)


# --------------------------------------------------------------------------- paths


def resolved_dirs(r: Recipe) -> dict[str, Path]:
    """Output folders with their documented defaults filled in."""
    out = Path(r.train.output_dir)
    return {
        "output": out,
        "checkpoint": Path(r.checkpoint.dir) if r.checkpoint.dir else out / "ckpt",
        "export": Path(r.export.dir) if r.export.dir else out / "export",
        "trackio": Path(r.tracking.dir) if r.tracking.dir else out / "trackio",
    }
