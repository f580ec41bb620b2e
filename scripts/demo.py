"""The main job on the embedded default, end to end on CPU (`make demo`).

1. build the tiny Inkling target (cached in .cache/tiny_target)
2. prepare the training set from ../shared/data (GSM8K pairs, chat-rendered, loss-masked)
3. train online with `torchrun --nproc_per_node 2 train.py --recipe recipes/tiny_cpu.yaml`
   against the live hf target (resumes if interrupted), save, export both serving layouts
4. evaluate accept length by real speculative decoding on held-out prompts for the
   untrained and the trained drafter; print a table; write runs/demo/summary.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/tiny_cpu.yaml")
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--workloads", default="gsm8k,mt_bench")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("overrides", nargs="*", help="extra recipe overrides")
    a = ap.parse_args(argv)
    os.chdir(REPO)
    t0 = time.time()

    import torch

    from specforge_dspark.recipe import load_recipe, resolved_dirs
    from specforge_dspark.tiny_target import build

    overrides = [f"train.output_dir={a.out}", *a.overrides]
    recipe = load_recipe(a.recipe, overrides)
    out = Path(a.out)

    step("1/4 tiny Inkling target")
    target = build(Path(recipe.target.path))

    step("2/4 training data")
    from data_pipelines.prepare import prepare_dataset

    ds = prepare_dataset(recipe, split="train")
    print(f"{len(ds)} prepared rows from {', '.join(recipe.data.train_files)}")

    step(f"3/4 online distillation on {a.nproc} CPU ranks")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(a.nproc),
        "--master_port",
        str(29600 + os.getpid() % 200),
        "train.py",
        "--recipe",
        a.recipe,
        "--resume",
        "auto",
        *overrides,
    ]
    print(" ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    export_dirs = [resolved_dirs(recipe)["export"] / f for f in recipe.export.formats]

    step("4/4 acceptance by speculative decoding (held-out prompts)")
    from evaluation.acceptance import evaluate
    from specforge_dspark.model import DSparkConfig, DSparkDraft

    untrained_dir = out / "untrained_draft"
    torch.manual_seed(recipe.train.seed)
    DSparkDraft(DSparkConfig.from_recipe(recipe.draft)).save_pretrained(untrained_dir)
    trained_dir = resolved_dirs(recipe)["export"] / "sglang"
    workloads = a.workloads.split(",")
    results = {}
    for name, draft_dir in (("untrained", untrained_dir), ("trained", trained_dir)):
        results[name] = evaluate(
            target_path=str(target),
            draft=str(draft_dir),
            workloads=workloads,
            num_prompts=a.num_prompts,
            max_new_tokens=a.max_new_tokens,
            out_dir=str(out / f"eval_{name}"),
        )

    print(
        f"\n{'drafter':<10} {'accept_length':>14}  "
        + "  ".join(f"{w:>9}" for w in workloads)
        + f"  {'speedup':>8}"
    )
    for name, res in results.items():
        o, per = res["overall"], res["workloads"]
        print(
            f"{name:<10} {o['accept_length']:>14.3f}  "
            + "  ".join(f"{per[w]['accept_length']:>9.3f}" for w in workloads)
            + f"  {o['speedup']:>7.2f}x"
        )

    def brief(res: dict) -> dict:
        keep = (
            "accept_length",
            "per_position",
            "lossless",
            "tokens_per_s_spec",
            "tokens_per_s_plain",
        )
        return {
            "accept_length": res["overall"]["accept_length"],
            "per_position": res["overall"]["per_position"],
            "speedup": res["overall"]["speedup"],
            "workloads": {w: {k: v[k] for k in keep} for w, v in res["workloads"].items()},
        }

    summary = {
        "trained": brief(results["trained"]),
        "untrained": brief(results["untrained"]),
        "export_dirs": [str(p) for p in export_dirs],
        "target_dir": str(Path(recipe.target.path)),
        "eval_dirs": [str(out / "eval_untrained"), str(out / "eval_trained")],
        "recipe": a.recipe,
        "overrides": overrides,
        "seconds": round(time.time() - t0, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out / 'summary.json'} ({summary['seconds']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
