"""One source for every figure a command produces: its results file under docs/results/.

`make demo`, `make quality` and `make bakeoff` each write runs/<name>/summary.json with a
`provenance` (date, commit, machine, command). Publishing copies that file to
docs/results/<name>.json (and its picture beside it) and renders the README's blocks
between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->` from it; tests/test_figures.py
fails when a block and its results file disagree.

    python -m evaluation.figures publish demo     # runs/demo -> docs/results, README
    python -m evaluation.figures render           # README blocks from docs/results
    python -m evaluation.figures check            # exit 1 when the README is stale
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from evaluation.render_drift import render_drift, render_drift_workloads
from evaluation.render_long import render_long, render_long_brief
from evaluation.render_races import render_incumbent, render_loop
from evaluation.renderers import (
    render_bakeoff,
    render_demo,
    render_quality,
    render_real,
    render_real_brief,
)
from specforge_dspark.config.command_line import command_parser

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
README = REPO / "README.md"
DOCS_WITH_FIGURES = (
    "loop.md", "bakeoff.md", "incumbent.md", "real.md", "engines.md", "long_context.md"
)  # fmt: skip
PAGES = (README, *(REPO / "docs" / f for f in DOCS_WITH_FIGURES))
# results name -> (run directory, picture in the run, where the picture is published)
PUBLISHED = {
    "demo": ("runs/demo", "summary.png", "docs/demo_summary.png"),
    "bakeoff": ("runs/bakeoff", "summary.png", "docs/bakeoff_summary.png"),
    "quality": ("runs/quality", "learning_curve.png", "docs/quality_learning_curve.png"),
    "drift": ("runs/drift", "", ""),
    "loop": ("runs/loop", "", ""),
    "loop_vllm": ("runs/loop_vllm", "", ""),
    "incumbent": ("runs/incumbent", "", ""),
    # the candidates measured one by one (scripts/incumbent.py --variants ...; runs/incumbent)
    "incumbent_ladder": ("runs/incumbent", "", ""),
    "real": ("runs/real", "summary.png", "docs/real_summary.png"),
    "loop_real": ("runs/loop_real", "", ""),
    "incumbent_real": ("runs/incumbent_real", "", ""),
    "long": ("runs/long", "", ""),
}
# results name -> the make command that writes it, where it is not `make <name>`
MAKE_COMMAND = {
    "loop_vllm": "make loop-vllm",
    "incumbent_ladder": "make incumbent",
    "loop_real": "make loop TARGET=smollm2",
    "incumbent_real": "make incumbent TARGET=smollm2",
}
RENDER = {
    "demo": render_demo,
    "real": render_real,
    "real_brief": render_real_brief,
    "bakeoff": render_bakeoff,
    "quality": render_quality,
    "drift": render_drift,
    "drift_workloads": render_drift_workloads,
    "loop": render_loop,
    "loop_vllm": lambda res: render_loop(res, "loop_vllm"),
    "loop_real": lambda res: render_loop(res, "loop_real"),
    "incumbent": render_incumbent,
    "incumbent_ladder": render_incumbent,
    "incumbent_real": lambda res: render_incumbent(res, "incumbent_real"),
    "long": render_long,
    "long_brief": render_long_brief,
}
"""block name -> the renderer of its figures block (from the results file of the same name,
or of BLOCK_RESULTS's)."""
BLOCK_RESULTS = {"drift_workloads": "drift", "real_brief": "real", "long_brief": "long"}
BLOCK = re.compile(r"(<!-- figures:(\w+) -->\n)(.*?)(<!-- /figures:\2 -->)", re.S)


def provenance(argv: list[str]) -> dict:
    """Where and how a results file was made: date (UTC), commit (with `+dirty` when the
    tree had changes), machine and the command line."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "commit": commit + ("+dirty" if dirty else ""),
        "machine": f"{os.cpu_count()}-core CPU, {platform.machine()}, {platform.system()}",
        "command": shlex.join(argv),  # an empty argument shows as ''
    }


def load_results(name: str, results: Path = RESULTS) -> dict:
    path = results / f"{name}.json"
    res = json.loads(path.read_text())
    missing = {"date", "commit", "machine", "command"} - set(res.get("provenance", {}))
    if missing:
        raise ValueError(f"{path}: provenance lacks {sorted(missing)}")
    return res


def render(text: str, results: Path = RESULTS, in_docs: bool = False) -> str:
    """`text` (a README, or a page of docs/ when `in_docs`: its links drop the `docs/`)
    with every figures block rendered from its results file; a block whose results file
    does not exist yet says which command publishes it."""

    def block(m: re.Match) -> str:
        block_name = m.group(2)
        if block_name not in RENDER:
            raise ValueError(f"block figures:{block_name}: no renderer (known: {sorted(RENDER)})")
        name = BLOCK_RESULTS.get(block_name, block_name)
        if (results / f"{name}.json").is_file():
            body = RENDER[block_name](load_results(name, results))
            picture = PUBLISHED[name][2] if block_name == name else ""  # the full block's
            if picture and (REPO / picture).is_file():
                body += f"\n![{name}: accept length per workload, 95% intervals]({picture})\n"
        else:
            command = MAKE_COMMAND.get(name, f"make {name}")
            body = (f"Not published yet: run `{command}`, then "
                    f"`python -m evaluation.figures publish {name}`.\n")  # fmt: skip
        if in_docs:
            body = body.replace("](docs/", "](")
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(block, text)


def publish(name: str, run_dir: Path | None = None) -> Path:
    """Copy runs/<name>/summary.json (and its picture) into docs/, then render README."""
    default_run, picture, published_picture = PUBLISHED[name]
    run = Path(run_dir or REPO / default_run)
    summary = run / "summary.json"
    if not summary.is_file():
        raise SystemExit(f"{summary}: no results to publish; run `make {name}` first")
    res = json.loads(summary.read_text())
    if "provenance" not in res:
        raise SystemExit(f"{summary}: written before results carried their provenance; rerun")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    if picture and (run / picture).is_file():
        shutil.copyfile(run / picture, REPO / published_picture)
    render_pages()
    return out


def render_pages() -> list[Path]:
    """Rewrite the figures blocks of every page; returns the pages that changed."""
    changed = []
    for page in PAGES:
        text = page.read_text()
        if render_page(page) != text:
            page.write_text(render_page(page))
            changed.append(page)
    return changed


def render_page(page: Path) -> str:
    return render(page.read_text(), in_docs=page.parent.name == "docs")


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(
        "evaluation.figures",
        __doc__.split("\n\n")[0],
        "python -m evaluation.figures publish demo  # after make demo",
        "python -m evaluation.figures check",
    )
    sub = ap.add_subparsers(dest="action", required=True)
    p = sub.add_parser("publish", help="copy runs/NAME/summary.json to docs/results/NAME.json")
    p.add_argument("name", choices=sorted(PUBLISHED))
    p.add_argument("--run", type=Path, default=None, help="the run directory (default runs/NAME)")
    sub.add_parser("render", help="rewrite the README's figures blocks from docs/results")
    sub.add_parser("check", help="exit 1 when a README figures block is stale")
    a = ap.parse_args(argv)
    if a.action == "publish":
        print(f"published {publish(a.name, a.run)}; README rendered")
    elif a.action == "render":
        render_pages()
    else:
        stale = [p.relative_to(REPO) for p in PAGES if render_page(p) != p.read_text()]
        if stale:
            print(f"{', '.join(map(str, stale))}: figures blocks differ from docs/results; run "
                  "`python -m evaluation.figures render`", file=sys.stderr)  # fmt: skip
            return 1
        print("figures blocks match docs/results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
