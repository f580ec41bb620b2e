"""Exactly-once, resumable jsonl output for regeneration.

Each finished row is appended to the output as one line with a single `os.write` on an
`O_APPEND` descriptor, so a killed process leaves whole lines plus at most one torn last
line. On open, a torn last line is cut off and the ids already present are read back:
those rows are skipped, everything else is (re)done. Rows that failed go to the errors
file (same format, with a reason) and count as done unless `retry_errors`; transient
failures (server unreachable, timeouts, 5xx) are logged there too but retried on resume. Files are
fsynced at most once a second and on close, so even a machine crash loses only the last
second of work and never duplicates a row. A lock file keeps a second writer away.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from data_pipelines.ingest import json_line

FSYNC_EVERY_S = 1.0


def _repair_and_read_ids(path: Path) -> tuple[set[str], int]:
    """Cut a torn last line off `path`; return its ids (leaving out transient errors, which
    are to be retried) and how many lines were bad."""
    if not path.exists():
        return set(), 0
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    if cut < len(data):
        with open(path, "r+b") as f:
            f.truncate(cut)
            os.fsync(f.fileno())
    ids, bad = set(), 0
    for line in data[:cut].splitlines():
        try:
            rec = json.loads(line)
            if not rec.get("transient"):
                ids.add(str(rec["id"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            bad += 1
    return ids, bad


class _Appender:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.last_sync = time.monotonic()
        self.dirty = False

    def append(self, record: dict[str, Any]) -> None:
        data = memoryview(json_line(record))
        while data:
            n = os.write(self.fd, data)
            data = data[n:]
        self.dirty = True
        if time.monotonic() - self.last_sync >= FSYNC_EVERY_S:
            self.sync()

    def sync(self) -> None:
        if self.dirty:
            os.fsync(self.fd)
            self.dirty = False
        self.last_sync = time.monotonic()

    def close(self) -> None:
        self.sync()
        os.close(self.fd)


class Journal:
    """Output and errors files of one regeneration, with the set of finished ids."""

    def __init__(self, out: str | Path, errors: str | Path, retry_errors: bool = False) -> None:
        self.out_path, self.err_path = Path(out), Path(errors)
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.out_path.with_name(self.out_path.name + ".lock"), "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(f"another process is writing {self.out_path}") from None
        if retry_errors and self.err_path.exists():
            self.err_path.rename(self.err_path.with_name(f"{self.err_path.name}.{time.time():.0f}"))
        self.done, self.bad_lines = _repair_and_read_ids(self.out_path)
        self.failed, _ = _repair_and_read_ids(self.err_path)
        self._out = _Appender(self.out_path)
        self._err = _Appender(self.err_path)
        self.written = 0
        self.errors = 0

    def is_done(self, row_id: str) -> bool:
        return row_id in self.done or row_id in self.failed

    def write(self, record: dict[str, Any]) -> None:
        """Append a finished row (once: a second write of the same id is an error)."""
        rid = str(record["id"])
        assert rid not in self.done, f"row {rid} written twice"
        self._out.append(record)
        self.done.add(rid)
        self.written += 1

    def error(
        self, row_id: str, source: str, reason: str, detail: str = "", transient: bool = False
    ) -> None:
        """Log a failed row; a transient failure is logged but the row stays to do."""
        rec = {"id": row_id, "source": source, "reason": reason, "detail": detail}
        if transient:
            rec["transient"] = True
        self._err.append(rec)
        if not transient:
            self.failed.add(row_id)
        self.errors += 1

    def close(self) -> None:
        self._out.close()
        self._err.close()
        self._lock.close()
