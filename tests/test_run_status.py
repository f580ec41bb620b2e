"""run_status.json, the file a scheduler reads (training/run_status.py): every state, the
first failure kept as the job's cause, a stale heartbeat read as a killed run. The drills
(test_faults_*.py, test_train.py) assert the file each real exit path writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import train
from specforge_dspark.engines.features import TargetRefused
from specforge_dspark.training.run_status import (
    EXIT_CODES,
    RunStatus,
    effective_status,
    read_run_status,
)


def _status(tmp_path) -> dict:
    return json.loads((tmp_path / "run_status.json").read_text())


def test_a_new_run_replaces_the_last_outcome_and_beats(tmp_path):
    (tmp_path / "run_status.json").write_text(json.dumps({"status": "finished", "ranks": {}}))
    rank0 = RunStatus(tmp_path, 0)
    rank0.start()
    s = _status(tmp_path)
    assert (s["status"], s["exit_code"], s["resumable"], s["pid"]) == (
        "running",
        None,
        False,
        os.getpid(),
    )
    first = s["heartbeat"]
    RunStatus(tmp_path, 1).start()  # only rank 0 writes the start
    RunStatus(tmp_path, 1).heartbeat(5, 10, 1.0)
    assert _status(tmp_path)["detail"] == "starting"
    rank0.heartbeat(5, 10, 200.0)
    s = _status(tmp_path)
    assert s["detail"] == "step 5 of 10" and s["heartbeat"] >= first
    assert s["stale_after_s"] == 2000.0  # ten log intervals when that is longer


def test_each_end_state_its_exit_code_and_whether_to_resume(tmp_path):
    cases = [
        ("finished", "", False),
        ("stopped", "", True),
        ("failed", "TargetLost", True),
        ("failed", "TimeoutError", True),
        ("failed", "NonFiniteError", False),
        ("failed", "CheckpointWriteError", False),
        ("failed", "RuntimeError", False),
        ("refused", "", False),
    ]
    for status, error, resumable in cases:
        w = RunStatus(tmp_path / f"{status}-{error}", 0)
        w.start()
        w.end(status, f"{error}: why", error=error)
        s = _status(w.path.parent)
        assert (s["status"], s["exit_code"], s["resumable"]) == (
            status,
            EXIT_CODES[status],
            resumable,
        ), (status, error)
        assert s["resume"] == ("--resume auto" if resumable else "")
        assert s["ranks"]["0"]["status"] == status


def test_the_first_failure_of_any_rank_is_the_jobs_cause(tmp_path):
    RunStatus(tmp_path, 0).start()
    RunStatus(tmp_path, 1).end("failed", "TargetLost: worker died", error="TargetLost")
    RunStatus(tmp_path, 0).end("failed", "RuntimeError: peer closed", error="RuntimeError")
    s = _status(tmp_path)
    assert s["detail"] == "rank 1: TargetLost: worker died" and s["resumable"] is True
    assert s["ranks"]["0"]["detail"] == "RuntimeError: peer closed"
    assert s["ranks"]["1"]["status"] == s["ranks"]["0"]["status"] == "failed"


def test_a_stale_heartbeat_reads_as_killed(tmp_path):
    RunStatus(tmp_path, 0).start()
    s = read_run_status(tmp_path / "run_status.json")
    assert effective_status(s) == "running"
    assert effective_status(s, now=s["heartbeat"] + s["stale_after_s"] + 1) == "killed"
    assert effective_status({"status": "stopped"}) == "stopped"
    assert read_run_status(tmp_path / "missing.json") == {}


def test_an_unwritable_status_warns_and_does_not_raise(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    RunStatus(blocked, 0).start()
    assert "could not write" in capsys.readouterr().err


def test_a_target_server_that_never_served_ends_the_run_refused(tmp_path, monkeypatch):
    """TargetRefused (a started server that exited before its first answer) from inside
    the run: refused, exit code 2, not resumable, the server's log tail in the detail."""
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu.yaml"
    closed = []
    stream = SimpleNamespace(close=lambda: closed.append(True))

    def build(recipe, resume, status):
        status.start()
        return SimpleNamespace(stream=stream)

    def never_served(run, stop_at_step=0):
        raise TargetRefused("sglang server died (exit code 1) during start-up; log: OOM")

    monkeypatch.setattr(train, "build", build)
    monkeypatch.setattr(train, "train", never_served)
    assert train.main(["--recipe", str(recipe), f"train.output_dir={tmp_path}"]) == 2
    s = _status(tmp_path)
    assert (s["status"], s["exit_code"], s["resumable"]) == ("refused", 2, False)
    assert (
        s["detail"] == "TargetRefused: sglang server died (exit code 1) during start-up; log: OOM"
    )
    assert closed == [True]  # the target stops on this path too
