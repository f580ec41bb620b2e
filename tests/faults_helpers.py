"""Running, watching and hurting tiny 2-rank training jobs (tests/test_faults_*.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from tests.live_sglang import free_port

REPO = Path(__file__).resolve().parents[1]
STEPS = 100
TINY = "recipes/tiny_cpu.yaml"
SMALL = [
    f"train.max_steps={STEPS}", "train.log_interval=1", "train.eval_interval=0",
    "checkpoint.save_interval=20", "checkpoint.keep_last=2", "data.max_rows=96",
    "data.max_length=128", "objective.num_anchors=16", "objective.chunk_size=8",
    "tracking.enabled=false", "export.formats=[sglang]", "train.preflight_samples=0",
]  # fmt: skip


def launch(
    out: Path, *extra: str, nodes: int = 1, node_rank: int = 0, port: int = 0, log: str = ""
) -> subprocess.Popen:
    """torchrun of recipes/tiny_cpu.yaml into `out` (2 ranks: one node of 2, or 2 nodes of
    1 sharing a c10d rendezvous on `port`), in a session of its own, logging to out/."""
    out.mkdir(parents=True, exist_ok=True)
    if nodes == 1:
        topo = ["--nproc_per_node", "2", "--master_port", str(port or free_port())]
    else:
        topo = ["--nnodes", str(nodes), "--node_rank", str(node_rank), "--nproc_per_node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]  # fmt: skip
    recipe = ["--recipe", TINY, f"train.output_dir={out}"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *topo,
        "train.py",
        *recipe,
        *SMALL,
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sink = open(out / (log or f"job-node{node_rank}.log"), "a")  # the child keeps its own fd
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    sink.close()
    proc.started = time.time()
    return proc


def losses(out: Path) -> dict[int, float]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "loss" in record:
            found[record["step"]] = record["loss"]
    return found


def step_bound_s(*overrides: str, recipe: str = TINY) -> float:
    """How long a healthy run of `recipe` with `overrides` (command-line flags skipped) may
    go without logging a step by its own rules, so that a wait on it fails only on a hang.
    Before the first step: its target started (an hf worker within engines/hf.py
    STARTUP_TIMEOUT_S, a server within target.<engine>.startup_timeout_s) and answering
    within target.timeout_s. Between steps: a lost target seen after target.timeout_s and
    restarted up to target.max_restarts times in a row, each after its backoff, started and
    answering as above (config/validate.py restart_budget_s, with the hf worker's start-up
    for an hf target). A checkpoint save or a stop at a step boundary is part of a step."""
    from specforge_dspark.config.recipe import load_recipe
    from specforge_dspark.config.validate import restart_budget_s
    from specforge_dspark.engines.hf import STARTUP_TIMEOUT_S

    keys = [o for o in overrides if not o.startswith("--") and "=" in o]  # not --resume auto
    r = load_recipe(REPO / recipe, keys)
    g = r.target
    if g.backend != "hf":
        return max(getattr(g, g.backend).startup_timeout_s + g.timeout_s, restart_budget_s(r))
    n = g.max_restarts
    restarts = (
        g.timeout_s + n * (STARTUP_TIMEOUT_S + g.timeout_s) + g.restart_backoff_s * (2**n - 1)
    )
    return max(STARTUP_TIMEOUT_S + g.timeout_s, restarts)


def wait_until(out: Path, done, what: str, overrides: tuple = (), recipe: str = TINY) -> None:
    """Until `done()`; fails when `out`/metrics.jsonl gains no step for step_bound_s of
    the run's `recipe` and `overrides` (a hang, not a speed, fails here)."""
    bound = step_bound_s(*overrides, recipe=recipe)
    seen, since = max(losses(out), default=0), time.monotonic()
    while not done():
        step = max(losses(out), default=0)
        if step != seen:
            seen, since = step, time.monotonic()
        assert time.monotonic() - since < bound, (
            f"{what}: no step logged for {bound:g}s after step {seen} (step_bound_s: the "
            f"run's own bound, so it hangs)"
        )
        time.sleep(0.05)


def wait_step(out: Path, step: int, *jobs: subprocess.Popen, overrides: tuple = ()) -> None:
    """Until these jobs (not an earlier one whose lines are still in metrics.jsonl) have
    logged step `step`; fails when one ends first, or on a hang (step_bound_s of the
    run's `overrides`)."""
    metrics = out / "metrics.jsonl"
    started = max(getattr(job, "started", 0.0) for job in jobs)

    def reached() -> bool:
        for job in jobs:
            assert job.poll() is None, f"job ended (rc {job.returncode}) before step {step}"
        fresh = metrics.is_file() and metrics.stat().st_mtime > started
        return fresh and max(losses(out), default=0) >= step

    wait_until(out, reached, f"waiting for step {step}", overrides)


def wait_end(job: subprocess.Popen, out: Path, overrides: tuple = (), recipe: str = TINY) -> int:
    """The job's exit status, once it ends; fails only on a hang (step_bound_s)."""
    wait_until(out, lambda: job.poll() is not None, "waiting for the job to end", overrides,
               recipe)  # fmt: skip
    return job.returncode


def ranks(job: subprocess.Popen) -> list[psutil.Process]:
    """The trainer ranks under a torchrun launcher (its train.py children)."""
    kids = psutil.Process(job.pid).children()
    return [p for p in kids if "train.py" in " ".join(p.cmdline())]


def workers(rank: psutil.Process) -> list[psutil.Process]:
    """The hf target worker(s) a rank spawned (multiprocessing spawn children)."""
    return [p for p in rank.children() if "multiprocessing" in " ".join(p.cmdline())]


def kill_job(job: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process it started (each rank's own session too)."""
    procs = [psutil.Process(job.pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    job.wait(30)
    psutil.wait_procs(procs, timeout=30)


def finish(out: Path) -> int:
    return wait_end(launch(out, "--resume", "auto"), out)


def weights(out: Path) -> dict[str, torch.Tensor]:
    path = out / "ckpt" / f"step-{STEPS}" / "mp_rank_00_model_states.pt"
    return torch.load(path, weights_only=False)["module"]


def assert_same_run(got: Path, want: Path) -> None:
    """Every step logged with the same loss, and bitwise equal final weights."""
    a, b = losses(got), losses(want)
    assert sorted(a) == list(range(1, STEPS + 1)), (
        f"missing steps {set(range(1, STEPS + 1)) - set(a)}"
    )
    different = [s for s in a if a[s] != b[s]]
    assert not different, f"steps with other losses: {different[:10]}"
    wa, wb = weights(got), weights(want)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def send(proc: psutil.Process | subprocess.Popen, sig: signal.Signals) -> float:
    os.kill(proc.pid, sig)
    return time.monotonic()
