"""run_status.json, the file a scheduler reads (training/run_status.py): every state, the
first failure kept as the job's cause, a stale heartbeat read as a killed run. The drills
(test_faults_*.py, test_train.py) assert the file each real exit path writes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import train
from specforge_dspark.training import run_status
from specforge_dspark.training.run_status import (
    EXIT_CODES,
    RunStatus,
    effective_status,
    read_run_status,
)
from specforge_dspark.transport.features import TargetRefused


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
        ("failed", "TargetGone", True),
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


def test_an_unwritable_status_warns_and_does_not_raise(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_status, "BEAT_S", 0.01)
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    RunStatus(blocked, 0).start()
    time.sleep(0.1)  # ten beats' worth: no thread beats a file that cannot be written
    assert capsys.readouterr().err.count("could not write") == 1


def test_a_thread_beats_from_the_start_until_the_end(tmp_path, monkeypatch):
    """A job alive in a long server start logs no step: the thread beats it anyway."""
    monkeypatch.setattr(run_status, "BEAT_S", 0.02)
    w = RunStatus(tmp_path, 0)
    w.start()
    first = _status(tmp_path)["heartbeat"]
    beats = _wait_for(lambda: _status(tmp_path)["heartbeat"] > first)
    assert _status(tmp_path)["detail"] == "starting", "the thread beats; only the loop says steps"
    w.end("finished", "10 steps")
    ended = _status(tmp_path)
    time.sleep(0.1)  # five beats' worth: none lands after the end
    assert _status(tmp_path) == ended and ended["status"] == "finished", beats


def test_a_refusal_replaces_the_last_runs_outcome_but_not_a_live_jobs(tmp_path):
    last = RunStatus(tmp_path, 0)
    last.start()
    last.end("failed", "TargetLost: gone", error="TargetLost")  # a scheduler would retry
    RunStatus(tmp_path, 0).refuse("ValueError: no data at data.train_files")
    s = _status(tmp_path)
    assert (s["status"], s["exit_code"], s["resumable"], s["resume"]) == ("refused", 2, False, "")
    assert s["detail"].startswith("ValueError") and s["ranks"] == {}

    live = tmp_path / "live"
    RunStatus(live, 0).start()
    RunStatus(live, 0).refuse("RecipeError: a second job's bad recipe")
    assert _status(live)["status"] == "running"


def test_a_recipe_that_does_not_load_leaves_a_fresh_refusal(tmp_path, monkeypatch, capsys):
    import train

    out = tmp_path / "run"
    last = RunStatus(out, 0)
    last.start()
    last.end("failed", "TimeoutError: slow", error="TimeoutError")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"train:\n  output_dir: {out}\n  max_stepz: 3\n")
    monkeypatch.delenv("RANK", raising=False)
    assert train.main(["--recipe", str(recipe)]) == 2
    s = _status(out)
    assert s["status"] == "refused" and "max_stepz" in s["detail"], s
    assert "max_stepz" in capsys.readouterr().err
    other = tmp_path / "elsewhere"  # an override names the folder; the YAML cannot load
    RunStatus(other, 0).start()
    RunStatus(other, 0).end("stopped", "SIGTERM")
    recipe.write_text("train: [unclosed\n")
    assert train.main(["--recipe", str(recipe), f"train.output_dir={other}"]) == 2
    assert _status(other)["status"] == "refused"


def test_a_second_signal_records_where_the_run_was_cut_and_what_resumes(tmp_path):
    from types import SimpleNamespace

    import train
    from specforge_dspark.config.recipe import recipe_from_dict

    recipe = recipe_from_dict({"train": {"output_dir": str(tmp_path)}})
    run = SimpleNamespace(state=SimpleNamespace(step=57))
    twice = KeyboardInterrupt("SIGTERM received twice")
    said = train._aborted(recipe, run, twice)
    assert said.startswith("SIGTERM received twice: aborted at step 57 without a save")
    assert "from the start (no complete checkpoint)" in said
    (tmp_path / "ckpt" / "step-40").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-40" / "COMPLETE").write_text("")
    (tmp_path / "ckpt" / "step-50").mkdir()  # being written when the second signal came
    said = train._aborted(recipe, None, KeyboardInterrupt())  # Ctrl-C during the start
    assert said.startswith("interrupted: aborted while starting") and "step-40" in said


def _wait_for(cond, hang_s: float = 60.0) -> int:
    """Polls until `cond` holds; fails only on a hang. Returns the polls it took."""
    polls, deadline = 0, time.monotonic() + hang_s
    while not cond():
        assert time.monotonic() < deadline, "never happened"
        polls += 1
        time.sleep(0.01)
    return polls


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
