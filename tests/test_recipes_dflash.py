"""The DFlash and Inkling-Small recipes: loaded, built on meta, parameter-counted; the
Inkling-Small speculators config matches the published drafter field by field, as parsed
by speculators 0.9.0 itself; its layer-id mapping is speculators' own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import train
from specforge_dspark.config.recipe import RecipeError, load_recipe
from specforge_dspark.drafters.conventions import CONVENTIONS_KEY
from specforge_dspark.drafters.dspark import DSparkConfig
from specforge_dspark.drafters.registry import new_draft
from specforge_dspark.export.speculators import speculators_config
from tests.helpers import DATA_HERE

REPO = Path(__file__).resolve().parents[1]
COUNTS = {  # trainable parameters, also printed by `train.py --dry-run` and in the README
    "inkling_nvfp4_dflash": 1_635_852_928,
    "inkling_nvfp4_dflash2": 1_661_977_216,
    "inkling_small_nvfp4": 1_361_278_721,
    "tiny_cpu_dflash": 344_960,
    "tiny_cpu_small": 414_753,
}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_recipe_loads_builds_on_meta_and_counts(name, capsys):
    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml")
    assert recipe.draft.block_size == 16
    with torch.device("meta"):
        draft = new_draft(recipe.draft)
    assert sum(p.numel() for p in draft.parameters()) == COUNTS[name]
    path = str(REPO / "recipes" / f"{name}.yaml")
    assert train.main(["--recipe", path, "--dry-run", *DATA_HERE]) == 0
    printed = capsys.readouterr().out
    assert f"trainable_params: {COUNTS[name]}" in printed
    for line in ("frozen head", "draft weights", "optimizer state", "activations"):
        assert line in printed
    if recipe.draft.kind != "dspark":
        assert set(draft.config.layer_types) == {"sliding_attention"}


def test_dflash2_production_is_dflash_production_plus_its_selector():
    d = load_recipe(REPO / "recipes/inkling_nvfp4_dflash2.yaml").draft
    selector = 2 * d.vocab_size * d.selector_rank + d.hidden_size * d.selector_rank
    assert COUNTS["inkling_nvfp4_dflash2"] - selector == COUNTS["inkling_nvfp4_dflash"]
    dflash = load_recipe(REPO / "recipes/inkling_nvfp4_dflash.yaml").draft
    same = {"kind": "dflash", "selector_rank": 0, "selector_top_k": 0}
    assert {**vars(d), **same} == {**vars(dflash), **same}


def test_dflash_production_is_dspark_production_without_its_heads():
    dspark = load_recipe(REPO / "recipes/inkling_nvfp4.yaml")
    with torch.device("meta"):
        full = sum(p.numel() for p in new_draft(dspark.draft).parameters())
    d = dspark.draft
    heads = 2 * d.vocab_size * d.markov_rank + d.hidden_size + d.markov_rank + 1
    assert full - heads == COUNTS["inkling_nvfp4_dflash"]


def test_recipe_checks_for_dflash():
    path = REPO / "recipes/tiny_cpu_dflash.yaml"
    with pytest.raises(RecipeError, match="bce_weight"):
        load_recipe(path, ["objective.bce_weight=1.0"])
    with pytest.raises(RecipeError, match="sliding_window"):
        load_recipe(path, ["draft.sliding_window=8"])
    with pytest.raises(RecipeError, match="draft.kind: dflash or dflash2"):
        load_recipe(path, ["draft.kind=dspark", "objective.bce_weight=1.0"])
    with pytest.raises(RecipeError, match="draft.selector_top_k"):
        load_recipe(path, ["draft.kind=dflash2", "draft.selector_top_k=0"])


PUBLISHED_SMALL = {  # the Inkling-Small-NVFP4 DSpark drafter (issue 14)
    "num_hidden_layers": 6,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "block_size": 16,
    "speculative_tokens": 16,
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "draft_vocab_size": 201024,
    "aux_hidden_state_layer_ids": [2, 10, 18, 26, 34, 39],
    "dtype": "bfloat16",
}


def test_inkling_small_speculators_config_is_the_published_drafters(tmp_path):
    from speculators.models.dspark import DSparkSpeculatorConfig

    recipe = load_recipe(REPO / "recipes/inkling_small_nvfp4.yaml")
    cfg = DSparkConfig.from_recipe(recipe.draft)
    raw = speculators_config(
        cfg,
        draft_vocab_size=recipe.draft.vocab_size,  # full: every LM-head row, no d2t
        target_hidden_size=recipe.draft.hidden_size,
        verifier="Inkling-Small-NVFP4",
        verifier_architectures=["InklingForConditionalGeneration"],
    )
    (tmp_path / "config.json").write_text(json.dumps(raw))
    parsed = DSparkSpeculatorConfig.from_pretrained(tmp_path)  # speculators' own parsing
    layer = parsed.transformer_layer_config
    got = {
        "num_hidden_layers": layer.num_hidden_layers,
        "hidden_size": layer.hidden_size,
        "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads,
        "block_size": parsed.block_size,
        "speculative_tokens": parsed.speculators_config.proposal_methods[0].speculative_tokens,
        "markov_rank": parsed.markov_rank,
        "markov_head_type": parsed.markov_head_type,
        "enable_confidence_head": parsed.enable_confidence_head,
        "confidence_head_with_markov": parsed.confidence_head_with_markov,
        "draft_vocab_size": parsed.draft_vocab_size,
        "aux_hidden_state_layer_ids": list(parsed.aux_hidden_state_layer_ids),
        "dtype": raw["dtype"],
    }
    assert got == PUBLISHED_SMALL
    assert parsed.sample_from_anchor is True
    assert raw[CONVENTIONS_KEY]["speculators_vocab"] == "full"  # no t2d / d2t


def test_layer_id_mapping_is_speculators_own(tmp_path):
    """speculators' DFlash converter maps a 0-based decoder-layer id k to its
    aux_hidden_state_layer_id k + 1 (`convert/dflash/converter.py`); our recipe's ids give
    the published drafter's aux ids through that same code."""
    from speculators.convert.dflash.converter import DFlashConverter

    recipe = load_recipe(REPO / "recipes/inkling_small_nvfp4.yaml")
    d = recipe.draft
    base = tmp_path / "verifier"
    base.mkdir()
    verifier = {"model_type": "qwen3", "hidden_size": d.hidden_size, "vocab_size": d.vocab_size}
    verifier |= {"num_hidden_layers": d.num_target_layers, "num_attention_heads": 32}
    (base / "config.json").write_text(json.dumps(verifier))
    source = {
        "model_type": "qwen3",
        "hidden_size": d.hidden_size,
        "num_hidden_layers": d.num_hidden_layers,
        "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads,
        "intermediate_size": d.intermediate_size,
        "vocab_size": d.vocab_size,
        "block_size": d.block_size,
        "dflash_config": {"target_layer_ids": d.target_layer_ids, "mask_token_id": 200064},
    }
    config = DFlashConverter()._build_config(source, str(base), None)
    assert list(config.aux_hidden_state_layer_ids) == PUBLISHED_SMALL["aux_hidden_state_layer_ids"]
