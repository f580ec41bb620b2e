"""A server we start dies with its job, and restarts fit in dist.timeout_s (issue 34, 6-7).

The server runs in a session of its own, so nothing but its reaper (engines/reaper.py)
ties it to the trainer: SIGKILL the trainer and the server's process group is gone within
10 s, also for a server the keeper restarted from its thread. A leftover server of an
earlier job (its reaper killed too) that the pid file names is stopped with a message
naming its pid and the file; anything else on the port is refused naming the port, and
a rank that did not start the server trusts the port only once the pid file is this
job's. A recipe whose server restarts may outlast dist.timeout_s is refused at load.

Most drills use `tests/standin_server.py` launched through `EngineServer` (the path a real
server takes); `test_a_sigkilled_training_job_takes_its_sglang_server_along` SIGKILLs a
real 2-rank training job on the tiny CPU SGLang server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.engines.launch import launch_env
from specforge_dspark.engines.server import (
    EngineServer,
    ServerKeeper,
    group_running,
    http_ok,
    kill_group,
    pid_file_current,
)
from tests.faults_helpers import kill_job, ranks, step_bound_s
from tests.live_sglang import free_port

REPO = Path(__file__).resolve().parents[1]
HANG_S = 300.0
"""Waits that only a hang fails (the reaper polls every 0.5 s): the tests assert who ended
the server and in which order, never how many seconds it took, which load stretches."""


def _wait(cond, what: str, timeout: float = HANG_S) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.05)
    return time.monotonic() - t0


def _standin(port: int, log: Path) -> EngineServer:
    args = ["--port", str(port), "--children", "2"]
    return EngineServer(sys.executable, "tests.standin_server", args, log, launch_env())


def _keeper(tmp_path: Path, port: int, **target) -> ServerKeeper:
    recipe = recipe_from_dict({"target": {"restart_backoff_s": 0.01, **target}})
    url = f"http://127.0.0.1:{port}"
    return ServerKeeper(
        lambda: _standin(port, tmp_path / "server.log"),
        tmp_path / "sglang_server_rank0.pid",
        lambda: http_ok(url),
        recipe,
        0,
        url,
        "sglang",
    )


# ------------------------------------------------------------ item 6: leftovers


def test_a_leftover_server_named_by_the_pid_file_is_stopped_naming_it(tmp_path, capfd):
    port = free_port()
    earlier = _keeper(tmp_path / "earlier", port)  # an earlier job's server...
    old = earlier.server.proc.pid
    earlier.server.reaper.kill()  # ...whose reaper died with it (kill -9 -1, say)
    earlier.server.reaper.wait()
    _wait(lambda: http_ok(f"http://127.0.0.1:{port}/health"), "stand-in up")
    (tmp_path / "sglang_server_rank0.pid").write_text(str(old))  # the same output_dir
    keeper = _keeper(tmp_path, port, max_restarts=1)  # another recipe, same port
    try:
        assert not group_running(old), "the leftover was not stopped"
        assert keeper.server.proc.pid != old
        assert (tmp_path / "sglang_server_rank0.pid").read_text() == str(keeper.server.proc.pid)
        _wait(lambda: http_ok(f"http://127.0.0.1:{port}/health"), "new stand-in up")
    finally:
        keeper.stop()
        earlier.server.proc.wait()
    err = capfd.readouterr().err
    pid_file = tmp_path / "sglang_server_rank0.pid"
    assert (
        f"[rank 0] stopping a leftover sglang server of an earlier job on port {port}: "
        f"process group {old} (from {pid_file}): {sys.executable} -m tests.standin_server "
        f"--port {port}"
    ) in err


def test_anything_else_on_the_port_is_refused_and_never_used(tmp_path):
    port = free_port()
    pid_file = tmp_path / "sglang_server_rank0.pid"
    pid_file.write_text(str(os.getpid()))  # a stale file naming a live, unrelated process
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(ValueError) as e:
            _keeper(tmp_path, port)
    assert str(e.value) == (
        f"target.sglang.port={port}: 127.0.0.1:{port} is taken by a process that is not a "
        f"server of this run ({pid_file} names none there); the run does not reuse it: stop "
        "it, choose another target.sglang.port, or attach to it on purpose with target.sglang.url"
    )
    assert not (tmp_path / "server.log").exists(), "a server was started"
    keeper = _keeper(tmp_path, port)  # the port free again; the stale pid left alone
    keeper.stop()


def test_a_rank_that_did_not_start_the_server_trusts_only_this_jobs_pid_file(tmp_path):
    pid_file = tmp_path / "sglang_server_rank0.pid"
    assert pid_file_current(None)  # attached: nothing to check
    assert not pid_file_current(pid_file)  # not written yet
    pid_file.write_text("123")
    assert pid_file_current(pid_file)
    an_hour_ago = time.time() - 3600
    os.utime(pid_file, (an_hour_ago, an_hour_ago))  # an earlier job's
    assert not pid_file_current(pid_file)


# ------------------------------------------------------------ item 6: SIGKILL drills

TRAINER = r"""
import sys, time
from pathlib import Path
from tests.test_server_lifecycle import _keeper
keeper = _keeper(Path(sys.argv[1]), int(sys.argv[2]), max_restarts=2)
keeper.watch()
while True:
    print(keeper.server.proc.pid, keeper.server.reaper.pid, flush=True)
    time.sleep(0.2)
"""


@pytest.mark.slow
def test_a_sigkilled_trainer_takes_its_server_along_also_one_restarted_by_the_keeper(tmp_path):
    port = free_port()
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(tmp_path), str(port)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        first, _ = map(int, trainer.stdout.readline().split())
        os.killpg(first, signal.SIGKILL)  # the keeper's thread starts the next one
        pid = reaper = first
        while pid == first:
            pid, reaper = map(int, trainer.stdout.readline().split())
        _wait(lambda: http_ok(f"http://127.0.0.1:{port}/health"), "restarted stand-in up")
        killed_at = time.monotonic()
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        _wait(lambda: not group_running(pid), "server outlived its trainer", HANG_S)
        took = time.monotonic() - killed_at
        _wait(lambda: not group_running(reaper), "the reaper outlived its server", HANG_S)
    finally:
        trainer.kill()
        kill_group(first)
        kill_group(pid)
    print(f"server group gone {took:.1f}s after the trainer's SIGKILL")
    log = (tmp_path / "server.log").read_text()
    assert f"[reaper] trainer pid {trainer.pid} is gone; ending server process group {pid}" in log


@pytest.mark.slow
@pytest.mark.server  # starts its own (no fixture for conftest to see)
def test_a_sigkilled_training_job_takes_its_sglang_server_along(tmp_path):
    out, port = tmp_path / "job", free_port()
    out.mkdir()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), "train.py", "--recipe", "recipes/tiny_cpu_sglang.yaml",
        f"train.output_dir={out}", f"target.sglang.port={port}", "train.max_steps=50",
        "train.preflight_samples=0", "tracking.enabled=false", "data.max_rows=96",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(out / "job.log", "w") as log:
        job = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    pid_file = out / "sglang_server_rank0.pid"
    try:
        start = step_bound_s(recipe="recipes/tiny_cpu_sglang.yaml")  # its start-up, by the recipe
        _wait(lambda: pid_file.is_file(), "no server started", start)
        _wait(lambda: http_ok(f"http://127.0.0.1:{port}/health_generate"), "server up", start)
        pid = int(pid_file.read_text())
        assert job.poll() is None, (out / "job.log").read_text()[-3000:]
        trainers = [psutil.Process(job.pid), *ranks(job)]  # not the server, not its reaper
        assert len(trainers) == 3
        killed_at = time.monotonic()
        for p in trainers:  # torchrun and every rank (each in a session of its own)
            p.kill()
        psutil.wait_procs(trainers, timeout=HANG_S)
        job.wait()
        _wait(lambda: not group_running(pid), "server outlived its job", HANG_S)
        took = time.monotonic() - killed_at
    finally:
        if job.poll() is None:
            kill_job(job)
        if pid_file.is_file():
            kill_group(int(pid_file.read_text()))
    print(f"SGLang server group gone {took:.1f}s after the job's SIGKILL")
    assert "[reaper] trainer pid" in (out / "sglang_server_rank0.log").read_text()
