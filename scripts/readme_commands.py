"""Run the commands the README names, each once with its defaults, and record how each went
(`make readme-commands`, after `make test` has installed everything): every `python -m`
command's `--help`, every `cli.bench` benchmark (`bench all`), a fresh recipe for the tiny
target and its preflight, the production recipe's dry run, and the figures check.

The `make` targets that are experiments of their own (demo, real, quality, bakeoff, drift,
incumbent, loop, long) are recorded where they publish (docs/measured.md), not rerun here.
Writes runs/readme_commands/summary.json and one log per command; exits 1 when any failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HELP = (
    "specforge_dspark.cli.export", "specforge_dspark.cli.preflight",
    "specforge_dspark.cli.init_recipe", "specforge_dspark.cli.capture",
    "specforge_dspark.cli.bench", "specforge_dspark.cli.loop", "specforge_dspark.targets",
    "data_pipelines.prepare", "data_pipelines.regenerate", "data_pipelines.long_context",
    "evaluation.acceptance",
    "evaluation.calibrate", "evaluation.serve_check", "evaluation.drift", "evaluation.figures",
)  # fmt: skip


TINY_DATA = (
    "data.train_files=[../shared/data/train/gsm8k_train.jsonl]",
    "data.eval_files=[../shared/data/eval/gsm8k_test.jsonl]",
    "data.format=pairs", "data.prompt_field=question", "data.response_field=answer",
)  # fmt: skip


def commands(out: Path) -> list[tuple[str, list[str]]]:
    py = sys.executable
    recipe = out / "tiny.yaml"
    return [
        *((f"{m} --help", [py, "-m", m, "--help"]) for m in HELP),
        ("init_recipe on the tiny target", [
            py, "-m", "specforge_dspark.cli.init_recipe", "--target", ".cache/tiny_target",
            "--gpus", "0", "--out", str(recipe)]),
        ("preflight of that recipe", [
            py, "-m", "specforge_dspark.cli.preflight", "--recipe", str(recipe),
            f"train.output_dir={out / 'run'}"]),
        # its regenerated data is made on the GPU node: the tiny recipe's GSM8K stands in
        ("dry run of the production recipe on 8 ranks", [
            py, "train.py", "--recipe", "recipes/inkling_nvfp4.yaml", "--dry-run",
            "--world-size", "8", *TINY_DATA]),
        ("figures check", [py, "-m", "evaluation.figures", "check"]),
        ("bench all (each benchmark, defaults)", [py, "-m", "specforge_dspark.cli.bench", "all"]),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/readme_commands")
    ap.add_argument("--skip-bench", action="store_true", help="leave out `bench all`")
    a = ap.parse_args(argv)
    from evaluation.figures import provenance

    out = REPO / a.out
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (name, cmd) in enumerate(commands(out)):
        if a.skip_bench and cmd[-2:] == ["bench", "all"]:
            continue
        log = out / f"{i:02d}.log"
        t0 = time.time()
        with log.open("w") as f:
            rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
        seconds = round(time.time() - t0, 1)
        tail = [x for x in log.read_text().splitlines() if x.strip()][-1:] or [""]
        rows.append({"command": name, "argv": cmd[1:], "rc": rc, "seconds": seconds,
                     "log": str(log.relative_to(REPO)), "last_line": tail[0][-200:]})  # fmt: skip
        print(f"{'ok ' if rc == 0 else 'FAILED'} {seconds:7.1f} s  {name}", flush=True)
    summary = {"commands": rows, "provenance": provenance(["python", *sys.argv])}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    failed = [r["command"] for r in rows if r["rc"]]
    print(f"wrote {out / 'summary.json'}; " + (f"FAILED: {failed}" if failed else "all ran"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
