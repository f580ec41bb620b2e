"""The watchdog beside each server we start: the server dies with its trainer.

A server runs in a session of its own (engines/server.py), so nothing ties it to the
trainer process that started it: a trainer that ends by SIGKILL, `os._exit` or the OOM
killer never runs `ServerKeeper.stop()`, and the server would keep its port and memory.
`EngineServer` therefore starts this script beside each server,

    <trainer's python> -I reaper.py <server pgid> <trainer pid>

in a session of its own too (a signal to the trainer's group does not reach it), with the
trainer as its parent. Every POLL_S it looks: the trainer is gone when the reaper's parent
pid is no longer the trainer's (it was re-parented; no pid-reuse race), and then it ends
the server's process group (SIGTERM, SIGKILL after TERM_WAIT_S); it exits as soon as the
group is gone, however it went. Not PR_SET_PDEATHSIG on the server: that fires when the
*thread* that forked it exits, and the keeper restarts servers from a thread.

Run by path with -I (stdlib only, no package import: no torch), so it starts in ~50 ms.
`group_running`, `kill_group` and `server_gone` are the /proc helpers the trainer side uses too.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

POLL_S = 0.5
TERM_WAIT_S = 3.0


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


def server_gone(pid: int | None, old: int, look_at_group: bool) -> str:
    """Why the server of pid `old` that requests went to is gone ("" while it serves):
    `pid`, the pid its file names now, is another one (its keeper started a new server),
    or, with `look_at_group`, its process group has no live process (a rank that did not
    start it, so cannot wait for it as its parent)."""
    if pid != old:
        return f"was replaced by pid {pid}"
    if look_at_group and not group_running(old):
        return "is gone: its process group has no live process"
    return ""


def kill_group(pgid: int, wait_s: float = 10.0) -> None:
    """SIGKILL process group `pgid` (a stopped one too) and wait until none of its
    processes runs (zombies left to their parent do not count)."""
    if pgid <= 0:  # killpg(0) is the caller's own group: never a server's
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if not group_running(pgid):
            return
        time.sleep(0.05)


def end_group(pgid: int) -> None:
    """SIGTERM the group, SIGKILL what is left after TERM_WAIT_S."""
    if pgid <= 0:
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + TERM_WAIT_S
    while group_running(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_group(pgid)


def main(argv: list[str]) -> int:
    pgid, trainer = int(argv[0]), int(argv[1])
    while group_running(pgid):
        if os.getppid() != trainer:
            print(
                f"[reaper] trainer pid {trainer} is gone; ending server process group {pgid}",
                file=sys.stderr,
                flush=True,
            )
            end_group(pgid)
            return 0
        time.sleep(POLL_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
