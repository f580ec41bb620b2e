"""`make demo` resumes its run only on the target it was made with (scripts/demo.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]


def _demo():
    spec = importlib.util.spec_from_file_location("demo", REPO / "scripts" / "demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_demo_run_made_on_other_target_weights_starts_afresh(tmp_path):
    demo = _demo()
    target, out = tmp_path / "target", tmp_path / "run"
    target.mkdir()
    save_file({"w": torch.zeros(4)}, str(target / "model.safetensors"))
    demo.fresh_for_target(out, target)
    (out / "data").mkdir()
    (out / "data" / "mix_regenerated.jsonl").write_text("{}\n")
    demo.fresh_for_target(out, target)  # same weights: kept
    assert (out / "data" / "mix_regenerated.jsonl").is_file()
    save_file({"w": torch.ones(4)}, str(target / "model.safetensors"))
    demo.fresh_for_target(out, target)  # rebuilt target: the old answers are gone
    assert not (out / "data").exists() and (out / "target_weights.json").is_file()


def test_a_foreign_directory_is_not_removed(tmp_path):
    demo = _demo()
    target, out = tmp_path / "target", tmp_path / "mine"
    target.mkdir()
    save_file({"w": torch.zeros(4)}, str(target / "model.safetensors"))
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not a demo's output"):
        demo.fresh_for_target(out, target)
    assert (out / "notes.txt").read_text() == "keep me"
