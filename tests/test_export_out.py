"""Where an export lands (export/__init__.py `publish`): files readable by the user who
serves them, and an output directory replaced only when it is an earlier export."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.test_export import TINY, cli, fake_training_checkpoint


def modes(root: Path) -> dict[str, int]:
    """Permission bits of `root` and everything under it, by relative path."""
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]
    }


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_follow_the_umask_not_a_private_mode(tmp_path, umask):
    step = fake_training_checkpoint(tmp_path / "run", TINY)
    old = os.umask(umask)
    try:
        assert cli(step, tmp_path / "out") == 0
    finally:
        os.umask(old)
    got = modes(tmp_path / "out")
    assert {"config.json", "model.safetensors"} <= got.keys()
    for name, mode in got.items():
        want = (0o777 if name == "." else 0o666) & ~umask
        assert mode == want, (name, oct(mode), oct(want))


def test_out_is_replaced_only_when_it_is_an_earlier_export(tmp_path, capsys):
    step = fake_training_checkpoint(tmp_path / "run", TINY)
    out = tmp_path / "out"
    out.mkdir()  # an empty directory is taken
    assert cli(step, out) == 0
    (out / "sts_calibration.json").write_text("{}")  # what calibration adds to an export
    assert cli(step, out) == 0  # an earlier export is replaced whole
    assert not (out / "sts_calibration.json").exists()

    other = tmp_path / "home"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    (other / "config.json").write_text('{"model_type": "llama"}')  # not one of ours
    capsys.readouterr()
    assert cli(step, other) == 2
    err = capsys.readouterr().err
    assert f"{other} is not an earlier export" in err and "config.json, notes.txt" in err
    assert (other / "notes.txt").read_text() == "mine"

    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert cli(step, a_file) == 2
    assert f"{a_file} exists and is not a directory" in capsys.readouterr().err
    assert a_file.read_text() == "x"


def test_export_dtype_float32_writes_the_trained_weights_unrounded(tmp_path):
    """export.dtype float32 (the recipe's) or --dtype float32 (the command's): the trained
    fp32 weights exactly; the default rounds them to bf16."""
    import json

    import torch
    from safetensors.torch import load_file

    from specforge_dspark.cli.export import main

    step = fake_training_checkpoint(tmp_path / "run", TINY)
    saved = torch.load(step / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert any(not torch.equal(v, v.bfloat16().float()) for v in saved.values())  # it could fail
    args = ["--checkpoint", str(step), "--format", "sglang", "--out"]
    assert main([*args, str(tmp_path / "cli"), "--dtype", "float32"]) == 0
    assert cli(step, tmp_path / "default") == 0
    state = json.loads((step / "train_state.json").read_text())
    state["recipe"]["export"]["dtype"] = "float32"
    (step / "train_state.json").write_text(json.dumps(state))
    assert cli(step, tmp_path / "recipe") == 0
    for name, want in (("cli", saved), ("recipe", saved),
                       ("default", {k: v.bfloat16() for k, v in saved.items()})):  # fmt: skip
        got = load_file(str(tmp_path / name / "model.safetensors"))
        assert got.keys() == want.keys()
        assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in want.items())
