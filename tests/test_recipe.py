"""Strict recipe loading: every shipped recipe, typos, types, cross-field checks, overrides."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specforge_dspark.config.recipe import RecipeError, load_recipe, recipe_from_dict
from specforge_dspark.config.validate import dist_timeout_s
from tests.helpers import DATA_HERE

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"inkling_nvfp4.yaml", "tiny_cpu.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_and_builds_on_meta(path):
    from specforge_dspark.config.companions import companion_recipe
    from specforge_dspark.drafters.registry import new_draft

    recipe = load_recipe(path)
    for r in [recipe, *(companion_recipe(recipe, i) for i in range(len(recipe.companions)))]:
        with torch.device("meta"):
            draft = new_draft(r.draft)  # DSpark or DFlash by draft.kind
        assert sum(p.numel() for p in draft.parameters()) > 0
        assert draft.config.block_size == r.draft.block_size


def test_production_values_match_spec():
    r = load_recipe(REPO / "recipes" / "inkling_nvfp4.yaml")
    d, o = r.draft, r.objective
    assert (d.hidden_size, d.num_hidden_layers, d.num_attention_heads) == (6144, 5, 64)
    assert (d.num_key_value_heads, d.head_dim, d.intermediate_size) == (16, 64, 12288)
    assert (d.vocab_size, d.mask_token_id, d.block_size) == (201024, 200064, 7)
    assert d.target_layer_ids == [5, 17, 35, 47, 59] and d.num_target_layers == 66
    assert (d.markov_rank, d.markov_head_type, d.rope_theta) == (256, "vanilla", 8e6)
    assert (o.num_anchors, o.ce_weight, o.l1_weight, o.bce_weight, o.gamma) == (
        512,
        0.1,
        0.9,
        1.0,
        4.0,
    )
    p = r.optim
    assert (p.lr, p.warmup_ratio, p.grad_clip, p.scheduler) == (6e-4, 0.04, 1.0, "cosine")
    assert r.train.epochs == 10 and r.data.max_length == 4096
    sa = r.target.sglang.server_args
    assert sa["tp_size"] == 8 and sa["quantization"] == "modelopt_fp4"
    assert sa["page_size"] == 128 and sa["attention_backend"] == "fa4"


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_typo_names_key_and_suggests(tmp_path):
    p = _write(tmp_path, "objective:\n  num_anchor: 512\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert "objective.num_anchor" in msg and "did you mean objective.num_anchors" in msg
    assert str(p) in msg


def test_typo_in_section_name(tmp_path):
    with pytest.raises(RecipeError, match="unknown key objectve; did you mean objective"):
        load_recipe(_write(tmp_path, "objectve:\n  num_anchors: 512\n"))


def test_problems_are_collected_into_one_error(tmp_path):
    text = (
        "draft:\n  block_size: 1\n  mask_token_id: 5000\n  vocab_size: 1000\n"
        "  target_layer_ids: [0, 9]\n  num_target_layers: 4\n"
        "objective:\n  num_anchors: 0\n  ce_weight: -0.1\n"
        "optim:\n  lr: fast\n"
    )
    with pytest.raises(RecipeError) as e:
        load_recipe(_write(tmp_path, text))
    msg = str(e.value)
    for needle in (
        "draft.block_size must be >= 2",
        "draft.mask_token_id (5000) must be in [0, draft.vocab_size=1000)",
        "draft.target_layer_ids[1]=9 is outside the target's layers",
        "objective.num_anchors must be >= 1",
        "objective.ce_weight must be >= 0",
        "optim.lr: expected a number, got 'fast'",
        "target: missing section",
    ):
        assert needle in msg, needle
    assert "7 problem(s)" in msg


def test_exponent_notation_is_a_number_in_a_file_and_an_override(tmp_path):
    """PyYAML (YAML 1.1) reads `6e-3` as a string; a float field takes it as 0.006."""
    tiny = REPO / "recipes" / "tiny_cpu.yaml"
    text = tiny.read_text()
    assert "  lr: 2.0e-3\n" in text
    path = _write(tmp_path, text.replace("  lr: 2.0e-3\n", "  lr: 6e-3\n"))
    assert load_recipe(path).optim.lr == 0.006
    assert load_recipe(tiny, ["optim.lr=2E-4"]).optim.lr == 2e-4
    with pytest.raises(RecipeError, match="optim.lr: expected a number, got 'nan'"):
        load_recipe(tiny, ["optim.lr=nan"])


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"draft": {"num_attention_heads": 6, "num_key_value_heads": 4}}, "multiple of"),
        ({"draft": {"target_layer_ids": [1, 1]}}, "repeats layer(s) [1]"),
        ({"draft": {"target_layer_ids": [2, 0]}}, "must be ascending"),
        ({"draft": {"markov_head_type": "lstm"}}, "'lstm' is not one of"),
        ({"train": {"micro_batch_size": "2"}}, "train.micro_batch_size: expected an integer"),
        ({"target": {"backend": "offline"}}, "target.offline_dir must be set"),
        ({"export": {"formats": ["sglang", "onnx"]}}, "export.formats[1]: 'onnx'"),
        ({"draft": {"enable_confidence_head": "yes"}}, "expected true/false"),
        ({"dist": {"zero_stage": 4}}, "dist.zero_stage must be 0, 1 or 2"),
        ({"train": {"max_nonfinite_steps": 0}}, "train.max_nonfinite_steps must be >= 1"),
        ({"target": {"max_restarts": -1}}, "target.max_restarts must be >= 0"),
        ({"target": {"restart_backoff_s": -1}}, "target.restart_backoff_s must be >= 0"),
        ({"train": {"served_eval": {"num_prompts": -1}}}, "served_eval.num_prompts must be >= 0"),
        ({"train": {"served_eval": {"max_seconds": 0}}}, "served_eval.max_seconds must be > 0"),
        ({"train": {"served_eval": {"num_prompts": 2, "workloads": []}}}, "at least one workload"),
        (
            {"export": {"calibrate_prompts": 4, "formats": ["speculators"]}},
            "export.calibrate_prompts > 0 needs",
        ),
        ({"target": {"backend": "vllm", "vllm": {"prot": 1}}}, "did you mean target.vllm.port"),
        ({"target": {"vllm": {"server_args": []}}}, "target.vllm.server_args"),
        (
            {"draft": {"markov_head_type": "gated"}},
            "vLLM's DSpark (the speculators format) has only the vanilla Markov head",
        ),
        (
            {"target": {"backend": "sglang", "sglang": {"server_args": {"pp_size": 2}}}},
            "target.sglang.server_args.pp_size=2: pipeline parallelism has not run",
        ),
        (
            {"target": {"backend": "sglang", "sglang": {"server_args": {"dp_size": 2}}}},
            "target.sglang.server_args.dp_size=2: data parallelism inside the server",
        ),
        (
            {
                "target": {
                    "backend": "sglang",
                    "sglang": {"server_args": {"enable_dp_attention": True, "tp_size": 8}},
                }
            },
            "target.sglang.server_args.enable_dp_attention=True: DP attention has not run",
        ),
    ],
)
def test_bad_values(raw, needle):
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(raw)
    assert needle in str(e.value)


def test_overrides_are_checked_like_the_file():
    path = REPO / "recipes" / "tiny_cpu.yaml"
    r = load_recipe(path, ["objective.num_anchors=16", "optim.betas=[0.8, 0.9]"])
    assert r.objective.num_anchors == 16 and r.optim.betas == [0.8, 0.9]
    with pytest.raises(RecipeError, match="objective.num_anchors must be >= 1"):
        load_recipe(path, ["objective.num_anchors=0"])
    with pytest.raises(RecipeError, match="did you mean objective.chunk_size"):
        load_recipe(path, ["objective.chunk_sise=8"])
    with pytest.raises(RecipeError, match="expected key.sub=value"):
        load_recipe(path, ["objective.num_anchors"])


def test_section_hash_tracks_values():
    a = recipe_from_dict({})
    b = recipe_from_dict({"objective": {"num_anchors": 7}})
    assert a.section_hash("objective") != b.section_hash("objective")
    assert a.section_hash("draft") == b.section_hash("draft")


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--dry-run", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def test_dry_run_production_param_count():
    p = _dry_run("--recipe", "recipes/inkling_nvfp4.yaml")  # its data is made by regenerate
    assert p.returncode == 2 and "data.train_files[0]: no such file" in p.stderr, p.stderr
    assert "data/inkling_regenerated.jsonl" in p.stderr and "Traceback" not in p.stderr
    p = _dry_run("--recipe", "recipes/inkling_nvfp4.yaml", *DATA_HERE)
    assert p.returncode == 0, p.stderr
    assert "trainable_params: 1738783617" in p.stdout.splitlines()


def test_a_recipe_without_target_or_draft_is_refused_naming_the_section(tmp_path):
    lone = tmp_path / "lone.yaml"
    lone.write_text("train:\n  max_steps: 3\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(lone)
    assert "target: missing section (which model the drafter serves" in str(e.value)
    assert "draft: missing section (the drafter's shape" in str(e.value)
    p = _dry_run("--recipe", str(lone))
    assert p.returncode == 2 and "target: missing section" in p.stderr, p.stderr


def test_dry_run_bad_recipe_is_one_message_not_a_traceback(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text(
        (REPO / "recipes" / "tiny_cpu.yaml").read_text().replace("num_anchors:", "num_anchor:")
    )
    p = _dry_run("--recipe", str(bad))
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert "unknown key objective.num_anchor; did you mean objective.num_anchors?" in p.stderr


def _sglang(**over) -> dict:
    target = {"backend": "sglang", "max_restarts": 3, "restart_backoff_s": 1.0, "timeout_s": 100}
    target["sglang"] = {"startup_timeout_s": 600}
    for key, value in over.items():
        section, _, name = key.partition("__")
        (target if section == "target" else target.setdefault(section, {}))[name] = value
    return target


def test_restarts_that_may_outlast_dist_timeout_are_refused_naming_the_numbers():
    # 100 (detection) + 3 x (600 + 100 for the probe) + backoff 1 + 2 + 4 = 2207
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({"target": _sglang(), "dist": {"timeout_s": 2206}})
    assert (
        "dist.timeout_s=2206 is shorter than a lost server may keep its peers waiting in a "
        "collective: target.timeout_s=100 (detection) + target.max_restarts=3 x "
        "(target.sglang.startup_timeout_s=600 + target.timeout_s=100 for the probe) + backoff "
        "7 (target.restart_backoff_s) = 2207s; raise dist.timeout_s to at least 2207, or lower "
        "target.sglang.startup_timeout_s, target.timeout_s or target.max_restarts"
    ) in str(e.value)
    recipe_from_dict({"target": _sglang(), "dist": {"timeout_s": 2207}})  # fits exactly
    recipe_from_dict({"target": _sglang(target__max_restarts=0), "dist": {"timeout_s": 3}})
    attached = _sglang(sglang__url="http://127.0.0.1:1")  # not ours to restart
    recipe_from_dict({"target": attached, "dist": {"timeout_s": 3}})
    vllm = {"backend": "vllm", "vllm": {"startup_timeout_s": 600}}  # fails instead
    recipe_from_dict({"target": vllm, "dist": {"timeout_s": 3}})


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_served_recipe_fits_a_lost_server_in_dist_timeout(path):
    r = load_recipe(path)  # loading runs the check; this restates it independently
    if r.target.backend == "sglang" and not r.target.sglang.url:
        t, s = r.target, r.target.sglang
        worst = t.timeout_s + t.max_restarts * (s.startup_timeout_s + t.timeout_s)
        assert worst + t.restart_backoff_s * (2**t.max_restarts - 1) <= dist_timeout_s(r)
        assert s.startup_timeout_s >= 600, f"{path.name}: keep a long start-up"


def test_draft_init_normal_is_transformers_init():
    """draft.init=normal: every Linear and Embedding N(0, init_std) (Markov W2 included),
    biases 0, norms 1; torch: torch's layer init and a zero Markov W2; normal_backbone:
    normal but for the Markov head, which starts as torch's."""
    from torch import nn

    from specforge_dspark.drafters.registry import new_draft

    path = REPO / "recipes" / "tiny_cpu.yaml"
    torch.manual_seed(0)
    normal = new_draft(load_recipe(path, ["draft.init=normal", "draft.init_std=0.03"]).draft)
    torch.manual_seed(0)
    default = new_draft(load_recipe(path, ["draft.init=torch"]).draft)
    torch.manual_seed(0)
    backbone = new_draft(load_recipe(path, ["draft.init=normal_backbone"]).draft)
    for name, m in normal.named_modules():
        if isinstance(m, nn.Linear | nn.Embedding) and m.weight.numel() >= 4096:
            std = float(m.weight.detach().std())
            assert 0.027 < std < 0.033 and abs(float(m.weight.mean())) < 3e-3, (name, std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            assert not m.bias.any(), name
    assert all(bool((p == 1).all()) for n, p in normal.named_parameters() if "norm" in n)
    assert normal.markov_head.markov_w2.weight.abs().sum() > 0
    assert not default.markov_head.markov_w2.weight.any()
    assert float(default.markov_head.markov_w1.weight.detach().std()) > 0.5  # torch's N(0, 1)
    # normal_backbone: the Markov head as torch starts it, the rest as `normal`
    assert not backbone.markov_head.markov_w2.weight.any()
    assert float(backbone.markov_head.markov_w1.weight.detach().std()) > 0.5
    assert 0.018 < float(backbone.fc.weight.detach().std()) < 0.022
    with pytest.raises(RecipeError, match="draft.init"):
        load_recipe(path, ["draft.init=xavier"])


def test_norm_from_target_starts_the_draft_at_the_target_heads_input_scale(
    tiny_target_dir, tmp_path
):
    """draft.norm_from_target: the fresh draft's final norm is the target's (read by name
    from its safetensors, independently here); off: ones; a Gemma target is refused."""
    import json
    import shutil

    from safetensors import safe_open

    from specforge_dspark.training.drafters import construct_draft

    path = REPO / "recipes" / "tiny_cpu.yaml"
    on = [f"target.path={tiny_target_dir}", "draft.norm_from_target=true"]
    draft = construct_draft(load_recipe(path, on))
    (weights,) = tiny_target_dir.glob("*.safetensors")
    with safe_open(str(weights), "pt") as f:
        want = f.get_tensor("model.norm.weight").float()
    assert abs(float(want.mean()) - 1.0) > 0.5  # the target's scale is not the default
    assert torch.equal(draft.norm.weight.detach(), want)
    off = construct_draft(
        load_recipe(path, [f"target.path={tiny_target_dir}", "draft.norm_from_target=false"])
    )
    assert bool((off.norm.weight == 1).all())

    gemma = tmp_path / "gemma"
    shutil.copytree(tiny_target_dir, gemma)
    config = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps({**config, "model_type": "gemma3_text"}))
    with pytest.raises(ValueError, match="1 \\+ weight"):
        construct_draft(load_recipe(path, [f"target.path={gemma}", "draft.norm_from_target=true"]))
