"""Prepare chat data for training: token ids and assistant-only loss masks, cached.

    python -m data_pipelines.prepare --recipe R [--split train|eval] [--input FILE ...]
        [--format auto|sharegpt|messages|pairs] [--out DIR] [--no-cache] [key.sub=value ...]

From the trainer:

    ds = prepare_dataset(recipe, split="train")   # datasets.Dataset, cached

Columns: sample_id (0..n-1), source ("file:row", row 0-based), input_ids (int32),
loss_mask (int8, 1 = supervised assistant token), num_supervised, num_tokens, truncated.
The cache lives in `data.cache_dir/<split>-<key>/` where the key hashes the tokenizer
files (chat template included), the data parameters, the input files' size and mtime,
and the library versions; a folder exists only once complete (built aside, renamed).
`--out DIR` writes the same files (data.arrow, rejects.jsonl, prepare_report.json) to DIR.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from data_pipelines.formats import FormatConfig
from data_pipelines.ingest import check_input_file
from data_pipelines.pipeline import PrepareParams, run_prepare
from data_pipelines.render import load_tokenizer
from specforge_dspark.config.command_line import command_parser

PIPELINE_VERSION = 1
REPO = Path(__file__).resolve().parents[1]
BENCH_FILE = REPO.parent / "shared" / "data" / "train" / "gsm8k_train.jsonl"
TOKENIZER_FILE_PREFIXES = (
    "tokenizer",
    "special_tokens_map",
    "added_tokens",
    "vocab",
    "merges",
    "chat_template",
    "spiece",
)


def params_from_recipe(
    recipe, split: str = "train", files: list[str] | None = None, fmt: str | None = None
) -> PrepareParams:
    """PrepareParams from the recipe's data and target sections; files/fmt override it."""
    d = recipe.data
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, got {split!r}")
    key = f"data.{split}_files"
    files = list(files or (d.train_files if split == "train" else d.eval_files))
    if not files:
        raise ValueError(f"{key} is empty: nothing to prepare (or pass --input)")
    for f in files:
        try:
            check_input_file(f)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
    if not recipe.target.path or not Path(recipe.target.path).is_dir():
        raise ValueError(f"target.path {recipe.target.path!r}: no such tokenizer directory")
    fmt_cfg = FormatConfig(fmt or d.format, d.prompt_field, d.response_field, d.system_prompt)
    return PrepareParams(
        files=tuple(files),
        tokenizer_path=recipe.target.path,
        fmt=fmt_cfg,
        max_length=d.max_length,
        max_rows=d.max_rows,
        template_kwargs=dict(d.chat_template_kwargs),
        num_proc=max(1, d.num_proc),
    )


def _tokenizer_files(path: Path) -> list[Path]:
    files = [p for p in path.rglob("*") if p.is_file()]
    keep = [
        p
        for p in files
        if p.name.startswith(TOKENIZER_FILE_PREFIXES)
        or p.suffix in (".tiktoken", ".jinja")
        or "chat_template" in p.parent.name
    ]
    return sorted(keep)


def cache_key(params: PrepareParams) -> str:
    """Hash of tokenizer files, data parameters, input file stats and versions."""
    h = hashlib.sha256()
    tok_dir = Path(params.tokenizer_path)
    for p in _tokenizer_files(tok_dir):
        h.update(str(p.relative_to(tok_dir)).encode())
        h.update(hashlib.sha256(p.read_bytes()).digest())
    inputs = []
    for f in params.files:
        st = Path(f).stat()
        inputs.append([f, str(Path(f).resolve()), st.st_size, st.st_mtime_ns])
    fields = dataclasses.asdict(params)
    fields.pop("num_proc")  # does not change the result
    fields.pop("tokenizer_path")  # the files' content counts, not where they are
    meta = {
        "pipeline": PIPELINE_VERSION,
        "params": fields,
        "inputs": inputs,
        "versions": [version("transformers"), version("tokenizers"), version("datasets")],
    }
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def load_prepared(out_dir: str | Path):
    """The prepared rows in `out_dir` as a memory-mapped datasets.Dataset."""
    from datasets import Dataset

    return Dataset.from_file(str(Path(out_dir) / "data.arrow"))


def build(params: PrepareParams, out_dir: Path, progress: bool) -> dict[str, Any]:
    """Prepare into `out_dir`, built in a sibling temporary folder and renamed when done."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is ordinary shared data
    try:
        report = run_prepare(params, tmp, progress)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def prepare_cached(
    params: PrepareParams, cache_dir: str | Path, split: str, progress: bool
) -> tuple[Path, dict[str, Any]]:
    """The cache folder for `params` (built now if missing, one process at a time)."""
    root = Path(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"{split}-{cache_key(params)}"
    with open(root / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other ranks wait here, then reuse the result
        if (out / "prepare_report.json").is_file():
            return out, json.loads((out / "prepare_report.json").read_text())
        return out, build(params, out, progress)


def prepare_dataset(
    recipe,
    split: str = "train",
    files: list[str] | None = None,
    fmt: str | None = None,
    progress: bool | None = None,
):
    """The recipe's prepared `split` as a datasets.Dataset (built and cached on first use).

    Progress bars show on rank 0 only (RANK environment variable) unless `progress`."""
    params = params_from_recipe(recipe, split, files, fmt)
    if progress is None:
        progress = os.environ.get("RANK", "0") == "0"
    out, report = prepare_cached(params, recipe.data.cache_dir, split, progress)
    if progress:
        print(summary(report, out), file=sys.stderr)
    return load_prepared(out)


def summary(report: dict[str, Any], out: Path) -> str:
    """Human-readable end-of-run summary."""
    rej = report["rejected"]
    lines = [
        f"prepare: {report['rows_kept']}/{report['rows_read']} rows kept, "
        f"{sum(rej.values())} rejected, {report['supervised_tokens']} supervised tokens "
        f"of {report['tokens']}, {report['rows_truncated']} truncated -> {out}",
    ]
    lines += [f"  rejected {reason}: {n}" for reason, n in rej.items()]
    if rej:
        lines.append(f"  see {out / 'rejects.jsonl'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from specforge_dspark.config.recipe import RecipeError, load_recipe

    ap = command_parser(
        "data_pipelines.prepare",
        __doc__.split("\n\n")[0],
        "python -m data_pipelines.prepare --recipe recipes/tiny_cpu.yaml",
    )
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--split", choices=["train", "eval"], default="train")
    ap.add_argument("--input", nargs="+", help="input files (override data.<split>_files)")
    ap.add_argument("--format", choices=["auto", "sharegpt", "messages", "pairs"])
    ap.add_argument("--out", type=Path, help="output folder (default: the recipe's cache)")
    ap.add_argument("--no-cache", action="store_true", help="rebuild even if cached")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, key.sub=value")
    a = ap.parse_args(argv)
    try:
        recipe = load_recipe(a.recipe, a.overrides, required={})  # its sections: data, target
        params = params_from_recipe(recipe, a.split, a.input, a.format)
    except (RecipeError, ValueError) as e:
        print(f"prepare: {e}", file=sys.stderr)
        return 2
    if a.out:
        if a.out.exists() and any(a.out.iterdir()) and not (a.out / "data.arrow").exists():
            print(
                f"prepare: --out {a.out} is a non-empty folder of something else", file=sys.stderr
            )
            return 2
        out, report = a.out, build(params, a.out, not a.quiet)
    elif a.no_cache:
        out = Path(recipe.data.cache_dir) / f"{a.split}-{cache_key(params)}"
        report = build(params, out, not a.quiet)
    else:
        out, report = prepare_cached(params, recipe.data.cache_dir, a.split, not a.quiet)
    print(summary(report, out))
    return 0


def bench_main(argv: list[str] | None = None) -> int:
    """Rows/s of prepare (no cache) on GSM8K train; prints `prepare rows_per_s=<x>`."""
    ap = command_parser(
        "python -m specforge_dspark.cli.bench prepare",
        bench_main.__doc__,
        "python -m specforge_dspark.cli.bench prepare",
    )
    ap.add_argument("--file", default=str(BENCH_FILE))
    ap.add_argument("--tokenizer", default=str(REPO / ".cache" / "tiny_target"))
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--max-rows", type=int, default=0)
    ap.add_argument("--num-proc", type=int, default=1)
    a = ap.parse_args(argv)
    if not Path(a.tokenizer).is_dir():
        from specforge_dspark.targets.target import build as build_target

        build_target(Path(a.tokenizer), log=lambda *x: print(*x, file=sys.stderr))
    params = PrepareParams(
        files=(a.file,),
        tokenizer_path=a.tokenizer,
        fmt=FormatConfig("pairs", "question", "answer"),
        max_length=a.max_length,
        max_rows=a.max_rows,
        num_proc=a.num_proc,
    )
    load_tokenizer(a.tokenizer)  # one-off import cost of transformers, not per-row work
    with tempfile.TemporaryDirectory(prefix="bench_prepare_") as tmp:
        t0 = time.perf_counter()  # from here: tokenizer load, read, render, tokenise, write
        report = run_prepare(params, Path(tmp), progress=False)
        took = time.perf_counter() - t0
    print(
        f"bench prepare: {report['rows_read']} rows ({report['rows_kept']} kept) in "
        f"{took:.2f}s, {report['supervised_tokens']} supervised tokens",
        file=sys.stderr,
    )
    print(f"prepare rows_per_s={report['rows_read'] / took:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
