"""A DSpark export written by SpecForge (`specforge export --to hf`) says
`projector_type: "dspark"`; SGLang 0.5.23 builds the plain fc projector for every value
but "domino" (speculative/dflash_utils.py:734, models/dflash.py:923 and 987), and so do
we: such a config loads unchanged, "domino" is refused naming the key and SGLang's lines.
The config is written by hand here (no SpecForge code in this repository)."""

from __future__ import annotations

import json

import pytest
import torch

from specforge_dspark.drafters.dflash import DFlashConfig
from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft

TINY = dict(
    hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, intermediate_size=96, vocab_size=300, block_size=5,
    target_layer_ids=[0, 1, 2], num_target_layers=4, mask_token_id=9, markov_rank=8,
)  # fmt: skip


def _export(tmp_path, projector: str | None):
    torch.manual_seed(0)
    draft = DSparkDraft(DSparkConfig(**TINY))
    draft.save_pretrained(tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    if projector is not None:  # as SpecForge writes it: at the root and in dflash_config
        config["projector_type"] = projector
        config.setdefault("dflash_config", {})["projector_type"] = projector
    (tmp_path / "config.json").write_text(json.dumps(config))
    return draft


def test_a_specforge_dspark_export_loads_unchanged(tmp_path):
    ours = _export(tmp_path, "dspark")
    loaded = DSparkDraft.from_pretrained(tmp_path)
    assert loaded.config == ours.config
    for (name, a), (_, b) in zip(
        ours.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_the_domino_projector_is_refused_naming_the_key_and_sglangs_lines(tmp_path):
    _export(tmp_path, "domino")
    with pytest.raises(ValueError) as e:
        DSparkDraft.from_pretrained(tmp_path)
    msg = str(e.value)
    assert "projector_type='domino'" in msg and "speculative/dflash_utils.py:734" in msg
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["DFlashDraftModel"], block_size=16)
    with pytest.raises(ValueError, match="projector_type='domino' is not supported by DFlash"):
        DFlashConfig.from_dict(config)
