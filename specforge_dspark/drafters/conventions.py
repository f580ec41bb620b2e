"""The conventions record every drafter export carries (config.json key
`"specforge_dspark"`, kept by SGLang's, transformers' and speculators' config parsers), and
the check of a drafter against its recipe and target: `format_version`, the slot
(`sample_from_anchor`, `slot_convention`), `tap_convention` (engines/tap.py), the layer ids
and their convention, `mask_token_id`, `logical_vocab`, `vocab_rows` (LM-head rows),
`mup_multiplier` and where it is applied (`mup_folded_into`: null = by the server,
"norm.weight", "lm_head.weight"); speculators adds `speculators_vocab`. Target facts are
null when exported without a target; null is never compared. A disagreement raises
ConventionsError naming the field and both values. export/conventions.py also reads what a
training checkpoint records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specforge_dspark.drafters.dflash import DFlashConfig
from specforge_dspark.drafters.dspark import DSparkConfig
from specforge_dspark.drafters.registry import KINDS, kind_of_dir
from specforge_dspark.engines.tap import tap_convention
from specforge_dspark.objective.frozen_head import config_value, logical_vocab

if TYPE_CHECKING:
    from specforge_dspark.config.recipe import Recipe

CONVENTIONS_KEY = "specforge_dspark"
"""The config.json entry every export layout carries: it also marks a directory as an
earlier export, which an export may replace (export.publish)."""


class ConventionsError(ValueError):
    """A drafter made for another target or draft setting; the message names the field."""


CONVENTIONS_VERSION = 1
"""Version of the conventions record; a record of another version is refused."""
SLOT_CONVENTION = "slot k of the block anchored at position a predicts token a+k+1"
LAYER_ID_CONVENTION = (
    "target_layer_ids: decoder layer k output (0-based); "
    "aux_hidden_state_layer_ids: k+1 (hidden-states index, 0 = embeddings)"
)
CHECKED = (
    "format_version",
    "sample_from_anchor",
    "slot_convention",
    "tap_convention",
    "layer_id_convention",
    "target_layer_ids",
    "num_target_layers",
    "mask_token_id",
    "logical_vocab",
    "vocab_rows",
    "mup_multiplier",
)
"""Conventions compared between a record and the recipe / target at hand."""


def conventions(
    cfg: DSparkConfig | DFlashConfig,
    target_path: str | Path | None = None,
    *,
    sample_from_anchor: bool = True,
    slot_convention: str = SLOT_CONVENTION,
) -> dict[str, Any]:
    """The conventions record (module docstring) of a draft served against a target; the
    target's facts (tap, logical vocab, muP multiplier) are None without `target_path`.
    Reads the target's config.json (and tokenizer.json), never its weights. The slot
    defaults are DSpark's; DFlash passes its own."""
    record: dict[str, Any] = {
        "format_version": CONVENTIONS_VERSION,
        "sample_from_anchor": sample_from_anchor,
        "slot_convention": slot_convention,
        "tap_convention": None,
        "layer_id_convention": LAYER_ID_CONVENTION,
        "target_layer_ids": list(cfg.target_layer_ids),
        "aux_hidden_state_layer_ids": [k + 1 for k in cfg.target_layer_ids],
        "num_target_layers": cfg.num_target_layers,
        "mask_token_id": cfg.mask_token_id,
        "logical_vocab": None,
        "vocab_rows": cfg.vocab_size,
        "mup_multiplier": None,
    }
    if target_path:
        record |= target_conventions(Path(target_path), cfg.vocab_size)
    return record


def target_conventions(root: Path, vocab_rows: int | None) -> dict[str, Any]:
    """tap, logical vocab and muP multiplier of a target, from its config.json (and
    tokenizer.json); refuses a target whose LM-head rows are not `vocab_rows`."""
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ConventionsError(f"target {root}: no config.json")
    config = json.loads(config_file.read_text())
    rows = int(config_value(config, "vocab_size") or vocab_rows)
    if vocab_rows is not None and rows != vocab_rows:
        raise ConventionsError(
            f"vocab_rows: the target {root} has {rows} LM-head rows (config.json "
            f"vocab_size), the draft has {vocab_rows}"
        )
    mult = config_value(config, "logits_mup_width_multiplier")
    return {
        "tap_convention": tap_convention(config),
        "logical_vocab": logical_vocab(root, config, rows),
        "mup_multiplier": 1.0 if mult is None else float(mult),
    }


def check_recorded(recorded: dict[str, Any], want: dict[str, Any], there: str, here: str) -> None:
    """Refuse a `recorded` convention (from `there`) that differs from `want` (for `here`);
    a convention either side leaves None is not compared."""
    for key in CHECKED:
        got, expected = recorded.get(key), want.get(key)
        if got is not None and expected is not None and got != expected:
            raise ConventionsError(
                f"conventions: {key} is {got!r} in {there} but {expected!r} for {here}; "
                "it was made for a different target or draft setting"
            )


def served_conventions(export_dir: str | Path) -> dict[str, Any]:
    """The conventions an exported drafter directory records (its `specforge_dspark`
    record, with the draft fields its config root serves); {} without a config.json."""
    config_file = Path(export_dir) / "config.json"
    if not config_file.is_file():
        return {}
    config = json.loads(config_file.read_text())
    drafter = kind_of_dir(Path(export_dir))  # the DFlash kinds never draft from the anchor
    if "speculators_model_type" in config:
        aux = config.get("aux_hidden_state_layer_ids")
        served = {
            "mask_token_id": config.get("mask_token_id"),
            "target_layer_ids": None if aux is None else [k - 1 for k in aux],
            "vocab_rows": (config.get("transformer_layer_config") or {}).get("vocab_size"),
        }
    else:  # the draft fields SGLang serves, from the config root
        cfg = KINDS[drafter].config.from_dict(config)
        served = {
            "target_layer_ids": cfg.target_layer_ids,
            "num_target_layers": cfg.num_target_layers,
            "mask_token_id": cfg.mask_token_id,
            "vocab_rows": cfg.vocab_size,
        }
    served["sample_from_anchor"] = config.get("sample_from_anchor", drafter == "dspark")
    return (config.get(CONVENTIONS_KEY) or {}) | {k: v for k, v in served.items() if v is not None}


def check_against(
    recorded: dict[str, Any],
    there: str,
    recipe: Recipe | None = None,
    target_path: str | Path | None = None,
) -> None:
    """Refuse conventions `recorded` in `there` that disagree with `recipe` (its draft:
    slot, layer ids, mask token, LM-head rows; its target: tap, logical vocab, muP) or,
    without a recipe, with the target at `target_path` (default: the recipe's
    `target.path`)."""
    target = target_path or (recipe.target.path if recipe is not None else None) or None
    if recipe is not None:
        want = conventions(DSparkConfig.from_recipe(recipe.draft), target)
        here = f"recipe {recipe.source or '<dict>'}"
    else:
        want = (
            {} if target is None else target_conventions(Path(target), recorded.get("vocab_rows"))
        )
        here = f"target {target}"
    check_recorded(recorded, want, there, here)
