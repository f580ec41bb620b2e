"""Every command a user runs answers `--help` with how it is run (`python -m MODULE`), what
it does, its options' defaults and an example, and runs nothing; a flag name means one
thing across commands."""

from __future__ import annotations

import importlib
import re
import subprocess

import pytest

BENCH = "specforge_dspark.cli.bench"
# module -> the function that parses its command line
COMMANDS = {
    "specforge_dspark.cli.export": "main",
    "specforge_dspark.cli.loop": "main",
    "specforge_dspark.cli.preflight": "main",
    "specforge_dspark.cli.init_recipe": "main",
    "specforge_dspark.cli.capture": "main",
    "specforge_dspark.cli.server_command": "main",
    "specforge_dspark.targets.__main__": "main",
    "specforge_dspark.engines.inkling_layout": "main",
    "data_pipelines.prepare": "main",
    "data_pipelines.regenerate": "main",
    "data_pipelines.long_context": "main",
    "evaluation.acceptance": "main",
    "evaluation.calibrate": "main",
    "evaluation.serve_check": "main",
    "evaluation.figures": "main",
    "evaluation.drift": "main",
    **{
        f"{BENCH}.{name}": "bench_main"
        for name in ("objective", "step", "stream", "pack", "capture", "drafters", "transport")
    },
    **{f"{BENCH}.sp": "bench_main"},  # fmt: skip
}
NO_DEFAULTS = {"evaluation.figures", "specforge_dspark.engines.inkling_layout"}  # none to show
RUN_AS = {"specforge_dspark.targets.__main__": "specforge_dspark.targets"}  # its __main__


def _help(module: str, fn: str, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        getattr(importlib.import_module(module), fn)(["--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch):
    """--help starts no process."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"--help started a process: {args[:1]}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_help_says_how_to_run_it_its_defaults_and_an_example(module, capsys):
    text = _help(module, COMMANDS[module], capsys)
    name = RUN_AS.get(module, module)
    if module.startswith(BENCH + "."):
        name = f"{BENCH} {module.rpartition('.')[2]}"
    assert text.startswith(f"usage: python -m {name} "), text[:200]
    assert "\nexample:\n  python -m " in text, text
    description = text.split("\n\n")[1]
    assert len(description.split()) >= 4, f"{module}: no description: {description!r}"
    if module not in NO_DEFAULTS:  # options with a default show it
        assert "(default: " in text, text


def test_train_help_names_torchrun_and_the_dry_run(capsys):
    import train

    with pytest.raises(SystemExit) as done:
        train.parse_args(["--help"])
    text = capsys.readouterr().out
    assert done.value.code == 0
    assert text.startswith("usage: torchrun --nproc_per_node N train.py ")
    assert "python train.py --recipe recipes/inkling_nvfp4.yaml --dry-run" in text


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["all", "--help"]])
def test_bench_help_prints_and_runs_nothing(argv, capsys, monkeypatch):
    bench = importlib.import_module(BENCH)
    monkeypatch.setattr(bench, "_run", lambda *a: pytest.fail(f"bench {argv} ran {a}"))
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m {BENCH} {{objective|")
    assert "all" in text and "example:" in text
    assert bench.main(["all", "--steps", "3"]) == 2  # `all` runs the defaults only
    assert "bench all takes no arguments" in capsys.readouterr().out


def test_a_flag_means_one_thing_across_commands(capsys):
    """`--samples` meant rows to check, a jsonl file and answers per prompt; now each has its
    own name, and no command takes `--samples`."""
    said: dict[str, set[str]] = {}
    for module, fn in COMMANDS.items():
        text = _help(module, fn, capsys)
        for flag in re.findall(r"^  (--[a-z][a-z0-9-]*)", text, re.M):
            said.setdefault(flag, set()).add(module)
    assert "--samples" not in said, said.get("--samples")
    assert said["--rows"] == {"specforge_dspark.cli.preflight"}
    assert said["--answers-per-prompt"] == {"data_pipelines.regenerate"}
    assert "specforge_dspark.cli.capture" in said["--input"]
