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
