"""Tiny 2-rank training runs against a live engine's server, and what they leave behind
(tests/test_sglang_live.py, tests/test_vllm_live.py): one command for either engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.faults_helpers import losses, wait_end
from tests.inject import drills
from tests.live_keys import attach_key
from tests.live_sglang import free_port

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny_cpu_sglang.yaml"

__all__ = ["RECIPE", "end", "losses", "train", "trained_ids", "weights"]


def train(
    out: Path, backend: str, *extra: str, steps: int, engine: str = "sglang", wait: bool = True
) -> subprocess.Popen:
    """torchrun of RECIPE for `steps` steps into `out` with `backend` as the target (an
    attached `engine` server gets the live servers' key: live_keys.attach_key), logging to
    out/job.log, the test-side injector recording each rank's trained sample ids in out/ids
    (tests/inject/drills.py). With `wait`, until it ends (only a hang fails: `end`)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), "train.py", "--recipe", RECIPE,
        f"train.output_dir={out}", f"train.max_steps={steps}", "train.log_interval=1",
        "train.eval_interval=0", "checkpoint.save_interval=10", "checkpoint.keep_last=3",
        "data.max_rows=96", "data.max_length=160", "objective.num_anchors=16",
        "objective.chunk_size=8", "tracking.enabled=false", "export.formats=[sglang]",
        "train.preflight_samples=0",
        f"target.backend={backend}", *extra, *attach_key(extra, engine),
    ]  # fmt: skip
    env = drills.environment({**os.environ, "OMP_NUM_THREADS": "1", drills.IDS: str(out / "ids")})
    (out / "ids").mkdir(parents=True, exist_ok=True)
    log = open(out / "job.log", "w")  # the child keeps its own descriptor
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    proc.overrides = cmd[cmd.index(RECIPE) + 1 :]  # what bounds its waits
    if wait:
        end(proc, out)
    return proc


def end(job: subprocess.Popen, out: Path) -> int:
    """The job's exit status; only a hang fails the wait (faults_helpers.step_bound_s of
    the run's own recipe and overrides)."""
    return wait_end(job, out, job.overrides, RECIPE)


def weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    ckpt = out / "ckpt" / f"step-{step}" / "mp_rank_00_model_states.pt"
    return torch.load(ckpt, weights_only=False)["module"]


def trained_ids(out: Path, rank: int) -> list[list[int]]:
    """The sample ids of each micro-batch rank `rank` trained, in order."""
    lines = (out / "ids" / f"rank{rank}.jsonl").read_text().splitlines()
    return [r["sample_ids"] for r in map(json.loads, lines)]
