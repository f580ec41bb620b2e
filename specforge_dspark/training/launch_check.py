"""The dry run's check of a served target's launch arguments (`train.py --dry-run`).

First our own building of them (`launch_args` of engines/sglang.py or engines/vllm.py:
reserved keys, aux layer ids), then the engine's own validation, run in a child
interpreter: target.<engine>.python when the engine imports there, else the trainer's
(which has sglang installed --no-deps for such checks; not vLLM):
- sglang: `prepare_server_args` (its argparse: unknown keys, types, choices) and
  `ServerArgs.resolve_once`, its model-independent resolution hooks. Those import
  SGLang's model configs, which need the server environment's torchvision; where it is
  missing (the trainer's venv) only the parse runs, and the printed line says so.
- vllm: vLLM's serve parser (`make_arg_parser`) and `validate_parsed_serve_args`.
The model path is given as "dummy": nothing is loaded; the checks that need the model
run when the server starts. A refusal names target.<engine>.server_args.<key> when the
engine's message names that key's flag, else target.<engine>.server_args.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from specforge_dspark.config.recipe import Recipe

CANNOT_IMPORT = 3  # exit status of a check whose engine does not import there
TIMEOUT_S = 600.0

SGLANG_CHECK = """
import json, sys
try:
    import sglang
    from sglang.srt.server_args import prepare_server_args
except ImportError as e:
    print(e)
    sys.exit(3)
args = prepare_server_args(json.loads(sys.argv[1]))
try:
    args.resolve_once()
except ImportError as e:
    print(f"SGLang {sglang.__version__}: parsed, not resolved (needs {e.name}, missing there)")
    sys.exit(0)
print(f"SGLang {sglang.__version__}: parsed and resolved")
"""

VLLM_CHECK = """
import json, sys
try:
    import vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError as e:
    print(e)
    sys.exit(3)
parser = make_arg_parser(FlexibleArgumentParser())
validate_parsed_serve_args(parser.parse_args(json.loads(sys.argv[1])))
print(f"vLLM {vllm.__version__}: parsed and validated")
"""

ENGINES = {
    "sglang": ("SGLang", "--model-path", SGLANG_CHECK),
    "vllm": ("vLLM", "--model", VLLM_CHECK),
}
"""Per served backend: its name, its model-path flag, the check run in its interpreter."""


def check_launch_args(recipe: Recipe) -> list[str]:
    """The dry-run line saying how the served target's launch arguments were checked;
    [] for the hf and offline backends. ValueError naming the recipe key for a refusal."""
    engine = recipe.target.backend
    if engine not in ENGINES:
        return []
    name, model_flag, script = ENGINES[engine]
    argv = _launch_args(recipe)
    argv[argv.index(model_flag) + 1] = "dummy"
    server = getattr(recipe.target, engine)
    tried = []
    for python in _interpreters(server.python):
        try:
            p = subprocess.run(
                [python, "-I", "-c", script, json.dumps(argv)],
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return [f"server_args: not checked by {name} ({python} took over {TIMEOUT_S:.0f} s)"]
        if p.returncode == 0:
            return [f"server_args: {p.stdout.strip().splitlines()[-1]} ({python})"]
        if p.returncode != CANNOT_IMPORT:
            message = _message(p.stderr or p.stdout)
            raise ValueError(
                f"{_culprit(message, server.server_args, engine)}: {name} refuses the server's "
                f"launch arguments: {message}"
            )
        tried.append(python)
    where = " nor ".join(tried) or f"target.{engine}.python ({server.python})"
    return [
        f"server_args: not checked by {name} (it imports neither at {where}; "
        f"`make {engine}-venv` makes the environment target.{engine}.python names by default)"
    ]


def _launch_args(recipe: Recipe) -> list[str]:
    """The backend's launch arguments, built without side effects: a transformers Inkling
    target is given by a path SGLang would see after conversion, which the dry run does
    not write (the model path is replaced by "dummy" anyway)."""
    t = recipe.target
    if t.backend == "vllm":
        from specforge_dspark.engines.vllm import launch_args

        return launch_args(recipe, recipe.draft.num_target_layers)
    from specforge_dspark.engines.inkling_layout import is_transformers_inkling
    from specforge_dspark.engines.sglang import launch_args

    if (Path(t.path) / "config.json").is_file() and is_transformers_inkling(Path(t.path)):
        # an unreadable path: SGLang's Inkling keeps its radix cache, as the converted one
        recipe = dataclasses.replace(recipe, target=dataclasses.replace(t, path="dummy"))
    return launch_args(recipe)


def _interpreters(python: str) -> list[str]:
    """target.<engine>.python when it resolves to a file, then this interpreter."""
    exe = python if os.sep in python else shutil.which(python)
    found = [exe] if exe and Path(exe).is_file() else []
    return [*found, sys.executable] if sys.executable not in found else found


def _message(text: str) -> str:
    """The engine's own words: argparse's "error: ..." line, else the last line (a
    traceback's exception)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for line in reversed(lines):
        if "error: " in line:
            return line.split("error: ", 1)[1]
    return lines[-1] if lines else "(no message)"


def _culprit(message: str, server_args: dict, engine: str) -> str:
    """The recipe key of the server argument the message names, by flag or field name."""
    for key in server_args:
        flag = "--" + key.replace("_", "-")
        if re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])|\b{re.escape(key)}\b", message):
            return f"target.{engine}.server_args.{key}"
    return f"target.{engine}.server_args"
