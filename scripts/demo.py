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
EVAL_REGEN_ROWS = 32  # GSM8K test prompts answered by the target for teacher-forced eval
# evaluation runs in two processes of one thread each, split by workload (about equal work);
# in each, the three drafters share the plain greedy references
EVAL_SPLIT = (("gsm8k", "mt_bench"), ("math500", "humaneval"))
# the training prompts the target answers: a mix like the seed drafters' data, from rows
# the evaluation never reads (evaluation takes the first rows, MATH/HumanEval rows below
# targets/corpus.py EVAL_ROWS_RESERVED are evaluation-only); (file, field, first row, count)
PROMPT_MIX = (
    ("train/gsm8k_train.jsonl", "question", 0, 300),
    ("eval/math500_test.jsonl", "problem", 100, 150),
    ("eval/humaneval.jsonl", "prompt", 100, 64),
    ("train/sharegpt_sample.json", "conversations", 0, 86),
)
# The same shares in 320 rows for SmolLM2 (make real, make incumbent TARGET=smollm2), which
# answers ~90 tokens/s here: 320 answers of at most 96 tokens take ~5 min
REAL_MIX = (("train/gsm8k_train.jsonl", "question", 0, 160),
            ("eval/math500_test.jsonl", "problem", 100, 80),
            ("eval/humaneval.jsonl", "prompt", 100, 32),
            ("train/sharegpt_sample.json", "conversations", 0, 48))  # fmt: skip
# served accept length during training and the confidence calibration of the export
# Five passes over the 600 on-policy answers (1500 steps, ~3 min here): on held-out prompts
# one pass (300 steps) gave accept length 2.17 overall, below the n-gram drafter's 2.33;
# three passes 2.89; five 3.48, above it on every workload (2026-12-02, docs/measured.md).
TRAIN_EXTRAS = (
    "train.epochs=5",
    "train.max_steps=1500",
    "train.served_eval.num_prompts=8",
    "train.served_eval.max_new_tokens=64",
    "export.calibrate_prompts=16",
    "export.calibrate_workloads=[gsm8k,math500,humaneval,mt_bench]",
)


def prompt_mix(out: Path, mix: tuple = PROMPT_MIX) -> Path:
    """`mix` as one jsonl of user turns (OpenAI messages) for the regeneration."""
    from specforge_dspark.targets.corpus import SHARED_DATA

    rows = []
    for rel, field, first, count in mix:
        path = SHARED_DATA / rel
        if path.suffix == ".json":  # ShareGPT: the first human turn
            data = json.loads(path.read_text())
            values = [c[field][0]["value"] for c in data]
        else:
            values = [json.loads(line)[field] for line in path.open() if line.strip()]
        for i, text in enumerate(values[first : first + count]):
            rows.append(
                {"id": f"{path.name}:{first + i}", "messages": [{"role": "user", "content": text}]}
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def on_policy_data(recipe_path: str, base, out: Path, rows: int, batch: int, max_new_tokens: int,
                   overrides=(), mix: tuple = PROMPT_MIX) -> list[str]:  # fmt: skip
    """The target answers `mix`'s first `rows` prompts and EVAL_REGEN_ROWS GSM8K test
    prompts (out/data/, regenerated only where missing rows); the recipe overrides that
    train on them (`base`: the recipe loaded from `recipe_path`; `overrides`: the
    regeneration's own, e.g. another target.path)."""
    regen = out / "data" / "mix_regenerated.jsonl"
    regen_eval = out / "data" / "gsm8k_test_regenerated.jsonl"  # teacher-forced eval rows
    mix = prompt_mix(out / "data" / "prompt_mix.jsonl", mix)
    for src, fmt, dst, n in (
        ([str(mix)], "messages", regen, rows),
        (base.data.eval_files, base.data.format, regen_eval, EVAL_REGEN_ROWS),
    ):
        cmd = [
            sys.executable, "-m", "data_pipelines.regenerate", "--recipe", recipe_path,
            "--input", *src, "--format", fmt, "--out", str(dst), "--backend", "hf",
            "--batch-size", str(batch), "--max-new-tokens", str(max_new_tokens),
            "--max-rows", str(n), "--quiet", *overrides,
        ]  # fmt: skip
        print(" ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True)
    return [f"data.train_files=[{regen}]", f"data.eval_files=[{regen_eval}]",
            "data.format=messages", f"data.max_rows={rows}"]  # fmt: skip


def _evaluate_part(workloads: tuple[str, ...], drafts: dict, kw: dict, part: int) -> dict:
    """One evaluation process: every drafter of `drafts` (name -> exported directory, or
    ("ngram", block size)) on `workloads`, sharing the greedy references."""
    import torch

    from evaluation.acceptance import evaluate
    from evaluation.references import greedy_references
    from specforge_dspark.decoding.ngram import NgramDrafter

    torch.set_num_threads(1)
    references = greedy_references(  # batched; each checked again where it differs
        kw["target_path"], list(workloads), kw["num_prompts"], kw["max_new_tokens"]
    )
    out = {}
    for name, draft in drafts.items():
        draft = NgramDrafter(draft[1]) if isinstance(draft, tuple) else draft
        out_dir = Path(kw["out"]) / f"eval_{name}" / f"part{part}"
        rest = {k: v for k, v in kw.items() if k != "out"}
        out[name] = evaluate(draft=draft, workloads=list(workloads), out_dir=str(out_dir),
                             references=references, **rest)  # fmt: skip
    return out


def pool(parts: list[dict], eval_dir: Path) -> dict:
    """One drafter's summaries of disjoint workloads as one: pooled over verify steps, the
    interval bootstrapped over every prompt (from the parts' generations.jsonl)."""
    from specforge_dspark.decoding.intervals import bootstrap_ci

    workloads = {w: v for p in parts for w, v in p["workloads"].items()}
    steps = sum(v["steps"] for v in workloads.values())
    units: dict = {}
    lines = []
    for i in range(len(parts)):
        for line in (eval_dir / f"part{i}" / "generations.jsonl").open():
            g = json.loads(line)
            lines.append(line)
            c, n = units.get((g["workload"], g["index"]), (0, 0))
            units[(g["workload"], g["index"])] = (c + g["committed"], n + g["verify_steps"])
    (eval_dir / "generations.jsonl").write_text("".join(lines))
    G = parts[0]["block_size"]
    plain_s = [v["seconds_plain"] for v in workloads.values()]
    plain = None if None in plain_s else sum(plain_s)  # None: batched references, untimed
    spec = sum(v["seconds_spec"] for v in workloads.values())
    overall = {
        "steps": steps,
        "accept_length": sum(v["committed_tokens"] for v in workloads.values()) / steps,
        "accept_length_ci": bootstrap_ci(
            [c for c, _ in units.values()], [n for _, n in units.values()]
        ),
        "per_position": [
            sum(v["per_position"][k] * v["steps"] for v in workloads.values()) / steps
            for k in range(G)
        ],
        "speedup": plain / spec if spec and plain is not None else None,
        "lossless": all(v["lossless"] for v in workloads.values()),
    }
    summary = {**parts[0], "workloads": workloads, "overall": overall}
    (eval_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def evaluate_split(drafts: dict, workloads: list[str], kw: dict) -> dict[str, dict]:
    """Every drafter of `drafts` on `workloads`, in EVAL_SPLIT's processes of one thread
    each; the pooled summary per drafter (eval_<name>/ under kw["out"])."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    split_by = [tuple(w for w in part if w in workloads) for part in EVAL_SPLIT]
    split_by += [tuple(w for w in workloads if not any(w in part for part in EVAL_SPLIT))]
    split_by = [part for part in split_by if part]
    os.environ["OMP_NUM_THREADS"] = "1"  # for the evaluation processes
    with ProcessPoolExecutor(len(split_by), mp_context=mp.get_context("spawn")) as ex:
        jobs = [ex.submit(_evaluate_part, part, drafts, kw, i) for i, part in enumerate(split_by)]
        parts = [job.result() for job in jobs]
    out = Path(kw["out"])
    return {name: pool([p[name] for p in parts], out / f"eval_{name}") for name in drafts}


def judge(drafts: dict, target: Path, num_prompts: int, max_new_tokens: int, out: Path):
    """`evaluate_split` of `drafts` on WORKLOADS, the table printed: (results, workloads,
    seconds)."""
    t = time.time()
    workloads = WORKLOADS.split(",")
    kw = dict(target_path=str(target), num_prompts=num_prompts,
              max_new_tokens=max_new_tokens, out=str(out))  # fmt: skip
    results = evaluate_split(drafts, workloads, kw)
    print_table(results, workloads)
    return results, workloads, time.time() - t


def train_online(recipe: str, overrides: list[str], nproc: int, port: int = 29600) -> None:
    """train.py under torchrun on `nproc` CPU ranks (one thread each), resuming what is
    there; the command printed first. The port moves with the process id, so that two
    scripts running at once do not collide."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_port", str(port + os.getpid() % 200),
        "train.py", "--recipe", recipe, "--resume", "auto", *overrides,
    ]  # fmt: skip
    print(" ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def _ci(ci: list[float] | None) -> str:
    return "" if not ci else f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def print_table(results: dict[str, dict], workloads: list[str]) -> None:
    cell, name_w = 22, max(10, *map(len, results))
    head = f"\n{'drafter':<{name_w}} {'overall':>{cell}}  "
    print(head + "  ".join(f"{w:>{cell}}" for w in workloads))
    for name, res in results.items():
        o, per = res["overall"], res["workloads"]
        cells = [f"{o['accept_length']:.3f} {_ci(o['accept_length_ci'])}"]
        cells += [
            f"{per[w]['accept_length']:.3f} {_ci(per[w]['accept_length_ci'])}" for w in workloads
        ]
        print(f"{name:<{name_w}} " + "  ".join(f"{c:>{cell}}" for c in cells))
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


def fresh_for_target(out: Path, target: Path) -> None:
    """The regenerated data and the run belong to one target: when the target's weights
    are not the ones `out` was made with (a rebuild, another thread count), start `out`
    afresh instead of resuming on another target's answers."""
    import shutil

    from specforge_dspark.training.fingerprint import weight_file_digest

    digest = {p.name: weight_file_digest(p) for p in sorted(target.glob("*.safetensors"))}
    stamp = out / "target_weights.json"
    if stamp.is_file() or (out / "data" / "mix_regenerated.jsonl").is_file():  # a demo's
        if not stamp.is_file() or json.loads(stamp.read_text()) != digest:
            print(f"{out}: made with other target weights than {target}'s; starting it afresh")
            shutil.rmtree(out)
    elif out.is_dir() and any(out.iterdir()):
        raise SystemExit(f"--out {out}: not empty and not a demo's output; choose another")
    out.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(digest))


def calibration_brief(cal_dir: Path) -> dict | None:
    """The held-out figures of the export's calibration (evaluation/calibrate.py)."""
    path = cal_dir / "calibration.json"
    if not path.is_file():
        return None
    r = json.loads(path.read_text())
    return {
        "report": str(path),
        "temperatures": r["temperatures"],
        "bias_shift": r.get("bias_shift", 0.0),
        "eval_steps": r["eval_steps"],
        "ece_before": r["before"]["conditional"]["ece"],
        "ece_after": r["after"]["conditional"]["ece"],
        "ece_after_temperature_only": r["after_temperature_only"]["conditional"]["ece"],
        "ece_per_position_before": [p["ece"] for p in r["before"]["per_position"]],
        "ece_per_position_after": [p["ece"] for p in r["after"]["per_position"]],
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
    ap.add_argument("--regen-max-new-tokens", type=int, default=160)
    ap.add_argument("overrides", nargs="*", help="extra recipe overrides")
    a = ap.parse_args(argv)
    os.chdir(REPO)
    t0 = time.time()
    split: dict[str, float] = {}

    import torch

    from evaluation.figures import provenance
    from evaluation.report import write_comparison_plot
    from specforge_dspark.config.recipe import load_recipe, resolved_dirs
    from specforge_dspark.targets.target import build

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

    fresh_for_target(out, target)

    step("2/4 on-policy data: the target answers the training prompts")
    t = time.time()
    overrides = on_policy_data(a.recipe, base, out, a.regen_rows, a.regen_batch,
                               a.regen_max_new_tokens)  # fmt: skip
    overrides = [f"train.output_dir={a.out}", *overrides, *TRAIN_EXTRAS, *a.overrides]
    split["regeneration"] = time.time() - t
    recipe = load_recipe(a.recipe, overrides)

    from data_pipelines.prepare import prepare_dataset

    ds = prepare_dataset(recipe, split="train")
    print(f"{len(ds)} prepared rows from {recipe.data.train_files[0]}")

    step(f"3/4 online distillation on {a.nproc} CPU ranks")
    t = time.time()
    train_online(a.recipe, overrides, a.nproc)
    split["training"] = time.time() - t
    export_dirs = [resolved_dirs(recipe)["export"] / f for f in recipe.export.formats]

    step("4/4 acceptance by speculative decoding (held-out prompts)")
    t = time.time()
    from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft

    untrained_dir = out / "untrained_draft"
    torch.manual_seed(recipe.train.seed)
    DSparkDraft(DSparkConfig.from_recipe(recipe.draft)).save_pretrained(untrained_dir)
    drafts = {
        "trained": str(resolved_dirs(recipe)["export"] / "sglang"),
        "untrained": str(untrained_dir),
        "ngram": ("ngram", recipe.draft.block_size),
    }
    workloads = a.workloads.split(",")
    kw = dict(target_path=str(target), num_prompts=a.num_prompts,
              max_new_tokens=a.max_new_tokens, out=str(out))  # fmt: skip
    results = evaluate_split(drafts, workloads, kw)
    split["evaluation"] = time.time() - t
    print_table(results, workloads)

    summary = {
        **{name: brief(results[name]) for name in DRAFTERS},
        "target": {
            "loop_rate": info["loop_rate"],
            "heldout_loss": info["heldout_loss"]["mean"],
            "heldout_loss_by_set": info["heldout_loss"],
        },
        "calibration": calibration_brief(resolved_dirs(recipe)["export"].parent / "calibration"),
        "export_dirs": [str(p) for p in export_dirs],
        "target_dir": str(Path(recipe.target.path)),
        "eval_dirs": [str(out / f"eval_{name}") for name in DRAFTERS],
        "training_data": str(recipe.data.train_files[0]),
        "training_prompts": [
            f"{f}[{first}:{first + n}] ({field})" for f, field, first, n in PROMPT_MIX
        ],
        "recipe": a.recipe,
        "overrides": overrides,
        "num_prompts": a.num_prompts,
        "max_new_tokens": a.max_new_tokens,
        "split_seconds": {k: round(v, 1) for k, v in split.items()},
        "seconds": round(time.time() - t0, 1),
        "provenance": provenance(
            ["python", "scripts/demo.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    write_comparison_plot(results, out / "summary.png")  # the pooled answer, one picture
    print("\ntime split: " + ", ".join(f"{k} {v:.0f} s" for k, v in split.items()))
    print(
        f"wrote {out / 'summary.json'} and summary.png ({summary['seconds']:.0f} s in all); "
        "decoded texts in "
        f"{out}/eval_*/generations.jsonl"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
