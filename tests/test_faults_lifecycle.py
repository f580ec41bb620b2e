"""Faults of the job itself on CPU (2 gloo ranks, live hf target, 100 tiny steps), each
checked against one uninterrupted run: the loss of every step and the final weights
must be equal, bitwise.

- SIGTERM to one rank, SIGINT to torchrun: the job saves at the next step boundary and
  exits (status non-zero: not finished) within one step and one save; --resume auto
  continues exactly.
- Only the launcher dies (SIGKILL of torchrun): its ranks notice, save and exit; a second
  job on the same output_dir is refused while they live, naming the holder's host and pid.
- Two nodes of one rank each (torchrun --nnodes 2, c10d rendezvous on localhost) train as
  --nproc_per_node 2 does, and resume across a restart of both.
- Chaos: four random hits (SIGKILL of the whole job, of one rank, of a target worker,
  SIGTERM), each followed by --resume auto.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import time

import pytest

from specforge_dspark.training.run_status import effective_status
from tests.faults_helpers import (
    STEPS,
    assert_same_run,
    finish,
    kill_job,
    launch,
    losses,
    ranks,
    send,
    wait_end,
    wait_step,
    wait_until,
    workers,
)
from tests.live_sglang import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_target_dir):
    out = tmp_path_factory.mktemp("faults") / "uninterrupted"
    job = launch(out, "--resume", "none")
    assert wait_end(job, out) == 0, (out / "job-node0.log").read_text()[-3000:]
    return out


def _stop_and_check(job, out, target, sig) -> tuple[float, int]:
    """Send `sig` to `target` (a rank or the launcher); return seconds until the job ended
    and torchrun's exit status."""
    before = max(losses(out))
    t0 = send(target, sig)
    rc = wait_end(job, out)
    took = time.monotonic() - t0
    log = (out / "job-node0.log").read_text()
    assert rc != 0, "a stopped run must not exit like a finished one"
    asked = log.find(f"{sig.name}: stopping at the next step boundary")
    assert asked >= 0, log[-2000:]
    saved = [int(p.name[5:]) for p in (out / "ckpt").glob("step-*") if (p / "COMPLETE").exists()]
    # The order of events, not a number of seconds (load stretches those): the stop's own
    # checkpoint is at or after the last step logged before the signal (a signal landing
    # between a step's log line and its stop check saves that step), it is logged after the
    # request to stop, no step trained past it, and the run did not go on to its end.
    stopped_at = log.find(f"step {max(saved)}: stopped")
    assert max(saved) >= before and stopped_at > asked, (before, sorted(saved), log[-2000:])
    assert max(losses(out)) == max(saved) < STEPS, (sorted(saved), max(losses(out)))
    status = json.loads((out / "run_status.json").read_text())  # what a scheduler reads
    assert (status["status"], status["exit_code"]) == ("stopped", 143), status
    assert status["resume"] == "--resume auto", status
    return took, rc


def _assert_running(out, job) -> dict:
    """run_status.json while the job trains: running, rank 0's pid, a fresh heartbeat."""
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "running" and status["exit_code"] is None, status
    assert status["pid"] in [p.pid for p in ranks(job)], status
    assert status["heartbeat"] >= job.started, status  # beaten by this run, not a past one
    assert effective_status(status) == "running" and not status["ranks"], status
    return status


def test_sigterm_to_a_rank_and_sigint_to_torchrun_save_and_resume_exactly(reference, tmp_path):
    out = tmp_path / "signals"
    job = launch(out, "--resume", "none")
    wait_step(out, 30, job)
    _assert_running(out, job)
    term_s, term_rc = _stop_and_check(job, out, ranks(job)[1], signal.SIGTERM)
    job = launch(out, "--resume", "auto")
    wait_step(out, 70, job)
    _assert_running(out, job)  # the stop of the last run is gone: a new run says running
    int_s, int_rc = _stop_and_check(job, out, job, signal.SIGINT)
    assert finish(out) == 0
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
    assert_same_run(out, reference)
    print(
        f"SIGTERM to rank 1: stopped in {term_s:.1f}s, torchrun exit {term_rc}; "
        f"SIGINT to torchrun: {int_s:.1f}s, torchrun exit {int_rc}"
    )


def test_a_dead_launcher_stops_its_ranks_and_a_second_job_is_refused(reference, tmp_path):
    out = tmp_path / "orphans"
    job = launch(out, "--resume", "none")
    wait_step(out, 25, job)
    orphans = ranks(job)
    for p in orphans:  # paused, so that the run outlives the second job's start-up (~10 s;
        p.suspend()  # 75 tiny steps take less)
    holder = json.loads((out / ".run.lock").read_text())
    assert holder["pid"] in [p.pid for p in orphans]
    second = launch(out, "--resume", "auto", log="second.log")
    assert wait_end(second, out) != 0
    text = (out / "second.log").read_text()
    assert f"in use by a live job (host {socket.gethostname()}, pid {holder['pid']}" in text

    t0 = send(job, signal.SIGKILL)  # the launcher only: its ranks live in their own sessions
    job.wait()  # SIGKILLed: the kernel ends it
    for p in orphans:
        p.resume()
    wait_until(out, lambda: not any(p.is_running() for p in orphans), "orphaned ranks")
    took = time.monotonic() - t0
    assert "launcher (pid" in (out / "job-node0.log").read_text()
    assert finish(out) == 0  # the stale lock of the dead job is taken over
    assert "took over" in (out / "job-node0.log").read_text()
    assert_same_run(out, reference)
    print(f"launcher killed: its ranks saved and exited in {took:.1f}s")


def test_two_nodes_match_one_node_and_resume_across_a_restart(reference, tmp_path):
    out = tmp_path / "nodes"
    port = free_port()
    nodes = [launch(out, "--resume", "none", nodes=2, node_rank=n, port=port) for n in (0, 1)]
    wait_step(out, 45, *nodes)
    for job in nodes:
        kill_job(job)  # the whole job, both nodes
    port = free_port()
    nodes = [launch(out, "--resume", "auto", nodes=2, node_rank=n, port=port) for n in (0, 1)]
    assert [wait_end(job, out) for job in nodes] == [0, 0], (out / "job-node1.log").read_text()[
        -2000:
    ]
    assert_same_run(out, reference)
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"


HITS = ["kill the job", "kill a rank", "kill a target worker", "SIGTERM"]


def _hit(job, hit: str, rng: random.Random) -> None:
    if hit == "kill the job":
        kill_job(job)
    elif hit == "kill a rank":
        ranks(job)[rng.randrange(2)].kill()
    elif hit == "kill a target worker":
        workers(ranks(job)[rng.randrange(2)])[0].kill()
    else:
        send(job, signal.SIGTERM)


def _ended_or_past(out, job, step: int) -> None:
    """Until the job has ended or logged a step after `step` (progress, not a fixed wait:
    a tiny step takes ~0.07 s, so 3 s of waiting is 40 steps)."""

    def ended_or_past() -> bool:
        return job.poll() is not None or max(losses(out)) > step

    wait_until(out, ended_or_past, f"neither ended nor trained past step {step}")


def test_chaos_four_random_hits_each_resumed_give_the_uninterrupted_run(reference, tmp_path):
    seed = int(os.environ.get("SPECFORGE_CHAOS_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    hits = rng.sample(HITS, len(HITS))
    at = [base + rng.randint(-4, 4) for base in (18, 36, 54, 72)]  # >= 10 steps apart
    plan = ", ".join(f"{h} at {s}" for h, s in zip(hits, at, strict=True))
    print(f"chaos seed {seed}: {plan}")
    out = tmp_path / "chaos"
    job = launch(out, "--resume", "none")
    in_place = []  # hits the job survived (a restarted target worker)
    for hit, step in zip(hits, at, strict=True):
        if job.poll() is not None:  # the last hit ended it: continue the run
            assert job.returncode != 0, f"the run finished before the hit at step {step}"
            job = launch(out, "--resume", "auto")
        wait_step(out, step, job)
        if in_place and in_place[-1][1] is job:
            in_place[-1] = (in_place[-1][0], None)  # it lived on to this hit
        hit_at = max(losses(out))
        assert hit_at < STEPS, f"the run finished before the hit at step {step}"
        _hit(job, hit, rng)
        if hit == "kill a target worker":  # the job may live on: until it ends or trains on
            _ended_or_past(out, job, hit_at + 1)
        else:
            wait_end(job, out)
        if job.poll() is None:
            in_place.append((hit, job))
    if job.poll() is not None:
        job = launch(out, "--resume", "auto")
    survived = [h for h, j in in_place if j is None or j is job]
    assert wait_end(job, out) == 0, (out / "job-node0.log").read_text()[-3000:]
    assert_same_run(out, reference)
    print(f"chaos ({plan}): the job lived through {survived or 'none of them'}")
