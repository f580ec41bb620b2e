"""Rank-0 tracking: trackio (local SQLite, offline), metrics.jsonl and a progress bar with ETA.

`<train.output_dir>/metrics.jsonl` gets one JSON line per logged step (what trackio
gets), so a run's curves can be read without trackio. A resumed run first cuts the file
back to the checkpoint's step (lines past it are logged again, and a line a kill left
half-written is dropped), so the file reads as one uninterrupted history.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specforge_dspark.config.recipe import Recipe


def dashboard_command(project: str) -> str:
    """The shell command that shows this run's trackio dashboard: trackio's own hint
    lacks the database folder (TRACKIO_DIR) a run sets."""
    where = shlex.quote(os.environ["TRACKIO_DIR"])
    return f"TRACKIO_DIR={where} trackio show --project {shlex.quote(project)}"


class Tracker:
    """Logs scalars to trackio and drives the progress bar; a no-op on ranks other than 0.

    `into`: a companion drafter's tracker (training/drafters.py) writes its own
    metrics.jsonl, has no bar, and logs to trackio through `into`'s run with its keys
    prefixed `prefix` (trackio holds one run per process)."""

    def __init__(
        self,
        recipe: Recipe,
        rank: int,
        total_steps: int,
        start_step: int,
        trackio_dir: Path,
        into: Tracker | None = None,
        prefix: str = "",
    ):
        self.active = rank == 0
        self._run = None
        self.into, self.prefix = into, prefix
        self.jsonl = Path(recipe.train.output_dir) / "metrics.jsonl"
        if self.active:
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            rewind_jsonl(self.jsonl, start_step)
        if self.active and recipe.tracking.enabled and into is None:
            if recipe.tracking.dir or "TRACKIO_DIR" not in os.environ:
                os.environ["TRACKIO_DIR"] = str(Path(trackio_dir).resolve())
            Path(os.environ["TRACKIO_DIR"]).mkdir(parents=True, exist_ok=True)
            import trackio  # reads TRACKIO_DIR at import

            self._trackio = trackio
            self.project = recipe.tracking.project
            self.run_name = recipe.tracking.run_name or Path(recipe.source).stem or "run"
            said = io.StringIO()
            with contextlib.redirect_stdout(said):  # its dashboard hint omits TRACKIO_DIR
                self._run = trackio.init(
                    project=self.project,
                    name=self.run_name,
                    config=recipe.to_dict(),
                    resume="allow",
                    embed=False,
                    auto_log_cpu=False,
                    auto_log_gpu=False,
                )
            for line in said.getvalue().splitlines():
                if not any(x in line for x in ("View dashboard", "trackio show", "trackio.show(")):
                    print(line)
            print(f"* trackio dashboard: {dashboard_command(self.project)}", flush=True)
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            disable=not self.active or into is not None,
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=1.0,
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        if self._run is not None:
            self._trackio.log(metrics, step=step)
        elif self.into is not None and self.into._run is not None:
            self.into._trackio.log({self.prefix + k: v for k, v in metrics.items()}, step=step)
        with self.jsonl.open("a") as f:  # plain copy next to the run, one line per log step
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        short = {k: metrics[k] for k in ("loss", "tau", "tau_expected", "lr") if k in metrics}
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in short.items()}, refresh=False)

    def advance(self, n: int = 1) -> None:
        self.bar.update(n)

    def write(self, line: str) -> None:
        if self.active:
            self.bar.write(line)  # tqdm.write: printed above the bar, or plainly without one

    def close(self) -> None:
        self.bar.close()
        if self._run is not None:
            self._trackio.finish()
            self._run = None


def rewind_jsonl(path: Path, step: int) -> int:
    """Keep the complete lines of `path` logged at or before `step`; returns lines dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines(keepends=True):
        try:
            record = json.loads(line) if line.endswith("\n") else None
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return dropped


def reduce_metrics(window: list[dict]) -> dict:
    """Mean over the micro-steps of a logging window (the objective already pooled ranks).

    Per-position entries are NaN in a micro-step with no supervised slot there: ignored."""
    keys = sorted(window[0])
    vals = torch.tensor([[m.get(k, float("nan")) for k in keys] for m in window])
    mean = vals.to(torch.float64).nanmean(0)
    return {k: v for k, v in zip(keys, mean.tolist(), strict=True) if v == v}


class StepWindow:
    """The training metrics since the last logged step, carried across a stop in the
    checkpoint's TrainState (`log_window`, `log_tokens`), so that a resumed run logs the
    same curves as an uninterrupted one."""

    def __init__(self, state, now: float):
        self.window: list[dict] = state.log_window
        self.t_last, self.wait_last, self.tokens_last = now, 0.0, state.log_tokens

    def add(self, out) -> None:
        if out is not None:  # None: a skipped (non-finite) micro-step
            self.window.append(out.log_dict())

    def log(self, tracker: Tracker, state, eng, wait_seconds: float, report, now: float) -> None:
        """Log the window's mean with the interval's lr, grad norm, throughput and the share
        of it spent waiting for features; then start a new window."""
        dt = max(now - self.t_last, 1e-9)
        metrics = reduce_metrics(self.window) if self.window else {}
        metrics.update(report.metrics)
        metrics.update(
            lr=eng.get_lr()[0],
            grad_norm=float(eng.get_global_grad_norm() or 0.0),
            tokens_per_s=(state.tokens - self.tokens_last) / dt,
            wait_fraction=(wait_seconds - self.wait_last) / dt,
            epoch=state.epoch,
        )
        if report.skipped:
            metrics.pop("grad_norm")  # inf: DeepSpeed's mark of a skipped step
        tracker.log(state.step, metrics)
        self.t_last, self.wait_last, self.tokens_last = now, wait_seconds, state.tokens
        self.window = []

    def save_into(self, state) -> None:
        state.log_window, state.log_tokens = list(self.window), self.tokens_last
