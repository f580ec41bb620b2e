"""Drift on a quantized target (`make drift`): does a drafter trained online from the
quantized target do better on it than one trained from the full-precision original?

1. the tiny Inkling target (cached) and its NVFP4 copy (`--quant`, engines/quant_targets.py)
2. target against target: top-1 agreement and KL per token on the original's answers
   (evaluation/drift.py), per workload
3. drafter (a): the demo's (trained online from the full-precision target; `make demo`
   first); drafter (b): the same recipe, data, steps and seed, trained online from the
   NVFP4 copy
4. both decoded against the NVFP4 copy (lossless greedy), and (a) against the original
   for reference; (b) - (a) on the same prompts with its paired interval
Writes runs/drift/summary.json (with its provenance), publishable with
`python -m evaluation.figures publish drift`.
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

import demo  # noqa: E402  (scripts/demo.py: the run it reuses, evaluation split, tables)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--demo", default="runs/demo", help="the demo run whose data and drafter (a) it reuses"
    )
    ap.add_argument("--out", default="runs/drift")
    ap.add_argument("--quant", default="nvfp4", choices=("nvfp4", "fp8"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=10, help="per workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    os.chdir(REPO)
    t0 = time.time()
    from evaluation.drift import target_drift
    from evaluation.figures import provenance
    from evaluation.metrics import prompt_units
    from specforge_dspark.decoding.intervals import paired_difference
    from specforge_dspark.engines.quant_targets import write_quantized_copy

    run = Path(a.demo)
    summary_path = run / "summary.json"
    if not summary_path.is_file():
        raise SystemExit(f"{summary_path}: no demo run to compare with; run `make demo` first")
    shown = json.loads(summary_path.read_text())
    target = Path(shown["target_dir"])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    demo.step(f"1/4 the tiny target's {a.quant} copy")
    quant = write_quantized_copy(target, target.with_name(f"{target.name}_{a.quant}"), a.quant)
    workloads = demo.WORKLOADS.split(",")

    demo.step("2/4 target against target")
    drift = target_drift(target, quant, workloads, a.num_prompts, a.max_new_tokens)
    for w, r in drift.items():
        print(f"{w}: top-1 agreement {r['top1_agreement']:.4f}, KL {r['kl_a_b']:.5f} nats/token")

    demo.step(f"3/4 drafter (b): the demo's recipe trained online from the {a.quant} copy")
    overrides = [o for o in shown["overrides"] if not o.startswith("train.output_dir=")]
    overrides += [f"train.output_dir={out / 'train'}", f"target.path={quant}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc),
           "--master_port", str(29700 + os.getpid() % 200), "train.py", "--recipe",
           shown["recipe"], "--resume", "auto", *overrides]  # fmt: skip
    print(" ".join(cmd[2:]), flush=True)
    t = time.time()
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    train_s = time.time() - t

    demo.step("4/4 acceptance against the quantized target (and (a) against the original)")
    trained_a = str(Path(shown["export_dirs"][0]).parent / "sglang")
    trained_b = str(out / "train" / "export" / "sglang")
    on_quant, _, _ = demo.judge({"a": trained_a, "b": trained_b}, quant, a.num_prompts,
                                a.max_new_tokens, out / "on_quant")  # fmt: skip
    on_full, _, _ = demo.judge({"a": trained_a}, target, a.num_prompts, a.max_new_tokens,
                               out / "on_full")  # fmt: skip
    ua, ub = (prompt_units(out / "on_quant" / f"eval_{k}") for k in ("a", "b"))
    paired = {"overall": paired_difference(ub, ua)}
    for w in workloads:
        keys = [k for k in ua if k[0] == w]
        paired[w] = paired_difference({k: ub[k] for k in keys}, {k: ua[k] for k in keys})
    summary = {
        "quant": a.quant,
        "targets": drift,
        "on_quant": {k: demo.brief(on_quant[k]) for k in ("a", "b")},
        "a_on_full": demo.brief(on_full["a"]),
        "b_minus_a_on_quant": paired,
        "train_seconds": round(train_s, 1),
        "num_prompts": a.num_prompts,
        "max_new_tokens": a.max_new_tokens,
        "seconds": round(time.time() - t0, 1),
        "provenance": provenance(
            ["python", "scripts/drift.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    o = paired["overall"]
    print(f"(b) - (a) on the {a.quant} target: {o['difference']:+.3f} {o['ci']}; "
          f"wrote {out / 'summary.json'} ({summary['seconds']:.0f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
