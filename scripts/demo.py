"""The main job on the embedded default, end to end on CPU (`make demo`).

1. build the tiny Inkling target (cached in .cache/tiny_target; prints its held-out
   loss and greedy loop rate)
2. on-policy data: the target answers the GSM8K training prompts itself
   (`data_pipelines.regenerate --backend hf`, batched), as the seed drafters were trained
3. train online with `torchrun --nproc_per_node 2 train.py --recipe recipes/tiny_cpu.yaml`
   on those answers against the live hf target (resumes if interrupted), save, export
4. evaluate accept length by real speculative decoding on held-out prompts (gsm8k,
   math500, humaneval, mt_bench both turns) for the trained, the untrained and a
   training-free n-gram drafter of the same block size, with 95% bootstrap intervals
   over prompts; print a table; write runs/demo/summary.json and the decoded texts
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

WORKLOADS = "gsm8k,math500,humaneval,mt_bench"
DRAFTERS = ("trained", "untrained", "ngram")
# evaluation runs in two processes of one thread each; the slow untrained drafter alone
EVAL_GROUPS = (("untrained",), ("trained", "ngram"))
# served accept length during training and the confidence calibration of the export
TRAIN_EXTRAS = (
    "train.served_eval.num_prompts=8",
    "train.served_eval.max_new_tokens=64",
    "export.calibrate_prompts=8",
)


def _evaluate_group(names: tuple[str, ...], drafts: dict, kw: dict) -> dict[str, dict]:
    """One evaluation process: its drafters share the plain greedy references."""
    import torch

    from evaluation.acceptance import evaluate
    from evaluation.ngram import NgramDrafter

    torch.set_num_threads(1)
    references: dict = {}
    out = {}
    for name in names:
        draft = drafts[name]
        draft = NgramDrafter(draft[1]) if isinstance(draft, tuple) else draft
        rest = {k: v for k, v in kw.items() if k != "out"}
        out_dir = str(Path(kw["out"]) / f"eval_{name}")
        out[name] = evaluate(draft=draft, out_dir=out_dir, references=references, **rest)
    return out


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def _ci(ci: list[float] | None) -> str:
    return "" if not ci else f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def print_table(results: dict[str, dict], workloads: list[str]) -> None:
    cell = 22
    print(f"\n{'drafter':<10} {'overall':>{cell}}  " + "  ".join(f"{w:>{cell}}" for w in workloads))
    for name, res in results.items():
        o, per = res["overall"], res["workloads"]
        cells = [f"{o['accept_length']:.3f} {_ci(o['accept_length_ci'])}"]
        cells += [
            f"{per[w]['accept_length']:.3f} {_ci(per[w]['accept_length_ci'])}" for w in workloads
        ]
        print(f"{name:<10} " + "  ".join(f"{c:>{cell}}" for c in cells))
    print("accept length = committed tokens per verify step; [95% bootstrap interval over prompts]")


def brief(res: dict) -> dict:
    keep = ("accept_length", "accept_length_ci", "per_position", "lossless", "prompts")
    return {
        "accept_length": res["overall"]["accept_length"],
        "accept_length_ci": res["overall"]["accept_length_ci"],
        "per_position": res["overall"]["per_position"],
        "speedup": res["overall"]["speedup"],
        "workloads": {w: {k: v.get(k) for k in keep} for w, v in res["workloads"].items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/tiny_cpu.yaml")
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--workloads", default=WORKLOADS)
    ap.add_argument("--num-prompts", type=int, default=20, help="per workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--regen-rows", type=int, default=600, help="training prompts regenerated")
    ap.add_argument("--regen-batch", type=int, default=60)
    ap.add_argument("--regen-max-new-tokens", type=int, default=256)
    ap.add_argument("overrides", nargs="*", help="extra recipe overrides")
    a = ap.parse_args(argv)
    os.chdir(REPO)
    t0 = time.time()
    split: dict[str, float] = {}

    import torch

    from specforge_dspark.recipe import load_recipe, resolved_dirs
    from specforge_dspark.tiny_target import build

    out = Path(a.out)
    base = load_recipe(a.recipe, [f"train.output_dir={a.out}", *a.overrides])

    step("1/4 tiny Inkling target")
    t = time.time()
    target = build(Path(base.target.path))
    info = json.loads((target / "build_info.json").read_text())
    split["target_build"] = time.time() - t
    print(
        f"held-out loss {info['heldout_loss']['mean']:.3f} nats/token "
        f"({', '.join(f'{k} {v:.3f}' for k, v in info['heldout_loss'].items() if k != 'mean')}); "
        f"greedy loop rate {info['loop_rate']:.3f} ({info['loop_definition']})"
    )

    step("2/4 on-policy data: the target answers the training prompts")
    t = time.time()
    regen = out / "data" / "gsm8k_regenerated.jsonl"
    regen.parent.mkdir(parents=True, exist_ok=True)
    src = base.data.train_files
    cmd = [
        sys.executable, "-m", "data_pipelines.regenerate", "--recipe", a.recipe,
        "--input", *src, "--out", str(regen), "--backend", "hf",
        "--batch-size", str(a.regen_batch), "--max-new-tokens", str(a.regen_max_new_tokens),
        "--max-rows", str(a.regen_rows), "--quiet",
    ]  # fmt: skip
    print(" ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    split["regeneration"] = time.time() - t
    overrides = [
        f"train.output_dir={a.out}",
        f"data.train_files=[{regen}]",
        "data.format=messages",
        f"data.max_rows={a.regen_rows}",
        *TRAIN_EXTRAS,
        *a.overrides,
    ]
    recipe = load_recipe(a.recipe, overrides)

    from data_pipelines.prepare import prepare_dataset

    ds = prepare_dataset(recipe, split="train")
    print(f"{len(ds)} prepared rows from {regen}")

    step(f"3/4 online distillation on {a.nproc} CPU ranks")
    t = time.time()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc),
        "--master_port", str(29600 + os.getpid() % 200),
        "train.py", "--recipe", a.recipe, "--resume", "auto", *overrides,
    ]  # fmt: skip
    print(" ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    split["training"] = time.time() - t
    export_dirs = [resolved_dirs(recipe)["export"] / f for f in recipe.export.formats]

    step("4/4 acceptance by speculative decoding (held-out prompts)")
    t = time.time()
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from specforge_dspark.model import DSparkConfig, DSparkDraft

    untrained_dir = out / "untrained_draft"
    torch.manual_seed(recipe.train.seed)
    DSparkDraft(DSparkConfig.from_recipe(recipe.draft)).save_pretrained(untrained_dir)
    drafts = {
        "trained": str(resolved_dirs(recipe)["export"] / "sglang"),
        "untrained": str(untrained_dir),
        "ngram": ("ngram", recipe.draft.block_size),
    }
    workloads = a.workloads.split(",")
    kw = dict(target_path=str(target), workloads=workloads, num_prompts=a.num_prompts,
              max_new_tokens=a.max_new_tokens, out=str(out))  # fmt: skip
    os.environ["OMP_NUM_THREADS"] = "1"  # for the two evaluation processes
    results: dict[str, dict] = {}
    with ProcessPoolExecutor(len(EVAL_GROUPS), mp_context=mp.get_context("spawn")) as pool:
        jobs = [pool.submit(_evaluate_group, g, drafts, kw) for g in EVAL_GROUPS]
        for job in jobs:
            results.update(job.result())
    results = {name: results[name] for name in DRAFTERS}
    split["evaluation"] = time.time() - t
    print_table(results, workloads)

    summary = {
        **{name: brief(results[name]) for name in DRAFTERS},
        "target": {
            "loop_rate": info["loop_rate"],
            "heldout_loss": info["heldout_loss"]["mean"],
            "heldout_loss_by_set": info["heldout_loss"],
        },
        "export_dirs": [str(p) for p in export_dirs],
        "target_dir": str(Path(recipe.target.path)),
        "eval_dirs": [str(out / f"eval_{name}") for name in DRAFTERS],
        "training_data": str(regen),
        "recipe": a.recipe,
        "overrides": overrides,
        "num_prompts": a.num_prompts,
        "max_new_tokens": a.max_new_tokens,
        "split_seconds": {k: round(v, 1) for k, v in split.items()},
        "seconds": round(time.time() - t0, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\ntime split: " + ", ".join(f"{k} {v:.0f} s" for k, v in split.items()))
    print(
        f"wrote {out / 'summary.json'} ({summary['seconds']:.0f} s in all); decoded texts in "
        f"{out}/eval_*/generations.jsonl"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
