"""Tiny 2-rank training runs for the fault tests (non-finite values, storage, workers).

Every run has the same training math (8 steps of recipes/tiny_cpu.yaml on 48 rows, a
checkpoint every step), so its losses, weights and trained sample ids compare with one
uninterrupted `reference` run, made once per session.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tests.faults_helpers import wait_end
from tests.inject import drills
from tests.live_sglang import free_port

REPO = Path(__file__).resolve().parents[1]
STEPS = 8
OVERRIDES = [
    f"train.max_steps={STEPS}",
    "train.log_interval=1",
    "train.eval_interval=0",
    "checkpoint.save_interval=1",
    "checkpoint.keep_last=20",
    "data.max_rows=48",
    "data.max_length=160",
    "objective.num_anchors=16",
    "objective.chunk_size=8",
    "tracking.enabled=false",
    "train.preflight_samples=0",
    "export.formats=[]",
]


def command(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "train.py",
        "--recipe",
        "recipes/tiny_cpu.yaml",
        f"train.output_dir={out}",
        *OVERRIDES,
        *extra,  # after the defaults above, so a test's own overrides win
    ]


def environment(out: Path, env: dict | None) -> dict:
    """OMP_NUM_THREADS=1, the test-side fault injector on PYTHONPATH (tests/inject/) and
    its trained-ids record in out/ids; `env`: the drill's own variables (drills.py)."""
    (out / "ids").mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "OMP_NUM_THREADS": "1", drills.IDS: str(out / "ids"), **(env or {})}
    return drills.environment(base)


def train(out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """One blocking 2-rank run into `out` (stdout, stderr captured)."""
    return run(command(out, *extra), out, extra, env)


def run(
    cmd: list[str], out: Path, overrides: tuple = (), env: dict | None = None
) -> subprocess.CompletedProcess:
    """`cmd` to its end with the test-side environment (stdout, stderr captured); only a
    hang fails the wait (faults_helpers.wait_end: the run's own bound, by `overrides`)."""
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        job = subprocess.Popen(cmd, cwd=REPO, env=environment(out, env), stdout=so, stderr=se)
        try:
            code = wait_end(job, out, tuple(overrides))
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
        so.seek(0), se.seek(0)
        return subprocess.CompletedProcess(cmd, code, so.read(), se.read())


@functools.cache
def reference(base: Path) -> Path:
    """The uninterrupted run (once per session, whichever test file asks first)."""
    out = base / "faults-reference"
    p = train(out, "--resume", "none")
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def metrics(out: Path) -> dict[int, dict]:
    """metrics.jsonl by step (the last record of a step wins)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines)}


def losses(out: Path) -> dict[int, float]:
    return {s: m["loss"] for s, m in metrics(out).items() if "loss" in m}


def trained_ids(out: Path, rank: int) -> list[tuple[int, list[int]]]:
    """(micro step, sample ids) of each micro-batch rank `rank` trained, in order."""
    lines = (out / "ids" / f"rank{rank}.jsonl").read_text().splitlines()
    return [(r["micro_step"], r["sample_ids"]) for r in map(json.loads, lines)]


def state(ckpt: Path) -> dict:
    """What an optimizer update changes: weights, Adam state and fp32 master partitions
    of every rank, and the LR scheduler; plus DeepSpeed's step counters."""
    model = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)
    shards = sorted(ckpt.glob("*optim_states.pt"))
    assert shards, f"no optimizer shards in {ckpt}"
    optim = [torch.load(f, weights_only=False)["optimizer_state_dict"] for f in shards]
    return {
        "module": model["module"],
        "lr_scheduler": model["lr_scheduler"],
        "adam": [o["base_optimizer_state"] for o in optim],
        "master": [o["single_partition_of_fp32_groups"] for o in optim],
        "skipped_steps": model["skipped_steps"],
    }


def same_update_state(a: dict, b: dict) -> bool:
    """Bitwise equal weights, Adam moments and step counts, master weights and scheduler."""
    return all(_equal(a[k], b[k]) for k in ("module", "lr_scheduler", "adam", "master"))


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def run_status(out: Path) -> dict:
    """What a scheduler reads (specforge_dspark/training/run_status.py)."""
    return json.loads((out / "run_status.json").read_text())
