"""Robust row reading for jsonl / json / parquet files (optionally gzip-compressed json).

Rows are read and parsed here, one at a time, so that one malformed line never stops a
file: a line that is not UTF-8 or not JSON becomes a `RawRow` with an `error` and the
reader moves on. (`datasets`' own JSON loader is strict and fails the whole file on one
bad line.) Every row carries its 0-based index in the file (`row`) and, for line-based
files, its 1-based line number (`line`), which is what the rejects file reports.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

PREVIEW_CHARS = 2000
"""Raw rows longer than this are kept as a preview in the rejects file."""

SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")


@dataclass
class RawRow:
    """One row of an input file: its parsed value, or why it could not be parsed."""

    file: str
    row: int
    """0-based index of the row in the file (for jsonl: of the line)."""
    line: int | None
    """1-based line number (line-based files only)."""
    value: Any = None
    error: tuple[str, str] | None = None
    """(reason, detail) when the row could not be read or parsed."""
    raw: str = ""
    """The row's text when it could not be parsed (for the rejects file)."""
    blank: bool = False
    """A blank line of a jsonl file: not a row, counted apart."""

    @property
    def source(self) -> str:
        return f"{self.file}:{self.row}"


def preview(value: Any) -> str:
    """The row as text, cut to PREVIEW_CHARS (JSON for parsed values)."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, default=repr)
        except (ValueError, TypeError):
            text = repr(value)
    if len(text) > PREVIEW_CHARS:
        return text[:PREVIEW_CHARS] + f"... [{len(text)} chars]"
    return text


def json_line(obj: Any) -> bytes:
    """One jsonl line as UTF-8; text that UTF-8 cannot hold (lone surrogates) is escaped."""
    text = json.dumps(obj, ensure_ascii=False, default=repr)
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(obj, default=repr) + "\n").encode("ascii")


def check_input_file(path: str | Path) -> Path:
    """Raise ValueError unless `path` is an existing file of a supported kind."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"input file not found: {path}")
    if not p.name.endswith(SUFFIXES):
        raise ValueError(f"input file {path}: expected one of {', '.join(SUFFIXES)}")
    return p


def count_rows(path: str | Path) -> int | None:
    """Number of rows (lines for jsonl, rows for parquet, elements of a JSON array)."""
    p = Path(path)
    if p.name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq

            return pq.ParquetFile(p).metadata.num_rows
        except Exception:  # the reader reports the problem itself
            return None
    if p.name.endswith((".json", ".json.gz")):
        # a JSON array has no cheaper row count; parsing is small next to tokenising
        return sum(1 for _ in _read_json(p, str(p)))
    if p.name.endswith((".jsonl", ".jsonl.gz")):
        n = 0
        last = b"\n"
        with _open(p) as f:
            while chunk := f.read(1 << 20):
                n += chunk.count(b"\n")
                last = chunk[-1:]
        return n + (last != b"\n")
    return None


def read_rows(path: str | Path, label: str | None = None) -> Iterator[RawRow]:
    """Yield every row of `path`; `label` is the file name reported in sources."""
    p = check_input_file(path)
    label = label or str(path)
    if p.name.endswith(".parquet"):
        yield from _read_parquet(p, label)
    elif p.name.endswith((".json", ".json.gz")):
        yield from _read_json(p, label)
    else:
        yield from _read_lines(p, label)


def _open(p: Path) -> IO[bytes]:
    return gzip.open(p, "rb") if p.name.endswith(".gz") else open(p, "rb")


def _parse_line(data: bytes, file: str, row: int) -> RawRow:
    line_no = row + 1
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raw = data.decode("utf-8", "backslashreplace")
        return RawRow(file, row, line_no, error=("invalid_utf8", str(e)), raw=preview(raw))
    if row == 0:
        text = text.removeprefix("\ufeff")
    try:
        return RawRow(file, row, line_no, value=json.loads(text))
    except json.JSONDecodeError as e:
        detail = str(e)
    except RecursionError:
        detail = "nested too deeply"
    return RawRow(file, row, line_no, error=("bad_json", detail), raw=preview(text))


def _read_lines(p: Path, label: str) -> Iterator[RawRow]:
    """jsonl: one JSON value per line; blank lines come back marked `blank`."""
    with _open(p) as f:
        for row, data in enumerate(f):
            data = data.rstrip(b"\r\n")
            if not data.strip():
                yield RawRow(label, row, row + 1, blank=True)
                continue
            yield _parse_line(data, label, row)


def _read_json(p: Path, label: str) -> Iterator[RawRow]:
    """A JSON array of rows (or one object); a file that is not one JSON value is read
    as jsonl, so that a mislabelled jsonl file, or one damaged line, still loads."""
    with _open(p) as f:
        data = f.read()
    try:
        value = json.loads(data.decode("utf-8").removeprefix("\ufeff"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        yield from _read_lines(p, label)
        return
    rows = value if isinstance(value, list) else [value]
    for row, item in enumerate(rows):
        yield RawRow(label, row, None, value=item)


def _read_parquet(p: Path, label: str) -> Iterator[RawRow]:
    """Parquet in record batches; a file that fails part-way yields one error row."""
    import pyarrow.parquet as pq

    row = 0
    try:
        for batch in pq.ParquetFile(p).iter_batches(batch_size=1024):
            for item in batch.to_pylist():
                yield RawRow(label, row, None, value=item)
                row += 1
    except Exception as e:  # pyarrow raises many kinds; all mean unreadable
        detail = f"{type(e).__name__}: {e} (rows from {row} on could not be read)"
        yield RawRow(label, row, None, error=("unreadable_file", detail), raw="")


def batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """`items` in lists of `size` (the last one shorter), as they come."""
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
