"""Restart bookkeeping of the sglang backend, without SGLang (seconds).

`ServerKeeper` (engines/server.py) with a `sleep` process standing in for the
server: a killed server is started again, its pid file follows, at most
target.max_restarts times in a row, and an answered request resets the count; a
stopped process group is killed whole. The live drill (SIGKILL and SIGSTOP of real CPU
servers mid-run) is `test_the_nodes_servers_are_killed_and_hung_and_the_run_is_unchanged`
in tests/test_sglang_live.py; attached servers are in tests/test_engine_sglang.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.engines.server import ServerKeeper, group_running, kill_group


class Sleeper:
    """What the keeper needs of a ServerProcess, around `sleep` in a session of its own."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def tail(self) -> str:
        return "(sleeper log)"

    def stop(self) -> None:
        kill_group(self.proc.pid)
        self.proc.wait()


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_keeper_restarts_a_killed_server_at_most_max_restarts_in_a_row(tmp_path, capfd):
    recipe = recipe_from_dict({"target": {"max_restarts": 2, "restart_backoff_s": 0.01}})
    pid_file = tmp_path / "sglang_server_rank0.pid"
    keeper = ServerKeeper(
        lambda: Sleeper(tmp_path / "log"), pid_file, lambda: True, recipe, 0, "http://h:1", "sglang"
    )
    try:
        keeper.watch()
        pids = [keeper.server.proc.pid]
        assert int(pid_file.read_text()) == pids[0]
        for k in (1, 2, 3, 4):  # 3: past the budget, unless a request was answered
            if k == 3:
                assert keeper.in_a_row == 2
                keeper.answered()
            os.kill(pids[-1], signal.SIGKILL)
            _wait(lambda: keeper.server.proc.pid != pids[-1], f"restart {k}")
            pids.append(keeper.server.proc.pid)
            assert int(pid_file.read_text()) == pids[-1]
        os.kill(pids[-1], signal.SIGKILL)
        _wait(lambda: keeper.gave_up, "the keeper did not give up")
        assert "gave up after 2 restart(s) in a row: target.max_restarts=2" in keeper.gave_up
        assert keeper.server.proc.pid == pids[-1]  # not started again
    finally:
        keeper.stop()
    err = capfd.readouterr().err
    assert f"[rank 0] sglang server http://h:1 (pid {pids[0]}) died (exit code -9)" in err
    assert (
        "restarting it (1 of target.max_restarts=2 in a row) in 0.01s, to answer within "
        "target.sglang.startup_timeout_s=1800s" in err
    )
    assert err.count("restarted in") == 4


def test_kill_group_ends_a_stopped_group(tmp_path):
    p = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    _wait(lambda: len(list(Path("/proc").glob("*/stat"))) and group_running(p.pid), "start")
    os.killpg(p.pid, signal.SIGSTOP)
    kill_group(p.pid)
    p.wait(5)
    assert not group_running(p.pid)
