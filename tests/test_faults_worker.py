"""Dead and hung hf target workers are restarted and their requests re-sent (stream.py).

In process: a FeatureStream whose worker is SIGKILLed, then SIGSTOPped (a hang, caught by
target.timeout_s), yields the same batches in the same order with bitwise the same
features as an undisturbed stream; past target.max_restarts the error names the worker
and the budget. End to end (2 ranks): rank 0's worker killed and rank 1's stopped mid-run,
the run finishes with the reference run's losses and trains on the same sample ids, in
the same order, each once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import psutil
import pytest
import torch

from specforge_dspark.training.stream import FeatureStream
from specforge_dspark.transport.features import TargetLost
from tests import faults_tiny as ft
from tests.faults_helpers import wait_end, wait_step, wait_until
from tests.test_stream import make_samples, tiny_recipe

SAMPLES = make_samples([17, 30, 9, 41, 25, 25, 12, 50, 33, 20])
BATCHES = [[s] for s in SAMPLES]


def _features(stream: FeatureStream, hurt=None) -> list[tuple]:
    """(sample ids, aux, last) of every batch; `hurt(n, stream)` runs after batch n."""
    got = []
    for n, f in enumerate(stream.iterate(BATCHES)):
        got.append((f.sample_ids, f.aux_hidden.clone(), f.last_hidden.clone()))
        if hurt is not None:
            hurt(n, stream)
    return got


@pytest.fixture(scope="module")
def reference(tiny_target_dir):
    with FeatureStream(tiny_recipe(tiny_target_dir, batch_size=1)) as s:
        return _features(s)


@pytest.mark.slow
def test_killed_then_hung_worker_is_restarted_and_features_are_unchanged(
    reference, tiny_target_dir
):
    recipe = tiny_recipe(tiny_target_dir, batch_size=1, timeout_s=3, restart_backoff_s=0.1)
    pids = []

    def hurt(n: int, stream: FeatureStream) -> None:
        if n in (1, 5):
            pids.append(stream.engine.proc.pid)
            os.kill(pids[-1], signal.SIGKILL if n == 1 else signal.SIGSTOP)

    with FeatureStream(recipe) as s:
        got = _features(s, hurt)
        restarts = s.restarts
        assert s.engine.proc.pid not in pids
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in reference]
    for (_, a1, l1), (_, a2, l2) in zip(got, reference, strict=True):
        assert torch.equal(a1, a2) and torch.equal(l1, l2)
    assert [r["error"].split(" (pid")[0] for r in restarts] == ["hf target worker for rank 0"] * 2
    assert "died" in restarts[0]["error"] and "did not answer" in restarts[1]["error"]
    assert all(r["resent"] >= 1 for r in restarts)
    print("restart seconds:", [round(r["restart_s"], 2) for r in restarts])
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_past_the_budget_the_error_names_the_worker_and_the_budget(tiny_target_dir):
    recipe = tiny_recipe(tiny_target_dir, batch_size=1, max_restarts=0)
    with FeatureStream(recipe) as s:
        pid = s.engine.proc.pid
        with pytest.raises(TargetLost) as e:
            _features(s, lambda n, st: n == 0 and os.kill(pid, signal.SIGKILL))
    msg = str(e.value)
    assert f"hf target worker for rank 0 (pid {pid}) died (exit code -9)" in msg
    assert "gave up after 0 restart(s) in a row: target.max_restarts=0" in msg


def _find(job: subprocess.Popen, name: str, out, extra: tuple) -> psutil.Process:
    """The process called `name` (its comm) under the launcher `job`, once it starts."""
    found = []

    def started() -> bool:
        assert job.poll() is None, f"the run ended before {name} started"
        for p in psutil.Process(job.pid).children(recursive=True):
            try:
                if p.name() == name:
                    found.append(p)
                    return True
            except psutil.NoSuchProcess:
                continue
        return False

    wait_until(out, started, f"waiting for {name}", extra)
    return found[0]


@pytest.mark.slow
def test_run_survives_a_killed_and_a_hung_worker(tmp_path, tmp_path_factory, tiny_target_dir):
    ref = ft.reference(tmp_path_factory.getbasetemp())
    out = tmp_path / "run"
    extra = ("--resume", "none", "target.timeout_s=4", "target.restart_backoff_s=0.2")
    log = open(tmp_path / "job.log", "w")
    job = subprocess.Popen(
        ft.command(out, *extra),
        cwd=ft.REPO,
        env=ft.environment(out, None),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        first = _find(job, "hf-target-rank0", out, extra)
        second = _find(job, "hf-target-rank1", out, extra)
        wait_step(out, 2, job, overrides=extra)
        first.kill()
        wait_step(out, 4, job, overrides=extra)
        second.suspend()  # SIGSTOP: alive, silent
        assert wait_end(job, out, extra) == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        log.close()
    assert not second.is_running()  # the stream killed the stopped worker
    text = (tmp_path / "job.log").read_text()
    took = [float(t) for t in re.findall(r"restarted as hf target worker .* in ([\d.]+)s", text)]
    assert "[rank 0] hf target worker for rank 0" in text and " died " in text
    assert "[rank 1] hf target worker for rank 1" in text and "did not answer" in text
    assert len(took) == 2, text[-3000:]
    print("worker restart seconds (rank 0 killed, rank 1 hung):", took)
    a, b = ft.losses(out), ft.losses(ref)
    assert [a[s] for s in range(1, ft.STEPS + 1)] == [b[s] for s in range(1, ft.STEPS + 1)]
    for rank in (0, 1):
        got, want = ft.trained_ids(out, rank), ft.trained_ids(ref, rank)
        assert got == want
        ids = [i for _, batch in got for i in batch]
        assert len(ids) == len(set(ids)) == ft.STEPS  # each sample once


@pytest.mark.slow
def test_a_lost_worker_on_rank_1_fails_the_job_as_resumable(tmp_path, tiny_target_dir):
    """run_status.json after a fault on another rank than 0: the job's status is rank 1's
    TargetLost (resumable: the next run starts a new worker), not the collective error
    rank 0 then meets; and the resume it promises succeeds."""
    out = tmp_path / "run"
    log = open(tmp_path / "job.log", "w")
    extra = ("--resume", "none", "target.max_restarts=0")
    job = subprocess.Popen(
        ft.command(out, *extra),
        cwd=ft.REPO,
        env=ft.environment(out, None),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        worker = _find(job, "hf-target-rank1", out, extra)
        wait_step(out, 2, job, overrides=extra)
        worker.kill()
        assert wait_end(job, out, extra) != 0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        log.close()
    text = (tmp_path / "job.log").read_text()
    assert "[rank 1] error: " in text and "max_restarts" in text, text[-3000:]
    status = ft.run_status(out)
    assert (status["status"], status["exit_code"], status["resumable"]) == ("failed", 1, True)
    assert status["detail"].startswith("rank 1: TargetLost"), status
    assert status["ranks"]["1"]["status"] == "failed" and status["resume"] == "--resume auto"
    resumed = ft.train(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ft.run_status(out)["status"] == "finished"
