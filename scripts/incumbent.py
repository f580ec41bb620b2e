"""Ours against SpecForge's own trainer at equal steps (`make incumbent`).

SpecForge 0.2.0 (pip `specforge`, in .venv-specforge: `make specforge-venv`) and this
repository each train the demo's DSpark drafter for the tiny Inkling target: the same draft
config, objective (0.1 CE + 0.9 L1 + 1.0 BCE, decay gamma 4, 64 anchors), on-policy rows
(the demo's answers, `scripts/demo.py` step 2), schedule and steps (1500 x 2 ranks, one
sequence per rank per step), several seeds per side. SpecForge trains offline on features
our hf target wrote once (the same taps our online trainer streams); ours trains online
from the live target with its extras off (no served evaluation, no preflight, one save
at the end). Both exports decode the demo's four held-out workloads (greedy, lossless),
every drafter on the same prompts: NUM_PROMPTS per workload (<out>/prompts<N>/eval_<run>),
the first DEMO_PROMPTS of them the demo's own evaluation (`paired` ... `demo_prompts`).

Writes <out>/summary.json: per drafter and workload accept length with 95% intervals; per
side and variant, pooled over its seeds (each prompt's committed tokens and verify steps
summed over seeds); `paired`: each variant of ours minus SpecForge per workload and overall
on the same prompts (paired 95% interval, pooled over seeds; and seed by seed); seconds per
step of each training run (wall clock of the run, start-up included, / steps).

Variants (`--variants`): ours with one change each against its PARENT, to find where a
difference comes from; "base" is our trainer before this comparison, "markov_keep" its
defaults now. `--timing` also times each of the demo's extras alone (EXTRAS).

`--target smollm2` (`make incumbent TARGET=smollm2`): the same race on the real
SmolLM2-135M-Instruct (recipes/smollm2_cpu.yaml), both sides offline on the same features
(ours: the "offline" variant), with the smaller settings of TARGETS that fit this CPU;
runs/incumbent_real, `publish incumbent_real`.
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

import demo  # noqa: E402  (scripts/demo.py: on-policy data, evaluation split, tables)
from specforge_side import SF_PY, train_specforge, write_features  # noqa: E402

RECIPE = "recipes/tiny_cpu.yaml"  # main() sets the target's (TARGETS)
# ours with the extras off: the run is training only (what SpecForge's offline run is)
OURS = (
    "train.epochs=1000",  # train.max_steps decides
    "train.eval_interval=0",
    "train.served_eval.num_prompts=0",
    "train.preflight_samples=0",
    "checkpoint.save_interval=100000",  # the final save only
    "export.formats=[sglang]",
)
# Each variant spells out the three settings whose defaults this comparison changed
# (2026-12-05): "base" is the trainer before it, "markov_keep" the defaults after it.
OLD = ("draft.init=torch", "draft.norm_from_target=false", "objective.confidence_detach=false")
NEW = ("draft.init=normal_backbone", "draft.norm_from_target=true",
       "objective.confidence_detach=true")  # fmt: skip
# the same features from disk (cli.capture) instead of the live target: its cost alone
OFFLINE = (*NEW, "target.backend=offline", "target.offline_dir={capture}")
VARIANTS: dict[str, tuple[str, ...]] = {
    "base": OLD,
    "betas999": (*OLD, "optim.betas=[0.9,0.999]"),
    "normal_init": ("draft.init=normal", *OLD[1:]),
    "wd01": (*OLD, "optim.weight_decay=0.1"),  # SpecForge's AdamW has weight_decay 0, fixed
    "target_norm": ("draft.init=normal", "draft.norm_from_target=true", OLD[2]),
    "conf_detach": ("draft.init=normal", *NEW[1:]),
    "markov_keep": NEW,
    "new_betas999": (*NEW, "optim.betas=[0.9,0.999]"),
    "std004": (*NEW, "draft.init_std=0.04"),
    "std001": (*NEW, "draft.init_std=0.01"),
    "offline": OFFLINE,
    # SmolLM2 (issue 57): 3x the recipe's learning rate, on the same capture
    "offline_lr6e3": (*OFFLINE, "optim.lr=0.006"),
}
# `make incumbent`: ours before and after; the ladder between them with --variants
DEFAULT_VARIANTS = "base,markov_keep"
# the demo's extras, one at a time on the defaults (seed 0, timed, not evaluated: --timing)
EXTRAS = {
    "evals": (
        *NEW,
        "train.eval_interval=100",
        "train.served_eval.num_prompts=8",
        "train.served_eval.max_new_tokens=64",
    ),  # fmt: skip
    "saves": (*NEW, "checkpoint.save_interval=100"),
    "preflight": (*NEW, "train.preflight_samples=4"),
    "offline": VARIANTS["offline"],  # the live target's cost: the same features from disk
}
# what each variant changes one thing against (the "alone" comparison docs/incumbent.md shows)
PARENT = {"betas999": "base", "normal_init": "base", "wd01": "base", "fp32_export": "base",
          "target_norm": "normal_init", "conf_detach": "target_norm",
          "markov_keep": "conf_detach", "new_betas999": "markov_keep",
          "std004": "markov_keep", "std001": "markov_keep"}  # fmt: skip
# prompts per workload: the demo evaluates 20 (DEMO_PROMPTS, also reported: the first 20 of
# these); 60 narrows the paired intervals by about 1/sqrt(3) (MATH and HumanEval rows below
# 100 are evaluation-only, MT-Bench has 80)
NUM_PROMPTS = 60
DEMO_PROMPTS = 20
# re-exports of base's checkpoints, the trained weights unchanged: variant -> export dtype
REEXPORTS = {"fp32_export": "float32"}
# per target: recipe, output, on-policy rows (answers of at most `answer_tokens`, `batch` at
# a time by the hf backend), overrides of every run of ours, and the command line's
# defaults. SmolLM2 answers ~70 tokens/s batched here and decodes ~8x slower than the tiny
# target: fewer, shorter rows (make real's mix: the demo's shares in 320 rows), fewer steps
# and prompts; ours offline, as SpecForge.
TARGETS = {
    "tiny": {"recipe": RECIPE, "out": "runs/incumbent", "rows": 600, "batch": 60,
             "answer_tokens": 160, "mix": demo.PROMPT_MIX, "ours": (), "defaults": {}},
    "smollm2": {"recipe": "recipes/smollm2_cpu.yaml", "out": "runs/incumbent_real",
                "rows": 320, "batch": 48, "answer_tokens": 96, "mix": demo.REAL_MIX,
                "ours": ("target.backend=hf",),  # the capture's source; SpecForge's features
                "defaults": {"steps": 500, "variants": "offline", "num_prompts": 10,
                             "max_new_tokens": 64}},
}  # fmt: skip


def train_ours(overrides: list[str], changes: tuple, seed: int, nproc: int, out: Path) -> dict:
    """Our trainer online from the live hf target (`torchrun train.py`), resumed if
    interrupted, reused when finished. Returns {"export", "seconds", "steps"}."""
    from specforge_dspark.config.recipe import load_recipe, resolved_dirs

    capture_dir = out.parent / "capture"
    needs_capture = any("{capture}" in o for o in changes)
    changes = [o.format(capture=capture_dir) for o in changes]
    if needs_capture and not (capture_dir / "manifest.json").is_file():
        from data_pipelines.prepare import prepare_dataset
        from specforge_dspark.cli.capture import capture

        recipe = load_recipe(RECIPE, overrides)
        capture(recipe, prepare_dataset(recipe), capture_dir)
    ov = [*overrides, f"train.output_dir={out}", f"train.seed={seed}", *changes]
    recipe = load_recipe(RECIPE, ov)
    export = resolved_dirs(recipe)["export"] / "sglang"
    timing = out / "timing.json"
    if (export / "config.json").is_file() and timing.is_file():
        return {"export": str(export), **json.loads(timing.read_text())}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(29600 + os.getpid() % 200),
           "train.py", "--recipe", RECIPE, "--resume", "auto", *ov]  # fmt: skip
    print(f"ours {out.name}: {' '.join(cmd[2:])}", flush=True)
    t = time.time()
    out.mkdir(parents=True, exist_ok=True)
    with (out / "train.log").open("w") as log:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    res = {"seconds": round(time.time() - t, 1), "steps": recipe.train.max_steps}
    timing.write_text(json.dumps(res))
    return {"export": str(export), **res}


def reexport(run: dict, dtype: str, out: Path) -> dict:
    """`run`'s final checkpoint exported again in `dtype` (`cli.export --dtype`)."""
    export = out / "export"
    if not (export / "config.json").is_file():
        ckpt = Path(run["export"]).parents[1] / "ckpt"
        cmd = [sys.executable, "-m", "specforge_dspark.cli.export", "--checkpoint", str(ckpt),
               "--format", "sglang", "--out", str(export), "--dtype", dtype]  # fmt: skip
        subprocess.run(cmd, check=True)
    return {**run, "export": str(export)}


def pooled_units(names: list[str], out: Path, first: int = 0) -> dict:
    """(workload, prompt) -> (committed, verify steps) summed over `names`' evaluations
    (under `out`); with `first`, only each workload's first prompts."""
    from evaluation.metrics import prompt_units

    total: dict = {}
    for name in names:
        for k, (c, n) in prompt_units(out / f"eval_{name}").items():
            if first and k[1] >= first:
                continue
            tc, tn = total.get(k, (0, 0))
            total[k] = (tc + c, tn + n)
    return total


def compare(a: dict, b: dict, workloads: list[str]) -> dict:
    """a minus b (unit maps) per workload and overall, paired on the same prompts."""
    from specforge_dspark.decoding.intervals import paired_difference

    rows = {}
    for w in [*workloads, "overall"]:
        keys = [k for k in a if w == "overall" or k[0] == w]
        rows[w] = paired_difference({k: a[k] for k in keys}, {k: b[k] for k in keys})
    return rows


def side(names: list[str], out: Path, workloads: list[str]) -> dict:
    """Accept length pooled over seeds, per workload and overall, with 95% intervals."""
    from specforge_dspark.decoding.intervals import bootstrap_ci

    units = pooled_units(names, out)
    res = {}
    for w in [*workloads, "overall"]:
        vals = [v for k, v in units.items() if w == "overall" or k[0] == w]
        c, n = [v[0] for v in vals], [v[1] for v in vals]
        res[w] = {"accept_length": round(sum(c) / sum(n), 4),
                  "accept_length_ci": bootstrap_ci(c, n)}  # fmt: skip
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(TARGETS), default="tiny",
                    help="smollm2: the real SmolLM2-135M-Instruct (make real-target)")  # fmt: skip
    ap.add_argument("--out", help="default runs/incumbent, with --target smollm2 "
                    "runs/incumbent_real")  # fmt: skip
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help=f"of {', '.join([*VARIANTS, *REEXPORTS])}"
    )
    ap.add_argument("--timing", action="store_true", help="also time the demo's extras")
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS, help="per workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    chosen = TARGETS[ap.parse_known_args(argv)[0].target]
    ap.set_defaults(**chosen["defaults"])
    a = ap.parse_args(argv)
    global RECIPE
    RECIPE = chosen["recipe"]
    os.chdir(REPO)
    if not SF_PY.is_file():
        raise SystemExit(f"{SF_PY} missing: run `make specforge-venv` (or `make incumbent`)")
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS and v not in REEXPORTS]
    if unknown or (set(REEXPORTS) & set(variants) and "base" not in variants):
        raise SystemExit(f"--variants {a.variants}: known {[*VARIANTS, *REEXPORTS]}, and a "
                         f"re-export ({', '.join(REEXPORTS)}) needs base")  # fmt: skip
    seeds = [int(s) for s in a.seeds.split(",")]
    t0 = time.time()

    from evaluation.figures import provenance
    from specforge_dspark.config.recipe import load_recipe
    from specforge_dspark.targets.real import build_real
    from specforge_dspark.targets.target import build

    out = Path(a.out or chosen["out"])
    base = load_recipe(RECIPE, [f"train.output_dir={out}"])
    demo.step(f"1/4 the target ({a.target}) and its on-policy answers (the demo's data)")
    target_path = Path(base.target.path)
    target = build_real(base.target.real, target_path) if base.target.real else build(target_path)
    demo.fresh_for_target(out, target)
    data = demo.on_policy_data(RECIPE, base, out, chosen["rows"], chosen["batch"],
                               chosen["answer_tokens"], mix=chosen["mix"])  # fmt: skip
    overrides = [*data, *OURS, *chosen["ours"], f"train.max_steps={a.steps}"]
    recipe = load_recipe(RECIPE, [*overrides, f"train.output_dir={out}"])

    demo.step(f"2/4 SpecForge 0.2.0 offline, seeds {seeds}")
    features = write_features(recipe, out / "features")
    runs: dict[str, dict] = {}
    for s in seeds:
        runs[f"specforge_s{s}"] = train_specforge(
            recipe, s, a.steps, a.nproc, features, out / f"specforge_s{s}"
        )
    demo.step(f"3/4 ours online, variants {variants}, seeds {seeds}")
    for v in variants:
        for s in seeds:
            if v in VARIANTS:
                name = f"{v}_s{s}"
                runs[name] = train_ours(overrides, VARIANTS[v], s, a.nproc, out / name)
    for v in set(variants) & set(REEXPORTS):
        for s in seeds:
            runs[f"{v}_s{s}"] = reexport(runs[f"base_s{s}"], REEXPORTS[v], out / f"{v}_s{s}")

    extras = {}
    if a.timing:  # the defaults' seed 0 against each extra alone, seconds per step
        base0 = train_ours(overrides, NEW, 0, a.nproc, out / "markov_keep_s0")
        for name, changes in EXTRAS.items():
            r = train_ours(overrides, changes, 0, a.nproc, out / f"extra_{name}")
            per_step = r["seconds"] / r["steps"]
            extra = (r["seconds"] - base0["seconds"]) / r["steps"]
            extras[name] = {"changes": list(changes), "seconds_per_step": round(per_step, 4),
                            "cost_per_step": round(extra, 4)}  # fmt: skip

    demo.step("4/4 acceptance by speculative decoding (held-out prompts)")
    workloads = demo.WORKLOADS.split(",")
    ev = out / f"prompts{a.num_prompts}"  # evaluations, by prompts per workload
    done = {n for n in runs if (ev / f"eval_{n}" / "summary.json").is_file()}
    todo = {n: r["export"] for n, r in runs.items() if n not in done}
    if todo:
        kw = dict(target_path=str(target), num_prompts=a.num_prompts,
                  max_new_tokens=a.max_new_tokens, out=str(ev))  # fmt: skip
        demo.evaluate_split(todo, workloads, kw)
    results = {n: json.loads((ev / f"eval_{n}" / "summary.json").read_text()) for n in runs}
    demo.print_table(results, workloads)

    sf_names = [f"specforge_s{s}" for s in seeds]
    sf_units = pooled_units(sf_names, ev)
    sides = {"specforge": side(sf_names, ev, workloads)}
    paired = {}
    for v in variants:
        names = [f"{v}_s{s}" for s in seeds]
        sides[v] = side(names, ev, workloads)
        paired[v] = {
            "pooled": compare(pooled_units(names, ev), sf_units, workloads),
            "by_seed": {
                s: compare(
                    pooled_units([f"{v}_s{s}"], ev),
                    pooled_units([f"specforge_s{s}"], ev),
                    workloads,
                )["overall"]
                for s in seeds
            },  # fmt: skip
        }
        if a.num_prompts > DEMO_PROMPTS:  # the demo's evaluation: the first 20 of these
            paired[v]["demo_prompts"] = compare(
                pooled_units(names, ev, DEMO_PROMPTS),
                pooled_units(sf_names, ev, DEMO_PROMPTS),
                workloads,
            )
        p = paired[v]["pooled"]["overall"]
        print(f"{v} - specforge (pooled over seeds): {p['difference']:+.3f} {p['ci']}")
    alone = {
        v: {"against": PARENT[v], **compare(pooled_units([f"{v}_s{s}" for s in seeds], ev),
                                            pooled_units([f"{PARENT[v]}_s{s}" for s in seeds], ev),
                                            workloads)["overall"]}
        for v in variants if PARENT.get(v) in variants
    }  # fmt: skip
    summary = {
        "alone": alone,
        "drafters": {n: demo.brief(r) for n, r in results.items()},
        "sides": sides,
        "paired": paired,
        "seconds_per_step": {n: round(r["seconds"] / r["steps"], 4) for n, r in runs.items()},
        "extras": extras,
        "runs": runs,
        "variants": {
            v: [c.format(capture=out / "capture") for c in VARIANTS.get(v, ())]
            or [f"base re-exported in {REEXPORTS.get(v)}"]
            for v in variants
        },
        "seeds": seeds,
        "target": a.target,
        "recipe": RECIPE,
        "steps": a.steps,
        "overrides": overrides,
        "rows": chosen["rows"],
        "training_prompts": [f"{f}[{i}:{i + n}] ({fld})" for f, fld, i, n in chosen["mix"]],
        "num_prompts": a.num_prompts,
        "demo_prompts": DEMO_PROMPTS,
        "max_new_tokens": a.max_new_tokens,
        "seconds": round(time.time() - t0, 1),
        "provenance": provenance(
            ["python", "scripts/incumbent.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out / 'summary.json'} ({summary['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
