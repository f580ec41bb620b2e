"""Storage faults while saving a checkpoint (specforge_dspark/training/checkpoint.py `save`).

A failed write (disk full, file too large, I/O error) raises CheckpointWriteError naming
the path and the bytes needed, removes the partial step directory, prunes nothing, and
leaves the previous checkpoint complete; the 2-rank run stops with a non-zero exit
instead of training on without checkpoints, and resumes exactly from the previous one.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specforge_dspark.config.recipe import Recipe
from specforge_dspark.training import checkpoint
from specforge_dspark.training.checkpoint import CheckpointWriteError, TrainState
from tests import faults_tiny as ft
from tests.inject import drills


class BlobEngine:
    """The part of a DeepSpeed engine `checkpoint.save` uses: writes `nbytes` of weights,
    or raises `error`."""

    def __init__(self, nbytes: int, error: Exception | None = None):
        self.module = torch.nn.Linear(4, 4)
        self.nbytes, self.error = nbytes, error

    def save_checkpoint(self, root: str, tag: str, save_latest: bool) -> None:
        if self.error is not None:
            raise self.error
        Path(root, tag).mkdir(exist_ok=True)
        with open(Path(root) / tag / "mp_rank_00_model_states.pt", "wb") as f:
            f.write(b"\0" * self.nbytes)


def _save(engine, root: Path, step: int) -> Path:
    return checkpoint.save(engine, root, TrainState(step=step), Recipe(), 1, {})


REPO = Path(__file__).resolve().parents[1]
MOUNT = "mount -t tmpfs -o size=192k tmpfs"  # a real, small, full-able filesystem
NO_MOUNT = 77  # the namespace's shell: mount refused


def check_disk_full(disk: Path) -> None:
    """On a 192 KiB filesystem at `disk`: a save that does not fit fails whole."""
    root = Path(disk) / "ckpt"
    first = _save(BlobEngine(100_000), root, 1)
    assert checkpoint.is_complete(first)
    with pytest.raises(CheckpointWriteError) as e:
        _save(BlobEngine(100_000), root, 2)
    msg = str(e.value)
    assert f"checkpoint {root / 'step-2'}: writing failed on rank 0: " in msg
    assert "No space left on device [errno 28]" in msg and "(not enough free space)" in msg
    need = sum(f.stat().st_size for f in first.iterdir())
    assert f"needs about {need:,} bytes (the size of step-1)" in msg
    assert f"{first} is complete, --resume auto continues from it" in msg
    assert checkpoint.latest_complete(root) == first  # not pruned, still whole
    assert not (root / "step-2").exists()  # the partial save is gone, its space freed
    assert json.loads((first / "train_state.json").read_text())["step"] == 1


def in_own_namespace(disk: Path) -> subprocess.CompletedProcess:
    """check_disk_full in a user + mount namespace of its own (`unshare -Urm`), where an
    unprivileged process may mount a tmpfs."""
    check = "import sys; from tests.test_faults_storage import check_disk_full as c; c(sys.argv[1])"
    script = f'{MOUNT} "$1" || exit {NO_MOUNT}; exec "$2" -c "$3" "$1"'
    cmd = ["unshare", "-Urm", "sh", "-c", script, "sh", str(disk), sys.executable, check]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_disk_full_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run([*MOUNT.split(), str(disk)], capture_output=True).returncode == 0:
        try:
            check_disk_full(disk)
        finally:
            subprocess.run(["umount", "-l", str(disk)], check=False)
        return
    r = in_own_namespace(disk)  # no mount rights here: a namespace of its own
    if r.returncode == NO_MOUNT or r.stderr.startswith("unshare:"):
        pytest.skip(f"cannot mount a tmpfs here, not even in a user namespace: {r.stderr[-200:]}")
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize(
    "error, needle",
    [
        (OSError(errno.EIO, "Input/output error", "/x/zero_pp_rank_0.pt"), "errno 5] (/x/zero"),
        (RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
         "RuntimeError: PytorchStreamWriter failed writing file data/0"),
    ],
)  # fmt: skip
def test_write_errors_name_the_path_and_the_estimate(tmp_path, error, needle):
    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointWriteError) as e:
        _save(BlobEngine(10, error), root, 5)
    msg = str(e.value)
    assert f"checkpoint {root / 'step-5'}" in msg and needle in msg
    need = 16 * 20 * 1  # 20 fp32 parameters: weights + master weights + two Adam moments
    assert f"needs about {need:,} bytes (weights + fp32 master" in msg
    assert "no earlier checkpoint" in msg
    assert checkpoint.list_checkpoints(root) == []


@pytest.mark.slow
def test_failed_save_stops_the_run_and_resume_is_exact(tmp_path, tmp_path_factory, tiny_target_dir):
    ref = ft.reference(tmp_path_factory.getbasetemp())
    out = tmp_path / "run"
    # rank 1 alone fails (its 2.4 MB optimizer shard): rank 0 must not be left waiting
    p = ft.train(out, "--resume", "none", env={drills.FSIZE: "3:1000000@1"})
    assert p.returncode != 0
    assert "[drill] rank 1: files limited to 1000000 bytes while saving step 3" in p.stderr
    assert "[drill] rank 0" not in p.stderr
    step3 = out / "ckpt" / "step-3"
    assert f"[rank 1] error: checkpoint {step3}: writing failed on rank 1: " in p.stderr
    assert "(this process may write no file over 1,000,000 bytes: ulimit -f)" in p.stderr
    assert "[rank 0] error: checkpoint" in p.stderr and "another rank" in p.stderr
    assert "bytes (the size of step-2)" in p.stderr
    assert "step 4" not in p.stdout  # it stopped; no step trained without its checkpoint
    assert max(ft.losses(out)) == 3
    assert checkpoint.latest_complete(out / "ckpt") == out / "ckpt" / "step-2"
    assert not step3.exists()
    status = json.loads((out / "run_status.json").read_text())  # every rank said its end
    assert (status["status"], status["exit_code"], status["resumable"]) == ("failed", 1, False)
    assert {r: v["status"] for r, v in status["ranks"].items()} == {"0": "failed", "1": "failed"}
    assert "CheckpointWriteError" in status["detail"], status
    resumed = ft.train(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = ft.losses(out), ft.losses(ref)
    assert [a[s] for s in range(1, ft.STEPS + 1)] == [b[s] for s in range(1, ft.STEPS + 1)]
    last = f"step-{ft.STEPS}"
    assert ft.same_update_state(ft.state(out / "ckpt" / last), ft.state(ref / "ckpt" / last))
