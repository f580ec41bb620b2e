"""The draft's RoPE with the target's scaling (drafters/rope.py, config/rope.py).

SGLang's own get_rope (in .venv-sglang, its CPU engine) builds the cos/sin tables the
served draft uses from the export's rope_parameters; ours must equal them in fp32 at every
position, past the original context too. transformers' rotary embedding (the target's
side, in our venv) is checked as a second reference. Then: the export carries the scaling
and loads back, the recipe refuses what the draft cannot reproduce, init_recipe copies it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from specforge_dspark.drafters.rope import rope_tables

REPO = Path(__file__).resolve().parents[1]
SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
THETA, HEAD_DIM, ORIG = 100000.0, 64, 2048
POSITIONS = [0, 1, 7, 100, 1023, 2047, 2048, 5000, 8191, 20000]
SCALINGS = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIG},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": ORIG,
                    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707},
}  # fmt: skip

# Run by .venv-sglang's python: SGLang's get_rope for each scaling, its cache rows at POSITIONS.
SGLANG_TABLES = """
import json, sys, torch
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.utils.hf_transformers.common import get_rope_config
from types import SimpleNamespace
cfg = json.loads(sys.argv[1])
pos = torch.tensor(cfg["positions"])
out = {}
for name, params in cfg["rope_parameters"].items():
    theta, scaling = get_rope_config(SimpleNamespace(rope_parameters=params))  # as DSPARK reads
    rope = get_rope(cfg["head_dim"], cfg["head_dim"], cfg["max_position"], theta, True,
                    scaling, dtype=torch.float32)
    if hasattr(rope, "_ensure_cos_sin_cache_length"):
        rope._ensure_cos_sin_cache_length(int(pos.max()) + 1)
    out[name] = (type(rope).__name__, rope.cos_sin_cache[pos].float())
torch.save(out, cfg["out"])
"""


@pytest.fixture(scope="module")
def sglang_tables(tmp_path_factory) -> dict:
    from specforge_dspark.config.rope import rope_parameters

    out = tmp_path_factory.mktemp("rope") / "tables.pt"
    spec = {
        # 16384 positions: linear's table holds 16384 x factor rows; past its table SGLang
        # extends it unscaled (base.py), a length the draft is never served at
        "head_dim": HEAD_DIM, "max_position": 16384, "positions": POSITIONS, "out": str(out),
        "rope_parameters": {n: rope_parameters(THETA, s) for n, s in SCALINGS.items()},
    }  # fmt: skip
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(SGLANG_PY), "-c", SGLANG_TABLES, json.dumps(spec)],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def _ours(scaling: dict) -> torch.Tensor:
    cos, sin = rope_tables(torch.tensor([POSITIONS]), HEAD_DIM, THETA, torch.float32, scaling)
    return torch.cat((cos[0], sin[0]), dim=-1)  # [T, E]: SGLang's cos_sin_cache row layout


@pytest.mark.parametrize("name", list(SCALINGS))
def test_the_tables_equal_sglangs_get_rope_at_every_position(sglang_tables, name):
    cls, theirs = sglang_tables[name]
    kinds = {"default": "", "linear": "LinearScaling", "llama3": "Llama3"}
    expected = kinds.get(name, "YaRNScaling") + "RotaryEmbedding"
    assert cls == expected  # SGLang built the scaling we meant, not a plain RoPE
    ours = _ours(SCALINGS[name])
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()  # fp32, bit for bit
    if name != "default":  # the scaling changes the tables past the original context
        assert not torch.allclose(ours, _ours({}), atol=1e-3)


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn", "yarn_mscale"])
def test_the_tables_equal_transformers_rotary_embedding(name):
    """The target's side: a Llama with the same rope_parameters rotates the same way."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from specforge_dspark.config.rope import rope_parameters

    config = LlamaConfig(hidden_size=HEAD_DIM * 2, num_attention_heads=2, head_dim=HEAD_DIM,
                         max_position_embeddings=ORIG * 4,
                         rope_parameters=rope_parameters(THETA, SCALINGS[name]))  # fmt: skip
    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, len(POSITIONS), HEAD_DIM)
    cos, sin = rotary(x, torch.tensor([POSITIONS]))  # [1, T, E]: each half repeated
    theirs = torch.cat((cos[0, :, : HEAD_DIM // 2], sin[0, :, : HEAD_DIM // 2]), dim=-1)
    assert torch.allclose(_ours(SCALINGS[name]), theirs, rtol=0, atol=1e-5)


def test_the_export_carries_the_scaling_and_loads_back(tmp_path):
    from specforge_dspark.config.recipe import DraftRecipe
    from specforge_dspark.drafters.registry import load_draft, new_draft

    scaling = SCALINGS["yarn"]
    recipe = DraftRecipe(vocab_size=64, hidden_size=64, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, intermediate_size=96,
                         markov_rank=8, rope_scaling=scaling)  # fmt: skip
    draft = new_draft(recipe)
    draft.save_pretrained(tmp_path)
    params = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    assert params == {"rope_theta": recipe.rope_theta, **scaling}
    assert "rope_scaling" not in json.loads((tmp_path / "config.json").read_text())
    assert load_draft(tmp_path).config.rope_scaling == scaling


def test_the_recipe_refuses_a_scaling_the_draft_cannot_reproduce():
    from specforge_dspark.config.recipe import recipe_from_dict
    from specforge_dspark.config.sections import RecipeError

    def load(scaling):
        return recipe_from_dict({"draft": {"rope_scaling": scaling}, "train": {"output_dir": "x"}})

    with pytest.raises(RecipeError, match=r"draft.rope_scaling: rope_type 'dynamic' is not .*"):
        load({"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(RecipeError, match="rope_type 'yarn' needs original_max_position_emb"):
        load({"rope_type": "yarn", "factor": 4.0})
    assert load(SCALINGS["llama3"]).draft.rope_scaling == SCALINGS["llama3"]


def test_init_recipe_copies_the_targets_scaling():
    from specforge_dspark.cli.init_recipe import draft_section

    text = {"hidden_size": 128, "num_hidden_layers": 8, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 256,
            "vocab_size": 512,
            "rope_parameters": {"rope_theta": THETA, **SCALINGS["yarn"]}}  # fmt: skip
    draft = draft_section(text, "llama", "dspark", 0, 3, 5)
    assert draft["rope_theta"] == THETA and draft["rope_scaling"] == SCALINGS["yarn"]
    text["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA}
    assert "rope_scaling" not in draft_section(text, "llama", "dspark", 0, 3, 5)
