"""An engine's server process, whatever the engine (SGLang, vLLM, the next transport).

`EngineServer` runs `<python> -m <launcher> <args>` under the engine's own interpreter
(checked first: `engine_python`), in a process group of its own, logging to a file; `stop`
ends the whole group (API server, scheduler, workers). `launch_env` is the environment it
starts with: torchrun's variables dropped, since the server is one process group of its
own, not a peer of the trainer.

`ServerKeeper` starts the server (a factory that returns an `EngineServer`), records its
pid in `<output_dir>/<engine>_server_rank<r>.pid` so the node's other ranks can kill a
hung one, and, once told to `watch()`, restarts it from a thread: a server that exits is
started again on the same port, at most `target.max_restarts` times in a row (a request
answered in between resets the count, `answered()`), after
`target.restart_backoff_s * 2**(k-1)` seconds. The thread, not the training loop,
restarts it: a rank blocked in a collective (waiting for a peer that waits for features)
still brings the server back. The old process group is gone before the new server
starts, so no old process writes a slot after its tickets were re-issued.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

POLL_S = 0.5
LAUNCHER_VARS = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
}  # fmt: skip

# Run by an engine's own interpreter: is `module` importable, and is our plugin registered
# under entry-point group `group` there? (exit 3: no module, 4: no plugin)
_PROBE = """import importlib.metadata as m, importlib.util as u, sys
if u.find_spec(sys.argv[1]) is None: sys.exit(3)
names = {e.name for e in m.entry_points(group=sys.argv[2])} if sys.argv[2] else {""}
sys.exit(0 if not sys.argv[2] or "specforge_dspark" in names else 4)"""


def engine_python(python: str, key: str, module: str, group: str | None = None) -> str:
    """The interpreter of the engine's own environment (recipe key `key`): a path, relative
    to the working directory, or a name on PATH. Checked before a server starts: `module`
    must import there and, with `group`, our package's plugin must be registered there
    (`pip install --no-deps -e .` in that environment). Returns the executable's path."""
    exe = python if os.sep in python else shutil.which(python)
    make = f"make {module}-venv"
    if exe is None or not Path(exe).is_file():
        raise ValueError(
            f"{key}: no Python interpreter at {python} (the {module} server's environment: "
            f"run `{make}`, or point {key} at an environment with {module} installed)"
        )
    # -I: not the working directory (an in-tree egg-info would answer for the environment)
    probe = subprocess.run([exe, "-I", "-c", _PROBE, module, group or ""], capture_output=True)
    if probe.returncode == 3:
        raise ValueError(f"{key}: {exe} cannot import {module} (run `{make}`)")
    if probe.returncode == 4:
        raise ValueError(
            f"{key}: our plugin is not registered in {exe}'s environment (entry point "
            f"group {group}): run `{exe} -m pip install --no-deps -e .` in this repository"
        )
    if probe.returncode != 0:
        raise ValueError(f"{key}: {exe} failed: {probe.stderr.decode()[-500:]}")
    return exe


def launch_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) without torchrun's variables: its
    rendezvous would make the engine's own distributed init wait for peers."""
    env = dict(os.environ if base is None else base)
    for key in list(env):
        if key in LAUNCHER_VARS or key.startswith("TORCHELASTIC_"):
            del env[key]
    return env


def prepend_path(env: dict[str, str], path: Path) -> None:
    """Put `path` first on env's PYTHONPATH (inherited by the processes the server spawns)."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)


def cli_flag(key: str, value: Any) -> list[str]:
    """A server argument by field name: `tp_size: 8` -> ["--tp-size", "8"]."""
    flag = "--" + key.replace("_", "-")
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, list | tuple):
        return [flag, *map(str, value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def http_ok(url: str) -> bool:
    """Whether a GET of `url` answers 200 within 5 s."""
    try:
        with urllib.request.urlopen(url, timeout=5.0) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def kill_group(pgid: int, wait_s: float = 10.0) -> None:
    """SIGKILL process group `pgid` (a stopped one too) and wait until none of its
    processes runs (zombies left to their parent do not count)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if not group_running(pgid):
            return
        time.sleep(0.05)


def group_running(pgid: int) -> bool:
    """Whether a process of group `pgid` is still more than a zombie (Linux /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text())
    except (OSError, ValueError):
        return None


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class EngineServer:
    """`<exe> -m <launcher> <args>` in its own process group, logging to `log_path`;
    `term_wait_s`: how long `stop` waits after SIGTERM before SIGKILL."""

    def __init__(
        self,
        exe: str,
        launcher: str,
        args: list[str],
        log_path: Path,
        env: dict[str, str],
        term_wait_s: float = 30.0,
    ):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path, self.term_wait_s = log_path, term_wait_s
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [exe, "-m", launcher, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, the whole process group; returns once it is gone."""
        for sig, wait in ((signal.SIGTERM, self.term_wait_s), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.proc.pid)  # what the launcher left: scheduler, workers


class ServerKeeper:
    """Starts, watches and restarts one server (`start()` -> EngineServer) of `engine`
    (its recipe section `target.<engine>` gives startup_timeout_s)."""

    def __init__(
        self,
        start: Callable[[], Any],
        pid_file: Path,
        healthy: Callable[[], bool],
        recipe,
        rank: int,
        url: str,
        engine: str,
    ):
        t = recipe.target
        self.max_restarts, self.backoff_s = t.max_restarts, t.restart_backoff_s
        self.startup_timeout_s = getattr(t, engine).startup_timeout_s
        self._start, self.pid_file, self._healthy = start, pid_file, healthy
        self.rank, self.url, self.engine = rank, url, engine
        self.gave_up = ""
        """Why the server is not restarted any more (empty while it is)."""
        self.in_a_row = 0
        self._closing = threading.Event()
        self._lock = threading.Lock()  # watcher vs stop(): one server at a time
        self._thread: threading.Thread | None = None
        self.server = self._launch()

    @property
    def name(self) -> str:
        return f"{self.engine} server {self.url} (pid {self.server.proc.pid})"

    def _launch(self):
        server = self._start()
        tmp = self.pid_file.with_suffix(".tmp")
        tmp.write_text(str(server.proc.pid))
        tmp.replace(self.pid_file)
        return server

    def watch(self) -> None:
        """Start watching (once the first start succeeded: a server that cannot start at
        all fails the run at start-up, with its log)."""
        if self._thread is None:
            name = f"{self.engine}-keeper"
            self._thread = threading.Thread(target=self._watch, daemon=True, name=name)
            self._thread.start()

    def answered(self) -> None:
        """A request was answered: the next restart is the first in a row again."""
        self.in_a_row = 0

    def _watch(self) -> None:
        while not self._closing.wait(POLL_S):
            code = self.server.exit_code()
            if code is None:
                continue
            if self.in_a_row >= self.max_restarts:
                self.gave_up = (
                    f"{self.name} died (exit code {code}); gave up after {self.in_a_row} "
                    f"restart(s) in a row: target.max_restarts={self.max_restarts}; last log "
                    f"lines ({self.server.log_path}):\n{self.server.tail()}"
                )
                return
            self.in_a_row += 1
            backoff = self.backoff_s * 2 ** (self.in_a_row - 1)
            say(
                f"[rank {self.rank}] {self.name} died (exit code {code}); restarting it "
                f"({self.in_a_row} of at most {self.max_restarts}) in {backoff:g}s"
            )
            if self._closing.wait(backoff):
                return
            t0 = time.monotonic()
            with self._lock:
                if self._closing.is_set():
                    return
                self.server.stop()  # what is left of the old one goes before the new one
                self.server = self._launch()
            self._wait_healthy(t0)

    def _wait_healthy(self, t0: float) -> None:
        deadline = t0 + self.startup_timeout_s
        while not self._closing.is_set() and self.server.exit_code() is None:
            if self._healthy():
                took = time.monotonic() - t0
                say(f"[rank {self.rank}] {self.name} restarted in {took:.1f}s")
                return
            if time.monotonic() > deadline:
                self.server.stop()  # the next failure in a row
                return
            time.sleep(POLL_S)

    def stop(self) -> None:
        self._closing.set()
        with self._lock:
            self.server.stop()
