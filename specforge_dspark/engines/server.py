"""An engine's server process, whatever the engine (SGLang, vLLM, the next transport).

`EngineServer` runs `<python> -m <launcher> <args>` under the engine's own interpreter
(checked first: launch.py `engine_python`, which also makes its environment and flags),
in a process group of its own, logging to a file; `stop` ends the whole group (API
server, scheduler, workers). Beside each server runs its reaper (reaper.py), which
ends the server's group when the trainer process is gone however it ended (SIGKILL, the
OOM killer: no `stop` ran).

`ServerKeeper` starts the server (a factory that returns an `EngineServer`), records its
pid in `<output_dir>/<engine>_server_rank<r>.pid` so the node's other ranks can kill a
hung one. Before its first start, a server of an earlier job that this pid file names and
that still serves the port (a reaper killed too) is stopped, naming it; anything else on
the port is refused: a server started for another recipe is never reused. Once told to
`watch()`, it restarts the server from a thread: a server that exits is started again on
the same port, at most `target.max_restarts` times in a row (a request answered in
between resets the count, `answered()`), after `target.restart_backoff_s * 2**(k-1)`
seconds, each to answer within `startup_timeout_s` (config/validate.py keeps the sum
within dist.timeout_s, the longest a peer waits in a collective meanwhile). The thread,
not the training loop, restarts it: a rank blocked in a collective (waiting for a peer
that waits for features) still brings the server back. The old process group is gone
before the new server starts, so no old process writes a slot after its tickets were
re-issued.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import Request

from specforge_dspark.engines.api_key import auth_headers, redacting_log
from specforge_dspark.engines.reaper import group_running, kill_group
from specforge_dspark.transport.features import TargetLost

POLL_S = 0.5
CLOCK_SLACK_S = 2.0
REAPER = str(Path(__file__).resolve().with_name("reaper.py"))


def http_ok(url: str, key: str | None = None) -> bool:
    """Whether a GET of `url` (with API key `key`) answers 200 within 5 s."""
    try:
        with urllib.request.urlopen(Request(url, headers=auth_headers(key)), timeout=5.0) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def post_json(url: str, body: bytes, timeout_s: float, fut: Future, key: str | None = None) -> None:
    """POST a JSON `body` to a live server's `url` (with API key `key`); its JSON reply, or
    the failure, lands in `fut`: TargetLost when the server cannot be reached (refused,
    reset, socket timeout), RuntimeError for an HTTP error (401: a wrong or missing key)
    or a reply that is not JSON. The trainer's own deadline fires first; `timeout_s` only
    frees the thread."""
    headers = {"Content-Type": "application/json", **auth_headers(key)}
    req = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            fut.set_result(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        fut.set_exception(RuntimeError(f"HTTP {e.code}: {detail}"))
    except (OSError, http.client.HTTPException) as e:
        fut.set_exception(TargetLost(f"{type(e).__name__}: {e}"))
    except Exception as e:  # bad JSON
        fut.set_exception(RuntimeError(f"{type(e).__name__}: {e}"))


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text())
    except (OSError, ValueError):
        return None


def started_at(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch (Linux /proc; None: gone)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, IndexError, ValueError, StopIteration):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def cmdline(pid: int) -> str:
    """Process `pid`'s command line, space-joined ("" when it is gone or a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def port_taken(host: str, port: int) -> bool:
    """Whether something else holds host:port (binding it says EADDRINUSE; any other
    failure, an unknown host say, is the server's own to report)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def written_since(path: Path, t: float) -> bool:
    """Whether `path` exists and was last written at or after `t` (epoch seconds, less
    CLOCK_SLACK_S: /proc start times are whole-second boot time plus clock ticks)."""
    try:
        return path.stat().st_mtime >= t - CLOCK_SLACK_S
    except OSError:
        return False


def pid_file_current(pid_file: Path | None) -> bool:
    """Whether `pid_file` was written since this process started (None: an attached
    server, nothing to check). A rank that did not start its node's server trusts the port
    only then: a leftover server of an earlier job, whose file is older, is never used
    before the starting rank has replaced it."""
    return pid_file is None or written_since(pid_file, started_at(os.getpid()) or 0.0)


def tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of log `path` ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class EngineServer:
    """`<exe> -m <launcher> <args>` in its own process group, logging to `log_path`
    (through api_key.redacting_log when it listens with `api_key`); `term_wait_s`: how
    long `stop` waits after SIGTERM before SIGKILL."""

    def __init__(
        self,
        exe: str,
        launcher: str,
        args: list[str],
        log_path: Path,
        env: dict[str, str],
        term_wait_s: float = 30.0,
        api_key: str | None = None,
    ):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path, self.term_wait_s = log_path, term_wait_s
        self.redactor = redacting_log(log_path, api_key) if api_key else None
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [exe, "-m", launcher, *args],
                stdout=self.redactor.stdin if self.redactor else log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
            self.reaper = subprocess.Popen(  # ends the server if this process dies
                [sys.executable, "-I", REAPER, str(self.proc.pid), str(os.getpid())],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if self.redactor:  # the server's copy only: it ends at the server's last line
            self.redactor.stdin.close()

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        return tail(self.log_path, lines)

    def wait_up(self, up: Callable[[], bool], what: str, timeout_s: float) -> float:
        """Seconds until `up()` holds. Stops the server and raises when it exits first
        (RuntimeError with its log's tail) or after `timeout_s` (TimeoutError)."""
        t0 = time.monotonic()
        try:
            while not up():
                code = self.exit_code()
                if code is not None:
                    raise RuntimeError(f"{what} exited ({code}); log tail:\n{self.tail(40)}")
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"{what} not healthy within {timeout_s:g}s")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - t0

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
        for helper in filter(None, (self.reaper, self.redactor)):  # end with the group
            try:
                helper.wait(POLL_S * 4)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait()


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
        self._clear_leftover()
        self.server = self._launch()

    @property
    def name(self) -> str:
        return f"{self.engine} server {self.url} (pid {self.server.proc.pid})"

    def _clear_leftover(self) -> None:
        """Before the first start: a server of an earlier job that `pid_file` names (alive,
        started before the file was written, serving our port) is stopped, naming it;
        anything else on the port is refused, naming the port. Never attached to."""
        where = urlsplit(self.url)
        host, port = where.hostname or "127.0.0.1", where.port or 80
        pid = read_pid(self.pid_file)
        if pid is not None and group_running(pid):
            cmd, born = cmdline(pid), started_at(pid)
            if f"--port {port}" in cmd and born is not None and written_since(self.pid_file, born):
                say(
                    f"[rank {self.rank}] stopping a leftover {self.engine} server of an earlier "
                    f"job on port {port}: process group {pid} (from {self.pid_file}): {cmd[:300]}"
                )
                kill_group(pid)
        if port_taken(host, port):
            key = f"target.{self.engine}"
            raise ValueError(
                f"{key}.port={port}: {host}:{port} is taken by a process that is not a server "
                f"of this run ({self.pid_file} names none there); the run does not reuse it: "
                f"stop it, choose another {key}.port, or attach to it on purpose with {key}.url"
            )

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
                f"({self.in_a_row} of target.max_restarts={self.max_restarts} in a row) in "
                f"{backoff:g}s, to answer within target.{self.engine}.startup_timeout_s="
                f"{self.startup_timeout_s:g}s"
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
