"""drafters: what one capture feeding several drafters saves (config/companions.py).

Two training runs of recipes/tiny_cpu_small.yaml (the live hf tiny Inkling target, one
rank, the same steps and data), one after the other in this invocation:
  one drafter:  the DSpark alone
  two drafters: the DSpark and a DFlash companion (recipes/tiny_cpu_dflash.yaml's draft
                and objective), trained from the one feature stream
The target's capture time is the hf worker's own forward seconds (train.py's `done:`
line); per trained drafter it is that divided by the drafters trained. One line each:
  drafters n=<1|2> steps=<s> capture_s=<x> capture_s_per_drafter=<x/n> s_per_step=<y>
and the ratio of the two runs' capture seconds per drafter (two / one; 0.5 is one capture
shared by two drafters at the same capture cost).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from specforge_dspark.cli.bench import bench_parser

REPO = Path(__file__).resolve().parents[3]
RECIPE = "recipes/tiny_cpu_small.yaml"
COMPANION = {
    "name": "dflash",
    "draft": {
        "kind": "dflash",
        "layer_types": ["sliding_attention", "sliding_attention"],
        "sliding_window": 64,
    },
    "objective": {"l1_weight": 0.9, "bce_weight": 0.0, "slot_weighting": "dpace"},
    "export": {"formats": []},
}


def overrides(out: Path, steps: int, drafters: int) -> list[str]:
    """RECIPE's overrides for the run of one or two drafters."""
    extra = [f"companions={json.dumps([COMPANION])}"] if drafters == 2 else []
    return [
        f"train.output_dir={out}", f"train.max_steps={steps}", "train.log_interval=10",
        "train.eval_interval=0", "train.preflight_samples=0", f"checkpoint.save_interval={steps}",
        "export.formats=[]", "tracking.enabled=false", *extra,
    ]  # fmt: skip


def recipes(workdir: Path, steps: int = 60) -> list:
    """The recipes of the two runs (one drafter, two), through the strict loader."""
    from specforge_dspark.config.recipe import load_recipe

    return [load_recipe(REPO / RECIPE, overrides(workdir / f"n{n}", steps, n)) for n in (1, 2)]


def run(out: Path, steps: int, drafters: int) -> dict:
    """One training run; its figures."""
    cmd = [sys.executable, "train.py", "--recipe", RECIPE, "--resume", "none",
           *overrides(out, steps, drafters)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"bench drafters: {' '.join(cmd[1:])} failed:\n{p.stderr[-3000:]}")
    done = re.search(
        r"done: (\d+) steps in ([\d.]+) s .*target capture ([\d.]+) s for (\d+)", p.stdout
    )
    if done is None or int(done[4]) != drafters:
        raise RuntimeError(
            f"bench drafters: no capture figure in the run's output:\n{p.stdout[-2000:]}"
        )
    capture = float(done[3])
    return {
        "capture_s": capture,
        "capture_s_per_drafter": capture / drafters,
        "s_per_step": float(done[2]) / steps,
    }


def bench_main(argv: list[str] | None = None) -> int:
    ap = bench_parser("drafters", __doc__)
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args(argv)
    figures = {}
    with tempfile.TemporaryDirectory(prefix="bench-drafters-") as tmp:
        recipes(Path(tmp), a.steps)  # refused before either run
        for n in (1, 2):
            figures[n] = f = run(Path(tmp) / f"n{n}", a.steps, n)
            print(
                f"drafters n={n} steps={a.steps} capture_s={f['capture_s']:.2f} "
                f"capture_s_per_drafter={f['capture_s_per_drafter']:.2f} "
                f"s_per_step={f['s_per_step']:.3f}",
                flush=True,
            )
    ratio = figures[2]["capture_s_per_drafter"] / figures[1]["capture_s_per_drafter"]
    print(f"drafters capture_s_per_drafter two/one={ratio:.3f}", flush=True)
    return 0
