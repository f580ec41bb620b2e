"""Resuming or exporting a checkpoint runs no code from it (training/safe_load.py): a file
whose pickle would call a function is refused naming the file, before DeepSpeed's own
loader reads it; a real DeepSpeed checkpoint still saves and resumes exactly."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.training import checkpoint as ck
from specforge_dspark.training.safe_load import UnsafeCheckpoint, safe_load
from tests.live_sglang import free_port
from tests.test_export import TINY, cli, fake_training_checkpoint

REPO = Path(__file__).resolve().parents[1]
FINGERPRINT = {"features": {}, "data": {}}


class RunsCode:
    """Unpickling this creates `marker` (what a file that runs code would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def plant(file: Path, marker: Path) -> None:
    torch.save({"module": {"w": torch.zeros(2)}, "extra": RunsCode(marker)}, file)


def proves_live(file: Path, marker: Path) -> None:
    """The planted file does run code when loaded without the safe loader."""
    torch.load(file, weights_only=False)["extra"].close()
    assert marker.exists()


def test_resume_refuses_a_file_that_would_run_code_before_deepspeed_reads_it(tmp_path):
    recipe = recipe_from_dict({})
    calls = []

    def save_checkpoint(root, tag, save_latest):  # DeepSpeed's files: planted below
        Path(root, tag).mkdir(parents=True)

    engine = types.SimpleNamespace(
        save_checkpoint=save_checkpoint,
        load_checkpoint=lambda *a, **k: calls.append(a) or (a[0], {}),
    )
    path = ck.save(engine, tmp_path / "ckpt", ck.TrainState(step=3), recipe, 2, FINGERPRINT)
    assert ck.load(engine, path, recipe, FINGERPRINT).step == 3  # our own files load
    calls.clear()

    marker = tmp_path / "ran"
    evil = path / "mp_rank_00_model_states.pt"
    plant(evil, marker)
    with pytest.raises(UnsafeCheckpoint, match=f"{evil}: refused to load: it holds .*open"):
        ck.load(engine, path, recipe, FINGERPRINT)
    assert not calls and not marker.exists()
    proves_live(evil, marker)


def test_export_refuses_a_file_that_would_run_code(tmp_path, capsys):
    step = fake_training_checkpoint(tmp_path / "run", TINY)
    marker = tmp_path / "ran"
    evil = step / "mp_rank_00_model_states.pt"
    plant(evil, marker)
    assert cli(step, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"export failed: {evil}: refused to load" in err
    assert not marker.exists() and not (tmp_path / "out").exists()
    with pytest.raises(UnsafeCheckpoint):
        safe_load(evil)
    proves_live(evil, marker)


def test_a_real_deepspeed_checkpoint_saves_and_resumes_through_the_safe_loader(tmp_path):
    """ZeRO-2 in bf16 (the production setting): its optimizer shards hold DeepSpeed's own
    classes, the rank files numpy's RNG state; all of them pass the allowlist."""
    cmd = [sys.executable, "-m", "tests.deepspeed_roundtrip", str(tmp_path), str(free_port())]
    done = subprocess.run([*cmd, "2", "bf16"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    shards = list((tmp_path / "step-1").glob("*optim_states.pt"))
    assert shards  # the optimizer shards were there to check
