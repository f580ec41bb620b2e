"""The defaults pass their own checks (issue 60): a recipe that gives only what it must
(target path and backend, draft sizes, data) loads for every backend, raising a target
timeout needs no second edit, and every `cli.bench` subcommand's recipes build through the
strict loader, so that a future check cannot break a documented command silently."""

from __future__ import annotations

import importlib
import inspect

import pytest

from specforge_dspark.cli.bench import BENCHES
from specforge_dspark.config.recipe import Recipe, RecipeError, recipe_from_dict
from specforge_dspark.config.validate import DIST_TIMEOUT_FLOOR_S, dist_timeout_s, restart_budget_s

DRAFT = {
    "hidden_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "vocab_size": 1088,
    "target_layer_ids": [0, 1, 2], "num_target_layers": 4, "mask_token_id": 9,
    "markov_rank": 8,
}  # fmt: skip
NO_RECIPE = {"prepare": "times data_pipelines.prepare on a tokenizer, no training recipe"}


def minimal(tmp_path, backend: str, **target) -> dict:
    section = {"path": str(tmp_path / "target"), "backend": backend, **target}
    if backend == "offline":
        section["offline_dir"] = str(tmp_path / "shards")
    data = {"train_files": [str(tmp_path / "rows.jsonl")]}
    return {"target": section, "draft": DRAFT, "data": data}


@pytest.mark.parametrize("backend", ["hf", "sglang", "vllm", "offline"])
def test_a_minimal_recipe_loads_for_each_backend(tmp_path, backend):
    r = recipe_from_dict(minimal(tmp_path, backend))
    assert r.target.backend == backend and r.dist.timeout_s == 0  # auto
    assert dist_timeout_s(r) >= max(DIST_TIMEOUT_FLOOR_S, restart_budget_s(r))


def test_raising_a_target_timeout_needs_no_second_edit(tmp_path):
    """The bench's recipe (target.timeout_s 600) was refused by the old fixed default."""
    r = recipe_from_dict(minimal(tmp_path, "sglang", timeout_s=600))
    budget = 600 + 3 * (1800 + 600) + 7  # the defaults: 3 restarts, 1800 s start-up, backoff
    assert restart_budget_s(r) == budget and dist_timeout_s(r) == budget + 600
    explicit = minimal(tmp_path, "sglang", timeout_s=600) | {"dist": {"timeout_s": 7200}}
    with pytest.raises(RecipeError, match=f"dist.timeout_s=7200 is shorter .* = {budget}s"):
        recipe_from_dict(explicit)  # a value the recipe sets is still checked
    explicit["dist"]["timeout_s"] = budget
    assert dist_timeout_s(recipe_from_dict(explicit)) == budget


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_bench_subcommand_builds_its_recipes(name, tmp_path, tiny_target_dir, tiny_qwen3_dir):
    module = importlib.import_module(BENCHES[name][0])
    if name in NO_RECIPE:
        assert not hasattr(module, "recipes"), f"bench {name} builds recipes: test them"
        return
    targets = {"capture": tiny_qwen3_dir, "transport": tiny_qwen3_dir, "stream": tiny_target_dir}
    kwargs = (
        {"target": str(targets[name])}
        if "target" in inspect.signature(module.recipes).parameters
        else {}
    )
    recipes = module.recipes(tmp_path, **kwargs)
    assert recipes and all(isinstance(r, Recipe) for r in recipes)
    if name == "transport":  # the second engine attaches to the first's server by Mooncake
        started, attached = recipes
        assert attached.target.transport == "mooncake"
        assert attached.target.sglang.url.endswith(f":{started.target.sglang.port}")
