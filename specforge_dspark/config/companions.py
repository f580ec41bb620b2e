"""Companion drafters: the full recipe of each drafter a recipe's `companions` list names.

A companion is trained in the same job as the recipe's own drafter, from the same feature
stream: the same target, data, steps, anchors and seed. Its `draft`, `objective`, `optim`
and `export` sections are overlays on the recipe's own, key by key (a key it leaves out
keeps the recipe's value); everything else is the recipe's. Its output folder is
`<train.output_dir>/companions/<name>` (checkpoints, exports, metrics.jsonl); its trackio
metrics are the job's run's, prefixed `<name>/`.

One capture feeds every drafter, so a companion's aux layers (draft.target_layer_ids,
num_target_layers), hidden size and vocabulary must be the recipe's.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

from specforge_dspark.config.sections import (
    DraftRecipe,
    ExportRecipe,
    ObjectiveRecipe,
    OptimRecipe,
    Recipe,
)
from specforge_dspark.config.strict_load import build_dataclass
from specforge_dspark.config.validate import validate

OVERLAID = {
    "draft": DraftRecipe,
    "objective": ObjectiveRecipe,
    "optim": OptimRecipe,
    "export": ExportRecipe,
}
"""The sections a companion may change, and their dataclasses."""

SHARED_DRAFT_KEYS = ("target_layer_ids", "num_target_layers", "hidden_size", "vocab_size")
"""What the one capture fixes for every drafter: the aux layers and the target's shapes."""

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def companion_dir(recipe: Recipe, name: str) -> Path:
    return Path(recipe.train.output_dir) / "companions" / name


def companion_recipe(recipe: Recipe, index: int, errors: list[str] | None = None) -> Recipe:
    """The full recipe of `recipe.companions[index]`. Problems go to `errors` (each naming
    `companions[index].<section>.<key>`); without `errors`, they raise ValueError."""
    out: list[str] = [] if errors is None else errors
    c = recipe.companions[index]
    where = f"companions[{index}]"
    sections = {}
    for name, cls in OVERLAID.items():
        base = dataclasses.asdict(getattr(recipe, name))
        if name == "export":
            base["dir"] = ""  # never the recipe's own export folder
        raw = {**base, **copy.deepcopy(getattr(c, name))}
        sections[name] = build_dataclass(cls, raw, f"{where}.{name}.", out)
    companion = dataclasses.replace(
        copy.deepcopy(recipe),
        **sections,
        companions=[],
        train=dataclasses.replace(recipe.train, output_dir=str(companion_dir(recipe, c.name))),
        checkpoint=dataclasses.replace(recipe.checkpoint, dir=""),
    )
    companion.source = recipe.source
    if errors is None and out:
        raise ValueError("; ".join(out))
    return companion


def check_companions(recipe: Recipe) -> list[str]:
    """Every problem of the `companions` list, each naming its `companions[i]` key."""
    errors: list[str] = []
    seen: set[str] = set()
    for i, c in enumerate(recipe.companions):
        where = f"companions[{i}]"
        if not NAME.fullmatch(c.name):
            errors.append(
                f"{where}.name: {c.name!r} must be a folder name (letters, digits, _ . -)"
            )
            continue
        if c.name in seen:
            errors.append(f"{where}.name: {c.name!r} is used twice")
            continue
        seen.add(c.name)
        found: list[str] = []
        companion = companion_recipe(recipe, i, found)
        if found:
            errors += found
            continue
        for key in SHARED_DRAFT_KEYS:
            mine, theirs = getattr(companion.draft, key), getattr(recipe.draft, key)
            if mine != theirs:
                errors.append(
                    f"{where}.draft.{key}: {mine!r} differs from draft.{key} ({theirs!r}); "
                    "one capture feeds every drafter, so it must be the same"
                )
        errors += [f"{where} ({c.name}): {m}" for m in validate(companion)]
    return errors
