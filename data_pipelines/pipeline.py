"""One prepare run: read rows, normalise, render, mask, write data, rejects and report.

Output folder layout (written into a temporary folder by the caller, then renamed):

    data.arrow            the prepared rows (datasets Arrow file; `Dataset.from_file`)
    rejects.jsonl         one line per rejected row: file, row, line, reason, detail, raw
    prepare_report.json   {"rows_read", "rows_kept", "rejected": {reason: n},
                           "supervised_tokens", ...}

Rows are processed in chunks: rendering is Python (Jinja), tokenisation is one batched
call to the Rust tokenizer per chunk. With `num_proc > 1` chunks go to worker processes
and come back in order, so sample ids never depend on the number of workers.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from data_pipelines.formats import FormatConfig, RowError, normalize
from data_pipelines.ingest import count_rows, json_line, preview, read_rows
from data_pipelines.render import ChatRenderer, load_tokenizer

CHUNK_ROWS = 256

COLUMNS = (
    "sample_id",
    "source",
    "input_ids",
    "loss_mask",
    "num_supervised",
    "num_tokens",
    "truncated",
)


def features():
    """datasets.Features of the prepared rows (imported here: workers never need datasets)."""
    from datasets import Features, List, Value

    return Features(
        {
            "sample_id": Value("int64"),
            "source": Value("string"),
            "input_ids": List(Value("int32")),
            "loss_mask": List(Value("int8")),
            "num_supervised": Value("int32"),
            "num_tokens": Value("int32"),
            "truncated": Value("bool"),
        }
    )


@dataclass(frozen=True)
class PrepareParams:
    """Everything that decides the prepared rows (and so enters the cache key)."""

    files: tuple[str, ...]
    tokenizer_path: str
    fmt: FormatConfig = field(default_factory=FormatConfig)
    max_length: int = 4096
    max_rows: int = 0
    """Rows per file (0 = all)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    num_proc: int = 1


@dataclass
class Stats:
    rows_read: int = 0
    rows_kept: int = 0
    rejected: Counter = field(default_factory=Counter)
    supervised_tokens: int = 0
    tokens: int = 0
    rows_truncated: int = 0
    blank_lines: int = 0

    def report(self, params: PrepareParams, seconds: float) -> dict[str, Any]:
        return {
            "rows_read": self.rows_read,
            "rows_kept": self.rows_kept,
            "rejected": dict(sorted(self.rejected.items())),
            "supervised_tokens": self.supervised_tokens,
            "tokens": self.tokens,
            "rows_truncated": self.rows_truncated,
            "blank_lines": self.blank_lines,
            "files": list(params.files),
            "max_length": params.max_length,
            "seconds": round(seconds, 3),
            "rows_per_s": round(self.rows_read / seconds, 1) if seconds > 0 else None,
        }


# ------------------------------------------------------------------ chunk work (workers)

_WORKER: dict[str, Any] = {}


def _init_worker(params: PrepareParams) -> None:
    tok = load_tokenizer(params.tokenizer_path)
    _WORKER["renderer"] = ChatRenderer(tok, params.template_kwargs)
    _WORKER["params"] = params


def _process_chunk(values: list[Any]) -> list[tuple[str, Any]]:
    """Parsed rows -> ("ok", (ids, mask, truncated)) or ("reject", (reason, detail)) each."""
    renderer: ChatRenderer = _WORKER["renderer"]
    params: PrepareParams = _WORKER["params"]
    results: list[Any] = [None] * len(values)
    layouts, where = [], []
    for k, value in enumerate(values):
        try:
            conv = normalize(value, params.fmt)
            renderer.check_specials(conv)
            layouts.append(renderer.layout(conv))
            where.append(k)
        except RowError as e:
            results[k] = ("reject", (e.reason, e.detail))
        except Exception as e:  # a row we did not foresee: report it, keep going
            results[k] = ("reject", ("unexpected_error", f"{type(e).__name__}: {e}"))
    for k, enc in zip(where, renderer.encode(layouts, params.max_length), strict=True):
        if enc.has_pair:
            results[k] = ("ok", (enc.input_ids, enc.loss_mask, enc.truncated))
        elif enc.truncated:
            results[k] = ("reject", ("truncated_no_supervision", f"max_length {params.max_length}"))
        else:
            results[k] = ("reject", ("too_few_supervised_tokens", f"{enc.num_supervised} tokens"))
    return results


# ------------------------------------------------------------------ the run


class _Run:
    """Writers and counters of one run into `out_dir`."""

    def __init__(self, params: PrepareParams, out_dir: Path, progress: bool) -> None:
        self.params = params
        self.stats = Stats()
        from datasets.arrow_writer import ArrowWriter

        self.writer = ArrowWriter(features=features(), path=str(out_dir / "data.arrow"))
        self.rejects = open(out_dir / "rejects.jsonl", "wb")
        total = _total_rows(params)
        self.bar = tqdm(total=total, unit="row", disable=not progress, mininterval=0.5)

    def reject(self, file: str, row: int, line: int | None, reason: str, detail: str, raw) -> None:
        self.stats.rejected[reason] += 1
        rec = {"file": file, "row": row, "line": line, "reason": reason, "detail": detail}
        rec["raw"] = raw if isinstance(raw, str) else preview(raw)
        self.rejects.write(json_line(rec))

    def write(self, chunk: list[tuple], results: list[tuple[str, Any]]) -> None:
        batch: dict[str, list] = {k: [] for k in COLUMNS}
        for (file, row, line, value), (kind, payload) in zip(chunk, results, strict=True):
            if kind == "reject":
                self.reject(file, row, line, payload[0], payload[1], value)
                continue
            ids, mask, truncated = payload
            n_sup = sum(mask)
            batch["sample_id"].append(self.stats.rows_kept)
            batch["source"].append(f"{file}:{row}")
            batch["input_ids"].append(ids)
            batch["loss_mask"].append(mask)
            batch["num_supervised"].append(n_sup)
            batch["num_tokens"].append(len(ids))
            batch["truncated"].append(truncated)
            self.stats.rows_kept += 1
            self.stats.supervised_tokens += n_sup
            self.stats.tokens += len(ids)
            self.stats.rows_truncated += truncated
        if batch["sample_id"]:
            self.writer.write_batch(batch)
        self.bar.update(len(chunk))
        self.bar.set_postfix(kept=self.stats.rows_kept, rejected=self.stats.rejected.total())

    def close(self) -> None:
        self.writer.finalize()
        self.rejects.close()
        self.bar.close()


def _total_rows(params: PrepareParams) -> int | None:
    total = 0
    for f in params.files:
        n = count_rows(f)
        if n is None:
            return None
        total += min(n, params.max_rows) if params.max_rows else n
    return total


def _chunks(run: _Run) -> Iterator[list[tuple]]:
    """Parsed rows in chunks of (file, row, line, value); unreadable rows rejected here."""
    chunk: list[tuple] = []
    limit = run.params.max_rows
    for path in run.params.files:
        taken = 0
        for raw in read_rows(path):
            if raw.blank:
                run.stats.blank_lines += 1
                run.bar.update(1)
                continue
            if limit and taken >= limit:
                break
            taken += 1
            run.stats.rows_read += 1
            if raw.error:
                run.reject(raw.file, raw.row, raw.line, raw.error[0], raw.error[1], raw.raw)
                run.bar.update(1)
                continue
            chunk.append((raw.file, raw.row, raw.line, raw.value))
            if len(chunk) >= CHUNK_ROWS:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def run_prepare(params: PrepareParams, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Prepare `params.files` into `out_dir`; returns the report (also written there)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    _init_worker(params)  # here too: a bad tokenizer fails before any output
    run = _Run(params, out_dir, progress)
    try:
        chunks = _chunks(run)
        items = ((c, [v for _, _, _, v in c]) for c in chunks)
        if params.num_proc > 1:
            # spawn, not fork: the caller may be a trainer with threads (fork could hang)
            with mp.get_context("spawn").Pool(params.num_proc, _init_worker, (params,)) as pool:
                window: deque = deque()  # (chunk, result) in input order, bounded
                for c, w in items:
                    window.append((c, pool.apply_async(_process_chunk, (w,))))
                    if len(window) > 2 * params.num_proc:
                        c0, f0 = window.popleft()
                        run.write(c0, f0.get())
                for c0, f0 in window:
                    run.write(c0, f0.get())
        else:
            for c, w in items:
                run.write(c, _process_chunk(w))
    finally:
        run.close()
    report = run.stats.report(params, time.perf_counter() - t0)
    (out_dir / "prepare_report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
