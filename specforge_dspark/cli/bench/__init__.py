"""Benchmarks: `python -m specforge_dspark.cli.bench NAME|all [args]`, NAME one of BENCHES.

Each benchmark is a function `bench_main(argv: list[str] | None = None) -> int` in its own
module (table below), imported only when asked for; extra arguments after the name go to
it. `all` runs every benchmark with its defaults and says which ones are not available.

objective: bench/objective.py; step: bench/step.py (one whole train step, optionally beside
another checkout's); stream: bench/stream.py; pack: bench/pack.py (training runs
with and without data.pack); capture: bench/capture.py (a live CPU SGLang
server, with vs without feature capture); drafters: bench/drafters.py (one capture feeding one
drafter vs two); transport: bench/transport.py (/dev/shm vs Mooncake TCP); sp:
bench/sp.py (memory per rank at 2K-8K, 1 vs 2 ranks per sequence); prepare:
data_pipelines/prepare.py.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from specforge_dspark.config.command_line import command_parser

BENCHES = {
    "objective": ("specforge_dspark.cli.bench.objective", "bench_main"),
    "step": ("specforge_dspark.cli.bench.step", "bench_main"),
    "stream": ("specforge_dspark.cli.bench.stream", "bench_main"),
    "pack": ("specforge_dspark.cli.bench.pack", "bench_main"),
    "capture": ("specforge_dspark.cli.bench.capture", "bench_main"),
    "drafters": ("specforge_dspark.cli.bench.drafters", "bench_main"),
    "transport": ("specforge_dspark.cli.bench.transport", "bench_main"),
    "sp": ("specforge_dspark.cli.bench.sp", "bench_main"),
    "prepare": ("data_pipelines.prepare", "bench_main"),
}


USAGE = f"usage: python -m specforge_dspark.cli.bench {{{'|'.join([*BENCHES, 'all'])}}} [args]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]) or argv[:2] in (["all", "-h"], ["all", "--help"]):
        print(f"{USAGE}\n\n{__doc__}\nexample:\n  python -m specforge_dspark.cli.bench objective\n"
              "  python -m specforge_dspark.cli.bench step --help")  # fmt: skip
        return 0
    if not argv or argv[0] not in (*BENCHES, "all"):
        print(USAGE)
        return 2
    name, rest = argv[0], argv[1:]
    if name != "all":
        return _run(name, rest)
    if rest:
        print(f"bench all takes no arguments (got {rest}): every benchmark runs its defaults")
        return 2
    return max(_run(n, []) for n in BENCHES)


def _run(name: str, argv: list[str]) -> int:
    module, attr = BENCHES[name]
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        print(f"bench {name}: not available ({module}.{attr}: {e})", flush=True)
        return 1
    return int(fn(argv) or 0)


def bench_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The argument parser of `python -m specforge_dspark.cli.bench NAME`."""
    command = f"python -m specforge_dspark.cli.bench {name}"
    return command_parser(command, doc, command)


def tiny_target(path: str, arch: str = "inkling") -> str:
    """The tiny target at `path`, built there first when missing (progress on stderr)."""
    from specforge_dspark.targets.target import build

    log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731
    return str(build(Path(path), arch=arch, log=log))
