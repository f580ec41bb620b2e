"""The closed loop on shifted traffic (`make loop`), SGLang as the judge, on this CPU with
the tiny Qwen3 target (SGLang's CPU engine serves it about 10x faster than the tiny Inkling
under Triton's interpreter, docs/engines.md):

1. base: a DSpark drafter trained on the target's own answers to GSM8K questions (the
   "original mix": what a user trained for before serving)
2. the loop: `python -m specforge_dspark.cli.loop` for ROUNDS rounds on traffic the base
   never saw (MT-Bench, HumanEval and MATH first turns): serve and record, mine, train
   `--steps` per round from the serving drafter, gate, swap
3. control: the base trained the same number of steps on its original mix
4. judge: SGLang decodes the loop's held-out requests and GSM8K guard prompts with the base
   (no adaptation), the control and the loop's serving drafter: accept length with 95%
   intervals, each paired against the base, and whether every answer is the target's own

Writes runs/loop/summary.json (with its provenance), publishable with
`python -m evaluation.figures publish loop`.
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

import demo  # noqa: E402  (scripts/demo.py: prompt mixes and steps)
import quality  # noqa: E402  (scripts/quality.py: one cached training run per budget)

RECIPE = "recipes/tiny_cpu_sglang.yaml"
ORIGINAL_MIX = (("train/gsm8k_train.jsonl", "question", 0, 400),)
TRAIN = ("target.backend=hf", "train.preflight_samples=0", "tracking.enabled=false",
         "train.eval_interval=0", "export.formats=[sglang]",
         "train.epochs=1000")  # train.max_steps (the budget) decides  # fmt: skip
TRAFFIC = "[mt_bench,humaneval,math500]"


def original_answers(out: Path) -> Path:
    """The target's greedy answers to ORIGINAL_MIX (messages rows), made once."""
    path = out / "original_mix_answers.jsonl"
    if (out / "original.done").is_file():
        return path
    mix = demo.prompt_mix(out / "original_mix.jsonl", ORIGINAL_MIX)
    cmd = [sys.executable, "-m", "data_pipelines.regenerate", "--recipe", RECIPE,
           "--input", str(mix), "--format", "messages", "--out", str(path), "--backend", "hf",
           "--batch-size", "50", "--max-new-tokens", "128", "--quiet"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO)
    (out / "original.done").write_text("")
    return path


def judge(loop, exports: dict[str, str], items) -> dict[str, dict]:
    """Each export served by SGLang in turn, every item decoded: name -> request -> figures."""
    out = {}
    for name, export in exports.items():
        served = loop.start(-1, export)
        try:
            out[name] = loop.decode(served.url, items)
        finally:
            served.proc.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/loop")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=96, help="served requests per round")
    ap.add_argument("--steps", type=int, default=150, help="training steps per round")
    ap.add_argument("--base-steps", type=int, default=300)
    ap.add_argument("--nproc", type=int, default=2)
    a = ap.parse_args(argv)
    os.chdir(REPO)
    t0 = time.time()
    from evaluation.figures import provenance
    from specforge_dspark.config.recipe import load_recipe
    from specforge_dspark.decoding.intervals import bootstrap_ci, paired_difference
    from specforge_dspark.loop.round import Loop

    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    demo.step("1/4 the base drafter, trained on the target's answers to GSM8K questions")
    original = original_answers(out)
    base = quality.train_budget(RECIPE, original, a.base_steps, out / "base", a.nproc, TRAIN)

    demo.step(f"2/4 {a.rounds} rounds of the loop on shifted traffic {TRAFFIC}")
    loop_args = [
        "target.backend=hf", "train.preflight_samples=0", "tracking.enabled=false",
        f"train.output_dir={out / 'loop_runs'}", f"loop.dir={out / 'loop'}",
        f"loop.serve_from={base['export']}", f"loop.traffic={TRAFFIC}",
        f"loop.requests_per_round={a.requests}", "loop.max_new_tokens=64",
        f"loop.steps_per_round={a.steps}", f"loop.rows_per_round={a.requests}",
        "loop.replay_share=0.3", "loop.holdout_share=0.25", "loop.guard_workloads=[gsm8k]",
        "loop.guard_prompts=16", f"checkpoint.save_interval={a.steps}",
        f"data.train_files=[{original}]", "data.format=messages",  # the replay: base's mix
    ]  # fmt: skip
    state = out / "loop" / "state.json"
    done = json.loads(state.read_text())["round"] if state.is_file() else 0
    t = time.time()
    if done < a.rounds:
        cmd = [sys.executable, "-m", "specforge_dspark.cli.loop", "--recipe", RECIPE,
               "--rounds", str(a.rounds - done), "--nproc", str(a.nproc), *loop_args]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    loop_s = time.time() - t

    demo.step("3/4 control: the base trained as many steps on its original mix")
    from_base = (*TRAIN, f"draft.init_from={base['export']}")
    control = quality.train_budget(RECIPE, original, a.rounds * a.steps, out / "control", a.nproc,
                                   from_base)  # fmt: skip

    demo.step("4/4 SGLang decodes the held-out traffic and the guard prompts with each")
    loop = Loop(load_recipe(RECIPE, loop_args), loop_args, a.nproc)
    items, _ = loop.gate_items()
    serving = loop.lineage.serving()
    exports = {"base": base["export"], "control": control["export"], "loop": serving["export"]}
    figs = judge(loop, exports, items)

    def units(name: str, keys) -> dict:
        return {k: (figs[name][k]["completion_tokens"] - 1, max(figs[name][k]["verify_ct"], 1))
                for k in keys}  # fmt: skip

    groups = {"shifted traffic (held out)": [k for k in figs["base"] if not k.startswith("guard:")],
              "original: gsm8k": [k for k in figs["base"] if k.startswith("guard:")]}  # fmt: skip
    table = {}
    for group, keys in groups.items():
        row = {}
        for name in exports:
            u = units(name, keys)
            c, n = [v[0] for v in u.values()], [v[1] for v in u.values()]
            row[name] = {"accept_length": round(sum(c) / sum(n), 4), "ci": bootstrap_ci(c, n)}
            if name != "base":
                row[name]["minus_base"] = paired_difference(u, units("base", keys))
        table[group] = {"requests": len(keys), **row}
    lossless = all(figs[n][k]["tokens"] == figs["base"][k]["tokens"] for n in exports
                   for k, _ in items)  # fmt: skip
    kept = sorted((out / "loop" / "rounds").glob("*/round.json"), key=lambda p: int(p.parent.name))
    rounds = [json.loads(p.read_text()) for p in kept]
    summary = {
        "table": table,
        "lossless": lossless,
        "rounds": [
            {
                "round": r["round"],
                "seconds": r["seconds"],
                "promoted": r["gate"]["promote"],
                "why": r["gate"]["why"],
                "mined": r["mine"]["mined"],
                "replayed": r["mine"]["replayed"],
            }
            for r in rounds
        ],  # fmt: skip
        "serving_version": serving["version"],
        "settings": {
            "rounds": a.rounds,
            "requests_per_round": a.requests,
            "steps_per_round": a.steps,
            "base_steps": a.base_steps,
            "traffic": TRAFFIC,
            "recipe": RECIPE,
        },  # fmt: skip
        "loop_seconds": round(loop_s, 1),
        "seconds": round(time.time() - t0, 1),
        "provenance": provenance(
            ["python", "scripts/loop.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for group, row in table.items():
        said = ", ".join(f"{n} {row[n]['accept_length']:.3f} {row[n]['ci']}" for n in exports)
        print(f"{group} ({row['requests']} requests): {said}")
    print(f"every answer the target's own: {lossless}; wrote {out / 'summary.json'} "
          f"({summary['seconds']:.0f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
