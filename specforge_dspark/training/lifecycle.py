"""One job per run, and stops that lose nothing: signals, the launcher's death, the run lock.

- `StopRequest`: SIGTERM or SIGINT (to any rank, or to torchrun, which forwards them),
  or the death of the rank's launcher, asks for a stop. The loop calls `agreed()` at
  every optimizer-step boundary: a collective, so every rank sees the same answer, saves
  the same checkpoint and exits. A second signal aborts at once (KeyboardInterrupt).
  Bound: one optimizer step plus one checkpoint save after the signal.
- `watch_launcher()`: torchrun starts each rank in a session of its own, so when only the
  launcher dies (OOM killer, `kill -9`) its ranks would train on, writing and pruning
  checkpoints. A daemon thread notices the reparenting and requests a stop; a rank still
  alive `LAUNCHER_GRACE_S` later (blocked on a dead peer) exits hard, writing nothing.
- `RunLock`: an exclusive `flock` on `<train.output_dir>/.run.lock`, held by global rank 0
  for the whole job. A second job on the same output_dir is refused, naming the holder's
  host and pid; a lock left by a dead job is free again (the kernel drops it) and taken
  over, saying whose it was.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

LAUNCHER_GRACE_S = 60.0
"""How long an orphaned rank may take to reach a step boundary and save before it exits."""
POLL_S = 0.5


class StopRequest:
    """Records the first stop request of this rank; `agreed()` pools them over ranks."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.reason is not None:  # asked twice: the user means now
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} received twice")
        self.request(signal.Signals(signum).name)

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            print(f"[rank {os.environ.get('RANK', 0)}] {reason}: stopping at the next step "
                  "boundary after saving a checkpoint", flush=True)  # fmt: skip

    def agreed(self, device: torch.device) -> bool:
        """Collective: True on every rank when any rank was asked to stop."""
        local = self.reason is not None
        if not dist.is_initialized():
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def watch_launcher(stop: StopRequest, grace_s: float = LAUNCHER_GRACE_S) -> threading.Thread | None:
    """Under torchrun: request a stop when this rank's launcher dies (see module doc)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        stop.request(f"launcher (pid {parent}) died")
        time.sleep(grace_s)
        print(f"[rank {os.environ.get('RANK', 0)}] launcher gone and no step boundary "
              f"within {grace_s:g}s: exiting", flush=True)  # fmt: skip
        os._exit(75)

    thread = threading.Thread(target=watch, name="launcher-watchdog", daemon=True)
    thread.start()
    return thread


class RunLockError(RuntimeError):
    """Another live job holds this run's output_dir."""


class RunLock:
    """Exclusive lock of an output_dir (see module doc); `release()` or process exit frees it."""

    def __init__(self, output_dir: Path):
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / ".run.lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        previous = self._read()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            who = _describe(previous)
            raise RunLockError(
                f"train.output_dir {output_dir} is in use by a live job ({who}); stop it, "
                "or train into another train.output_dir"
            ) from None
        self.took_over = previous if previous.get("pid") else None
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(holder).encode(), 0)

    def _read(self) -> dict:
        try:
            return json.loads(os.pread(self._fd, 4096, 0) or b"{}")
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self._fd >= 0:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = -1


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "holder unknown"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"host {holder.get('host')}, pid {holder.get('pid')}, since {since}"


def acquire_run_lock(output_dir: Path, rank: int) -> RunLock | None:
    """Collective: global rank 0 takes the lock; every rank raises RunLockError if it
    could not (the others would otherwise wait on rank 0 forever)."""
    lock, message = None, ""
    if rank == 0:
        try:
            lock = RunLock(output_dir)
            if lock.took_over:
                print(f"run lock: took over {lock.path} from a dead job "
                      f"({_describe(lock.took_over)})", flush=True)  # fmt: skip
        except RunLockError as e:
            message = str(e)
    if dist.is_initialized():
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message:
        raise RunLockError(message)
    return lock
