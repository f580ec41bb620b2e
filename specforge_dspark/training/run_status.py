"""`<train.output_dir>/run_status.json`: what a scheduler reads to decide to resume a job.

torchrun's own exit status cannot tell a stop from a failure (docs/faults.md), so the run
says it in a file. It is written:
- at start, by global rank 0 once it holds the run lock (`running`, pid, host, start
  time): the previous run's outcome never survives into a new run;
- every BEAT_S by a thread of rank 0 that runs from that start to the run's end (a job
  alive in a half-hour server start or a long save is beaten too), and every log
  interval by the loop (`heartbeat`, with the step): a run killed by SIGKILL or the OOM
  killer cannot write its end, so it is recognised by a heartbeat older than
  `stale_after_s` (`effective_status`);
- by a refusal before the run started (a recipe that does not load, a checkpoint that
  cannot resume): a fresh `refused` status, never merged into the last run's outcome,
  unless a live job's `running` status is there (that job's file is left alone);
- on every exit path of every rank (`ranks.<r>`): the job's `status`, `exit_code`,
  `detail` and `resumable` are those of the first failure any rank recorded (a rank
  that fails later in a collective its peer left is a consequence, not the cause).

States, their exit codes and whether `--resume auto` can succeed:

    running    -    the job is alive (while the heartbeat is fresh)
    finished   0    every step trained and exported
    stopped   143   SIGTERM/SIGINT or the launcher's death: saved, resumable
    failed     1    resumable for a lost target server or worker and a timeout; not for
                    non-finite steps beyond train.max_nonfinite_steps, a checkpoint that
                    cannot be written (free space first) or an unexpected error
    refused    2    the recipe or the checkpoint cannot make this run (not resumable: a
                    retry would be refused again)

Writes are atomic (a temporary file renamed over) and merged under an flock of
`run_status.lock` beside it; a status that cannot be written warns and never hides the
run's own outcome.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

RUN_STATUS = "run_status.json"
EXIT_CODES = {"finished": 0, "failed": 1, "refused": 2, "stopped": 143}
RESUMABLE_ERRORS = ("TargetLost", "TargetGone", "TimeoutError")
"""Failures a resume gets past: the server or worker is started again by the next run, or
the attached servers that did not answer in time may answer the next one."""
BEAT_S = 30.0
"""How often rank 0's thread beats the heartbeat while the job runs."""
STALE_AFTER_S = 900.0
"""A `running` status whose heartbeat is older than this (or than 10 log intervals, when
that is longer) belongs to a job that died without writing its end."""


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class RunStatus:
    """One rank's writer of the job's status file (see the module docstring)."""

    def __init__(self, output_dir: str | Path, rank: int):
        self.path = Path(output_dir) / RUN_STATUS
        self.rank = rank
        self.started = False
        self._ended = threading.Event()

    def start(self) -> None:
        """Rank 0, holding the run lock: a fresh `running` status (nothing of the last run),
        then beaten by a thread until `end`."""
        self.started = True
        if self.rank != 0:
            return
        now = time.time()
        body = {
            "status": "running",
            "exit_code": None,
            "detail": "starting",
            "resumable": False,
            "resume": "",
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _now(),
            "heartbeat": now,
            "heartbeat_time": _now(),
            "stale_after_s": STALE_AFTER_S,
            "ranks": {},
        }
        if self._update(lambda _: body, fresh=True):  # an unwritable file warned once
            threading.Thread(target=self._keep_beating, name="run-status", daemon=True).start()

    def _keep_beating(self) -> None:
        def beat(body: dict[str, Any]) -> dict[str, Any]:
            if body.get("status") == "running" and body.get("pid") == os.getpid():
                body["heartbeat"], body["heartbeat_time"] = time.time(), _now()
            return body

        while not self._ended.wait(BEAT_S):
            self._update(beat)

    def heartbeat(self, step: int, total_steps: int, interval_s: float) -> None:
        """Rank 0, each log interval: the job is alive at `step`."""
        if self.rank != 0:
            return

        def beat(body: dict[str, Any]) -> dict[str, Any]:
            if body.get("status") == "running":
                body["heartbeat"], body["heartbeat_time"] = time.time(), _now()
                body["detail"] = f"step {step} of {total_steps}"
                body["stale_after_s"] = max(STALE_AFTER_S, 10 * interval_s)
            return body

        self._update(beat)

    def refuse(self, detail: str) -> None:
        """Before this job started (no `start`): a fresh `refused` status in place of the
        last run's outcome, unless a live job's `running` status is there."""
        if self.started or self.rank != 0:
            self.end("refused", detail)
            return
        fresh = {"status": "refused", "exit_code": EXIT_CODES["refused"], "detail": detail,
                 "resumable": False, "resume": "", "pid": os.getpid(),
                 "host": socket.gethostname(), "ended": _now(), "ranks": {}}  # fmt: skip

        def replace(body: dict[str, Any]) -> dict[str, Any]:
            if effective_status(body) == "running":
                print(f"warning: {self.path} belongs to a live job; left as it is",
                      file=sys.stderr, flush=True)  # fmt: skip
                return body
            return fresh

        self._update(replace)

    def end(self, status: str, detail: str, error: str = "") -> None:
        """Any rank, on its way out: record its outcome and the job's."""
        self._ended.set()
        code = EXIT_CODES[status]
        resumable = status == "stopped" or (status == "failed" and error in RESUMABLE_ERRORS)
        mine = {
            "status": status,
            "exit_code": code,
            "detail": detail,
            "resumable": resumable,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": _now(),
        }

        def record(body: dict[str, Any]) -> dict[str, Any]:
            body.setdefault("ranks", {})[str(self.rank)] = mine
            first_failure = body.get("status") in ("failed", "refused")
            if first_failure or (body.get("status") == "stopped" and status == "finished"):
                return body  # the cause stays; this rank's own outcome is under ranks
            body.update(
                status=status,
                exit_code=code,
                detail=detail if self.rank == 0 else f"rank {self.rank}: {detail}",
                resumable=resumable,
                resume="--resume auto" if resumable else "",
                ended=_now(),
            )
            return body

        self._update(record)

    def _update(self, change, fresh: bool = False) -> bool:
        """Apply `change` to the file's content under its lock; False (after a warning)
        when it cannot be written."""
        lock_path = self.path.with_name(RUN_STATUS + ".lock")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(lock_path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                body = {} if fresh else read_run_status(self.path)
                body = change(body)
                tmp = self.path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(body, indent=1) + "\n")
                os.replace(tmp, self.path)
        except OSError as e:
            print(f"warning: could not write {self.path}: {e}", file=sys.stderr, flush=True)
            return False
        return True


def read_run_status(path: str | Path) -> dict[str, Any]:
    """The file's content, or {} when it is missing or unreadable."""
    try:
        body = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def effective_status(body: dict[str, Any], now: float | None = None) -> str:
    """The status a scheduler should act on: `killed` for a `running` job whose heartbeat
    is stale (it died without writing its end; resumable from its last checkpoint)."""
    status = body.get("status", "")
    if status != "running":
        return status
    age = (time.time() if now is None else now) - float(body.get("heartbeat", 0))
    return "killed" if age > float(body.get("stale_after_s", STALE_AFTER_S)) else "running"


def refuse_unloaded(recipe_path: str | Path, overrides: list[str], detail: str) -> None:
    """A recipe that does not load (config.RecipeError): global rank 0 writes a fresh
    `refused` status into the train.output_dir its YAML or overrides name, where that
    folder exists (a scheduler must not read the last run's `failed, resumable` there and
    retry). Nothing is written when neither names one: the default folder may be another
    run's."""
    if int(os.environ.get("RANK", 0)) != 0:
        return
    out = None
    try:
        import yaml

        raw = yaml.safe_load(Path(recipe_path).read_text())
        out = raw["train"]["output_dir"]
    except Exception:  # the recipe is broken: only the overrides may still say
        pass
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "train.output_dir":
            out = value.strip()
    if isinstance(out, str) and out and Path(out).is_dir():
        RunStatus(out, 0).refuse(detail)
