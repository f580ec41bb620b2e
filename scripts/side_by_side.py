"""Drafters side by side on the tiny target, same data, steps and block size: accept length
by real speculative decoding (lossless, checked), with bootstrap intervals over prompts.

    python scripts/side_by_side.py --steps 80 --num-prompts 8 --max-new-tokens 32 \
        --out runs/side_by_side            (the defaults; about 2 minutes on 1 CPU rank)
trains recipes/tiny_cpu_small.yaml (DSpark, block 16) and recipes/tiny_cpu_dflash.yaml
(DFlash, block 16) for --steps each (torchrun, --nproc CPU ranks; --skip-train reuses the runs),
then decodes the same held-out GSM8K prompts with each trained drafter and with each
untrained one. Accept length = sum(committed) / sum(verify steps) (SGLang's
completion_tokens / spec_verify_ct without the prefill's token); the 95% interval is a
percentile bootstrap over prompts (seeded). Writes <out>/side_by_side.json.

Arms other than the default two: `--arm NAME=KIND[,key=value...]` (repeatable), e.g. the
DFlash objectives:
    python scripts/side_by_side.py --arm decay=dflash,objective.slot_weighting=decay \
        --arm dpace=dflash,objective.slot_weighting=dpace \
        --arm lk=dflash,objective.slot_weighting=decay,objective.divergence=lk

On-policy data (the target's own answers, as DFlash drafters are trained; without it the
tiny DFlash drafter barely leaves its untrained accept length in a few hundred steps):
    python -m data_pipelines.regenerate --recipe recipes/tiny_cpu_dflash.yaml --backend hf \
        --out runs/regen.jsonl --max-rows 64 --max-new-tokens 64 --batch-size 16
    python scripts/side_by_side.py data.train_files=[runs/regen.jsonl] data.format=messages \
        data.eval_files=[] data.max_length=160 objective.num_anchors=16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECIPES = {"dspark": "recipes/tiny_cpu_small.yaml", "dflash": "recipes/tiny_cpu_dflash.yaml"}


def parse_arm(text: str) -> tuple[str, str, list[str]]:
    """`NAME=KIND[,key=value...]` -> (name, kind, overrides)."""
    name, _, spec = text.partition("=")
    kind, *overrides = spec.split(",")
    if not name or kind not in RECIPES:
        raise SystemExit(
            f"--arm {text!r}: expected NAME=KIND[,key=value...], KIND in {list(RECIPES)}"
        )
    return name, kind, overrides


def train(kind: str, out: Path, steps: int, port: int, nproc: int, extra: list[str]) -> Path:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_port", str(port), "train.py", "--recipe", RECIPES[kind], "--resume", "none",
        f"train.output_dir={out}", f"train.max_steps={steps}", f"checkpoint.save_interval={steps}",
        "train.eval_interval=0", "tracking.enabled=false", "export.formats=[sglang]", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    return out / "export" / "sglang"


def accept_length(rows: list[dict]) -> float:
    return sum(r["committed"] for r in rows) / max(sum(r["steps"] for r in rows), 1)


def bootstrap(rows: list[dict]) -> list[float]:
    """95% percentile bootstrap over prompts of the pooled accept length."""
    from specforge_dspark.decoding.intervals import bootstrap_ci

    return bootstrap_ci([r["committed"] for r in rows], [r["steps"] for r in rows])


def per_position(rows: list[dict]) -> list[float]:
    """P(at least k+1 drafts accepted) per verify step, k = 0.. (first 8)."""
    hist = [sum(r["accepted_hist"][k] for r in rows) for k in range(len(rows[0]["accepted_hist"]))]
    steps = sum(hist)
    return [sum(hist[k + 1 :]) / steps for k in range(min(8, len(hist) - 1))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default="runs/side_by_side")
    ap.add_argument("--nproc", type=int, default=1, help="training ranks (CPU processes)")
    ap.add_argument("--skip-train", action="store_true", help="reuse <out>/<name> runs")
    ap.add_argument("--arm", action="append", default=[], help="NAME=KIND[,key=value...]")
    ap.add_argument("overrides", nargs="*", help="recipe overrides applied to both runs")
    args = ap.parse_args(argv)

    import torch

    from evaluation.decode import decode_prompts
    from specforge_dspark.config.recipe import load_recipe
    from specforge_dspark.decoding.prompts import load_conversations, parse_workload, render
    from specforge_dspark.drafters.registry import new_draft
    from specforge_dspark.targets.target import build as build_tiny_target

    torch.set_num_threads(1)
    out = Path(args.out)
    recipe = load_recipe(REPO / RECIPES["dflash"])
    target = str(build_tiny_target(REPO / recipe.target.path, log=print))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    convs = load_conversations(parse_workload("gsm8k"), args.num_prompts)
    prompts = [render(tok, [{"role": "user", "content": c.turns[0]}]) for c in convs]
    results = {}
    arms = [parse_arm(a) for a in args.arm] or [(kind, kind, []) for kind in RECIPES]
    for i, (name, kind, arm_overrides) in enumerate(arms):
        run, overrides = out / name, [*args.overrides, *arm_overrides]
        export = run / "export" / "sglang"
        if not args.skip_train:
            export = train(kind, run, args.steps, 29850 + i, args.nproc, overrides)
        torch.manual_seed(0)
        recipe = load_recipe(REPO / RECIPES[kind], ["train.eval_interval=0", *overrides])
        untrained = new_draft(recipe.draft)
        for label, draft in (("untrained", untrained), ("trained", export)):
            if label == "untrained" and any(k == kind for _, k, _ in arms[:i]):
                continue  # one untrained drafter per kind
            rows = decode_prompts(target, draft, prompts, args.max_new_tokens)
            lo, hi = bootstrap(rows)
            results[f"{name}/{label}"] = {
                "accept_length": accept_length(rows),
                "ci95": [lo, hi],
                "per_position": per_position(rows),
                "prompts": len(rows),
                "steps": sum(r["steps"] for r in rows),
            }
            r = results[f"{name}/{label}"]
            line = f"{name:>8} {label:>9}: accept length {r['accept_length']:.3f}"
            print(f"{line} [{lo:.3f}, {hi:.3f}] over {len(rows)} prompts, lossless", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"steps": args.steps, "max_new_tokens": args.max_new_tokens, "block_size": 16}
    (out / "side_by_side.json").write_text(json.dumps({**meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
