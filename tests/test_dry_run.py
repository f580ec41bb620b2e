"""`train.py --dry-run` on served targets: the launch arguments are checked by the engine
itself, naming the recipe key it refuses; `objective.recompute: auto` sizes against what
a co-located server leaves of the GPU (device memory mocked: no GPU needed)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import train
from specforge_dspark.config.recipe import load_recipe
from specforge_dspark.drafters.registry import new_draft
from specforge_dspark.training import memory

REPO = Path(__file__).resolve().parents[1]
TINY_SGLANG = str(REPO / "recipes" / "tiny_cpu_sglang.yaml")
HERE = f"target.sglang.python={sys.executable}"  # the trainer's venv: sglang, no torchvision


def test_dry_run_has_sglang_parse_the_server_args_and_names_a_bad_key(capsys):
    assert train.main(["--recipe", TINY_SGLANG, "--dry-run", HERE]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("server_args: SGLang 0.5.23: parsed")
    bad = "target.sglang.server_args.no_such_option=1"
    assert train.main(["--recipe", TINY_SGLANG, "--dry-run", HERE, bad]) == 2
    err = capsys.readouterr().err
    assert "error: target.sglang.server_args.no_such_option: SGLang refuses" in err
    assert "unrecognized arguments: --no-such-option 1" in err and "Traceback" not in err


def test_dry_run_names_a_server_arg_the_backend_sets_without_starting_sglang(capsys):
    assert train.main(["--recipe", TINY_SGLANG, "--dry-run", "target.sglang.server_args.port=1"])
    assert "target.sglang.server_args.port is set by target.sglang.port" in capsys.readouterr().err


def test_a_recipe_whose_data_is_still_to_be_made_is_sized_then_refused(capsys):
    """The production recipe on a fresh clone: its regenerated data does not exist yet. The
    dry run still prints the sizes, then refuses naming the key and how to make the file."""
    prod = str(REPO / "recipes" / "inkling_nvfp4.yaml")
    assert train.main(["--recipe", prod, "--dry-run", "--world-size", "8", HERE]) == 2
    out, err = capsys.readouterr()
    assert "memory per rank (estimate from shapes; 8 rank(s)" in out
    assert "server_args: SGLang 0.5.23: parsed" in out  # the other checks ran first
    assert "error: data.train_files[0]: no such file data/inkling_regenerated.jsonl" in err
    assert "python -m data_pipelines.regenerate --recipe" in err


def test_hf_recipes_have_no_server_args_to_check(capsys):
    assert train.main(["--recipe", str(REPO / "recipes" / "tiny_cpu.yaml"), "--dry-run"]) == 0
    assert "server_args" not in capsys.readouterr().out


def test_a_missing_engine_venv_is_named_with_the_make_target_that_makes_it(capsys):
    argv = ["--recipe", TINY_SGLANG, "--dry-run", "target.backend=vllm"]
    assert train.main([*argv, "target.vllm.python=/nowhere/bin/python"]) == 0  # ours lacks vLLM
    out = capsys.readouterr().out
    assert "not checked by vLLM" in out and "`make vllm-venv` makes the environment" in out


@pytest.mark.slow
@pytest.mark.server  # the engines' own venvs (make test installs them)
@pytest.mark.parametrize(
    "engine, bad, said",
    [
        ("sglang", "tp_size=two", "target.sglang.server_args.tp_size: SGLang refuses"),
        ("vllm", "no_such_option=1", "target.vllm.server_args.no_such_option: vLLM refuses"),
    ],
)
def test_dry_run_checks_in_the_engines_own_venv(engine, bad, said, capsys):
    """In .venv-sglang SGLang also resolves the arguments (its model-independent hooks)."""
    python = REPO / f".venv-{engine}" / "bin" / "python"
    assert python.is_file(), f"no {python}: run `make {engine}-venv` (make test does)"
    argv = ["--recipe", TINY_SGLANG, "--dry-run", f"target.backend={engine}"]
    argv.append(f"target.{engine}.python={python}")
    assert train.main(argv) == 0
    done = "parsed and resolved" if engine == "sglang" else "parsed and validated"
    assert done in capsys.readouterr().out
    assert train.main([*argv, f"target.{engine}.server_args.{bad}"]) == 2
    assert said in capsys.readouterr().err


# --------------------------------------------------------------------------- recompute


@pytest.fixture
def gpu(monkeypatch):
    """A fake CUDA device of `gpu.total` bytes."""
    fake = SimpleNamespace(total=80 * 10**9)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=fake.total)
    )
    return fake


def _served(backend: str, **server_args):
    r = load_recipe(REPO / "recipes" / "tiny_cpu_sglang.yaml", [f"target.backend={backend}"])
    r.target.device = "cuda"
    getattr(r.target, backend).server_args = server_args
    return r


def test_a_co_located_server_leaves_the_trainer_its_complement(gpu):
    r = _served("sglang", mem_fraction_static=0.55)
    left, what = memory.available_bytes("cuda", r)
    assert left == pytest.approx(0.45 * gpu.total)
    assert "target.sglang.server_args.mem_fraction_static 0.55" in what
    vllm = _served("vllm")  # vLLM's default gpu_memory_utilization
    assert memory.available_bytes("cuda", vllm)[0] == pytest.approx(0.08 * gpu.total, rel=1e-6)
    r.target.sglang.url = "http://elsewhere:30000"  # an attached server is not on this GPU
    assert memory.available_bytes("cuda", r) == (gpu.total, "")
    assert memory.available_bytes("cuda", load_recipe(REPO / "recipes" / "tiny_cpu.yaml"))[0]
    unset = _served("sglang")  # SGLang sizes its share from the GPU: unknown here
    assert memory.available_bytes("cuda", unset)[0] is None
    assert (
        "set target.sglang.server_args.mem_fraction_static"
        in memory.available_bytes("cuda", unset)[1]
    )


def test_recompute_auto_is_decided_against_what_the_server_leaves(gpu):
    alone = _served("sglang", mem_fraction_static=0.55)
    alone.objective.recompute = "auto"
    with torch.device("meta"):
        draft = new_draft(alone.draft)
    n = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    need = memory.total_bytes(memory.estimate(alone, n, 1, recompute=False))
    gpu.total = int(need / memory.FIT_FRACTION * 1.5)  # fits the whole GPU, not 45% of it
    said = []
    shared = memory.resolve_recompute(alone, draft, 1, "cuda", say=said.append)
    assert shared.objective.recompute == "on"
    assert "available (left of the GPU's" in said[0] and "mem_fraction_static 0.55" in said[0]
    attached = dataclasses.replace(alone.target.sglang, url="http://127.0.0.1:30000")
    alone = dataclasses.replace(alone, target=dataclasses.replace(alone.target, sglang=attached))
    assert (
        memory.resolve_recompute(alone, draft, 1, "cuda", say=said.append).objective.recompute
        == "off"
    )
    lines = memory.dry_run_summary(_served("sglang", mem_fraction_static=0.55))
    assert any("by the co-located server" in line for line in lines if "recompute" in line)


def test_the_dry_run_sizes_for_the_launch_the_recipe_names(tmp_path, monkeypatch, capsys):
    """No --world-size: torchrun's WORLD_SIZE, else the recipe header's torchrun line."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    prod = load_recipe(REPO / "recipes" / "inkling_nvfp4.yaml")
    assert memory.implied_world_size(prod, None) == (8, "the launch in inkling_nvfp4.yaml's header")
    assert memory.implied_world_size(prod, 3) == (3, "--world-size")
    two_nodes = tmp_path / "two_nodes.yaml"
    text = (REPO / "recipes" / "inkling_nvfp4.yaml").read_text()
    two_nodes.write_text(
        text.replace("torchrun --nproc_per_node 8", "torchrun --nnodes 2 --nproc_per_node 8", 1)
    )
    assert memory.implied_world_size(load_recipe(two_nodes), None)[0] == 16
    bare = tmp_path / "bare.yaml"
    bare.write_text("\n".join(line for line in text.splitlines() if "torchrun" not in line))
    world, why = memory.implied_world_size(load_recipe(bare), None)
    assert world == 1 and "--world-size W" in why
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert memory.implied_world_size(prod, None) == (4, "WORLD_SIZE")
    monkeypatch.delenv("WORLD_SIZE")
    assert train.main(["--recipe", str(REPO / "recipes" / "tiny_cpu.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "sizing for 2 rank(s) (the launch in tiny_cpu.yaml's header)" in out
    assert "memory per rank (estimate from shapes; 2 rank(s)" in out


def test_sequence_parallel_sizes_128k_on_8_ranks_within_a_b200():
    """The production recipe at 128K positions: SP 8 on 8 ranks cuts each rank's context
    rows and anchors by 8 and fits a B200 (180 GB) with room for the co-located server's
    share; the engine hands each rank its slice of the features (1/8 and a block's halo),
    whole again with data.pack (cut on the device)."""
    prod = REPO / "recipes" / "inkling_nvfp4.yaml"
    with torch.device("meta"):
        n = sum(p.numel() for p in new_draft(load_recipe(prod).draft).parameters())
    est = {}
    for sp, pack in ((1, "false"), (8, "false"), (8, "true")):
        over = ["data.max_length=131072", f"dist.sequence_parallel={sp}", f"data.pack={pack}"]
        est[sp, pack] = memory.estimate(load_recipe(prod, over), n, 8)
    est[1], est[8] = est[1, "false"], est[8, "false"]
    kv, feats = "activations: context K/V", "activations: features"
    assert est[8][kv] == pytest.approx(est[1][kv] / 8, rel=1e-3)
    G = load_recipe(prod).draft.block_size
    assert est[8][feats] == est[1][feats] * (131072 // 8 + G - 1) / 131072
    assert est[8, "true"][feats] == est[1][feats]
    assert memory.total_bytes(est[8]) < 0.6 * memory.total_bytes(est[1])
    assert memory.total_bytes(est[8]) < 0.5 * 180e9  # half a B200 left to the server
