"""pack: whole training runs of the embedded default (recipes/tiny_cpu.yaml: the live hf
tiny Inkling target, GSM8K rows prepared at data.max_length 384) with and without
`data.pack`, one rank each, one after the other; the unpacked run is the baseline
measured in the same invocation. One line per configuration:
  pack packed=<bool> anchors=<N> steps=<n> s_per_step=<x> supervised_tokens_per_step=<y>
       anchor_tokens_per_s=<z> fill=<f> speedup_anchor_tokens=<z / baseline z>
supervised_tokens_per_step: the supervised tokens of the micro-batches trained (the
checkpoint's token count / steps); anchor_tokens_per_s: supervised drafted slots (the
objective's `supervised_slots`, what the loss is computed on) per second of the training
loop (train.py's `done:` line: features, forward, backward and optimizer, after start-up);
fill (packed runs): the share of the sequences' max_length budget their tokens use.
Packed rows give each step more context per anchor budget; `--anchors` sets the packed
runs' num_anchors (the baseline keeps the recipe's, 64), e.g. 64 and 128 for the same
anchors per sequence and about the same per conversation.
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
RECIPE = "recipes/tiny_cpu.yaml"


def overrides(out: Path, steps: int, packed: bool, anchors: int | None) -> list[str]:
    """RECIPE's overrides for one run."""
    extra = [f"objective.num_anchors={anchors}"] if anchors else []
    return [
        f"train.output_dir={out}", f"train.max_steps={steps}", f"data.pack={str(packed).lower()}",
        "train.log_interval=1", "train.eval_interval=0", "train.preflight_samples=0",
        f"checkpoint.save_interval={steps}", "export.formats=[]", "tracking.enabled=false",
        *extra,
    ]  # fmt: skip


def configs(anchors=(64, 128)) -> list[tuple[bool, int | None]]:
    """(packed, num_anchors) of each run: the unpacked baseline first."""
    return [(False, None)] + [(True, n) for n in anchors]


def recipes(workdir: Path, steps: int = 100, anchors=(64, 128)) -> list:
    """The recipe of each run, through the strict loader."""
    from specforge_dspark.config.recipe import load_recipe

    return [
        load_recipe(REPO / RECIPE, overrides(workdir / f"run{i}", steps, packed, n))
        for i, (packed, n) in enumerate(configs(anchors))
    ]


def run(out: Path, steps: int, packed: bool, anchors: int | None) -> dict:
    """One training run; its figures."""
    cmd = [sys.executable, "train.py", "--recipe", RECIPE, "--resume", "none",
           *overrides(out, steps, packed, anchors)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"bench pack: {' '.join(cmd[1:])} failed:\n{p.stderr[-3000:]}")
    took = re.search(r"done: (\d+) steps in ([\d.]+) s", p.stdout)
    state = json.loads((out / "ckpt" / f"step-{steps}" / "train_state.json").read_text())
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    slots = sum(m["supervised_slots"] for m in logged if "supervised_slots" in m)
    fill = re.search(r"using (\d+)% of their max_length", p.stdout)  # packed runs only
    seconds = float(took[2])
    return {
        "s_per_step": seconds / steps,
        "supervised_tokens_per_step": state["tokens"] / steps,
        "anchor_tokens_per_s": slots / seconds,
        "fill": int(fill[1]) / 100 if fill else None,
    }


def bench_main(argv: list[str] | None = None) -> int:
    ap = bench_parser("pack", __doc__)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--anchors", type=int, nargs="+", default=[64, 128], help="packed runs")
    a = ap.parse_args(argv)
    base = None
    with tempfile.TemporaryDirectory(prefix="bench_pack_") as tmp:
        default = recipes(Path(tmp), a.steps, a.anchors)[0].objective.num_anchors  # refused early
        for i, (packed, anchors) in enumerate(configs(a.anchors)):
            r = run(Path(tmp) / f"run{i}", a.steps, packed, anchors)
            base = base or r
            speedup = r["anchor_tokens_per_s"] / base["anchor_tokens_per_s"]
            fill = "" if r["fill"] is None else f" fill={r['fill']:.2f}"
            print(
                f"pack packed={packed} anchors={anchors or default} steps={a.steps} "
                f"s_per_step={r['s_per_step']:.3f} "
                f"supervised_tokens_per_step={r['supervised_tokens_per_step']:.1f} "
                f"anchor_tokens_per_s={r['anchor_tokens_per_s']:.0f}{fill} "
                f"speedup_anchor_tokens={speedup:.2f}",
                flush=True,
            )
    return 0
