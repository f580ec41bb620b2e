"""End to end on CPU: torchrun, 2 gloo ranks, live hf target, DeepSpeed ZeRO-2.

One uninterrupted run and one that is SIGKILLed while saving, then resumed, must give
the same per-step losses and the same final weights; the partial save is skipped; a
resume under a changed objective is refused naming the key; trackio holds the metrics.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.inject import drills
from tests.live_sglang import free_port

REPO = Path(__file__).resolve().parents[1]
STEPS = 4

pytestmark = pytest.mark.slow


def _train(out: Path, *extra: str, env: dict | None = None):
    overrides = [
        f"train.output_dir={out}",
        f"train.max_steps={STEPS}",
        "train.log_interval=1",
        "train.eval_interval=2",
        "checkpoint.save_interval=1",
        "checkpoint.keep_last=3",
        "data.max_rows=48",
        "data.max_length=160",
        "objective.num_anchors=16",
        "objective.chunk_size=8",
        "tracking.project=test_train",
        f"tracking.dir={out / 'trackio'}",
        "export.formats=[sglang]",
        "train.served_eval.num_prompts=2",
        "train.served_eval.max_new_tokens=16",
        "train.preflight_samples=0",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "train.py",
        "--recipe",
        "recipes/tiny_cpu.yaml",
        *overrides,
        *extra,  # after the defaults above, so a test's own overrides win
    ]
    full_env = drills.environment({**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600)


def _losses(out: Path) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines) if "loss" in m}


def _served(out: Path) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {
        m["step"]: m["eval/accept_length"]
        for m in map(json.loads, lines)
        if "eval/accept_length" in m
    }


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)["module"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target_dir):
    base = tmp_path_factory.mktemp("train")
    full = _train(base / "full", "--resume", "none")
    assert full.returncode == 0, full.stderr[-3000:]
    killed = _train(
        base / "killed",
        "--resume",
        "none",
        env={drills.KILL: "3"},
    )
    assert killed.returncode != 0
    assert ": SIGKILL while saving step-3, before its marker" in killed.stderr  # it landed
    return base, full, killed


def test_killed_save_leaves_previous_checkpoint_and_resume_is_exact(runs):
    base, full, _ = runs
    ck = base / "killed" / "ckpt"
    assert (ck / "step-2" / "COMPLETE").is_file()
    assert (ck / "step-3").is_dir() and not (ck / "step-3" / "COMPLETE").exists()
    resumed = _train(base / "killed", "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ck / 'step-2'} at step 2" in resumed.stdout
    ref, got = _losses(base / "full"), _losses(base / "killed")
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(1, STEPS + 1)] == [ref[s] for s in range(1, STEPS + 1)]
    # served accept length (real speculative decoding) at every eval interval and at the
    # end, the same values at the same steps after the resume
    assert sorted(_served(base / "full")) == [2, 4]
    assert _served(base / "killed") == _served(base / "full")
    assert all(1.0 <= v <= 6.0 for v in _served(base / "full").values())  # 1..G+1
    a = _weights(base / "full" / "ckpt" / f"step-{STEPS}")
    b = _weights(ck / f"step-{STEPS}")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (base / "killed" / "export" / "sglang" / "model.safetensors").is_file()


def test_resume_with_changed_objective_is_refused(runs):
    base, _, _ = runs
    p = _train(base / "full", "--resume", "auto", "objective.num_anchors=8")
    assert p.returncode != 0  # torchrun reports a failed rank as 1
    assert "error: " in p.stderr and "objective.num_anchors: 16 -> 8" in p.stderr
    assert 'train.py", line' not in p.stderr  # a message, not a traceback through our code
    status = json.loads((base / "full" / "run_status.json").read_text())  # was "finished"
    assert (status["status"], status["exit_code"], status["resumable"]) == ("refused", 2, False)
    assert "objective.num_anchors: 16 -> 8" in status["detail"] and status["resume"] == ""


def test_metrics_reach_trackio(runs, monkeypatch):
    base, full, _ = runs
    from trackio import sqlite_storage
    from trackio.sqlite_storage import SQLiteStorage

    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", base / "full" / "trackio")

    logs = SQLiteStorage.get_logs("test_train", "tiny_cpu")
    # the dashboard hint the run printed names the run's database: as printed, it finds it
    hint = re.search(r"\* trackio dashboard: (TRACKIO_DIR=(\S+) trackio) show (.*)", full.stdout)
    assert hint, full.stdout[-2000:]
    listed = subprocess.run(
        f"{hint.group(1)} list runs {hint.group(3)}",
        shell=True, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )  # fmt: skip
    assert listed.returncode == 0 and "tiny_cpu" in listed.stdout, listed.stdout + listed.stderr
    assert Path(hint.group(2)) == base / "full" / "trackio"
    train_logs = [m for m in logs if "loss" in m]
    assert len(train_logs) == STEPS
    last = train_logs[-1]
    for key in (
        "loss",
        "ce",
        "l1",
        "bce",
        "tau",
        "tau_expected",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "wait_fraction",
        "alpha/0",
        "top1/0",
        "conf_err/0",
    ):
        assert key in last, key
    assert abs(last["loss"] - _losses(base / "full")[STEPS]) < 1e-6
    evals = [m for m in logs if "eval/loss" in m]  # train.eval_interval=2: after step 2
    assert len(evals) == 1 and all(
        k in evals[0] for k in ("eval/tau", "eval/tau_expected", "eval/alpha/0")
    )
    served = [m for m in logs if "eval/accept_length" in m]
    assert [m["eval/served_prompts"] for m in served] == [2, 2]  # steps 2 and 4
    gap = evals[0]["eval/tau_minus_accept_length"]  # step 2: teacher-forced minus served
    assert gap == pytest.approx(evals[0]["eval/tau"] - served[0]["eval/accept_length"])
