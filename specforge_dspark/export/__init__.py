"""Serving export: a trained draft as an SGLang or a vLLM (`speculators`) checkpoint.

    python -m specforge_dspark.cli.export --checkpoint RUN/ckpt/step-N --format sglang --out DIR
    python -m specforge_dspark.cli.export --checkpoint DIR --format speculators --out DIR \
        [--speculators-vocab full|reduced]

`--checkpoint` is a training step directory (`step-N/` with DeepSpeed's files,
train_state.json and the COMPLETE marker), a checkpoint root holding step directories
(the latest complete one is used), or an exported SGLang directory (re-export). Every
layout is one directory with `config.json` + `model.safetensors`, floating tensors bf16.
DSPARK_SPEC.md section 6 is the contract; the installed serving code decided the details.

Modules: `source` reads what an export starts from; `conventions` reads the conventions a
drafter directory or training checkpoint records and checks them (the record itself is
drafters/conventions.py); `sglang` writes the SGLang layout (DSPARK and
DFLASH); `speculators` builds the vLLM layout; `dspark` and `dflash` export one drafter
kind each; `dispatch` picks the export of the checkpoint's drafter kind (the command line
is cli/export.py).

Imports: config, drafters, objective, training
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from specforge_dspark.drafters.conventions import CONVENTIONS_KEY


class ExportError(ValueError):
    """An export that cannot be made as asked; the message says what to change."""


def publish(out_dir: str | Path, write: Callable[[Path], None]) -> Path:
    """Run `write(staging)` on a fresh directory beside `out_dir`, then replace `out_dir`
    with it whole; `out_dir` is untouched when `write` raises. Returns `out_dir`.
    `out_dir` may be absent, empty or an earlier export (`check_replaceable`). Its files
    get the modes any new file of this process gets (`readable`: 0644 under the usual
    umask 022), so the user who serves them can read them."""
    out = Path(out_dir)
    check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        staging = Path(tmp) / "out"
        write(staging)
        readable(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    return out


def readable(root: Path) -> None:
    """Give `root` and everything under it the modes the umask gives a new file (0666 &
    ~umask) or directory (0777 & ~umask): safetensors writes its files 0600."""
    umask = current_umask()
    for p in [root, *root.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def current_umask() -> int:
    """This process's umask, read without changing it (Linux /proc; else set and reset)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def check_replaceable(out: Path) -> None:
    """ExportError unless `out` is absent, an empty directory, or an earlier export (its
    config.json carries CONVENTIONS_KEY): an export never deletes anything else."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory: choose another output directory")
    entries = sorted(p.name for p in out.iterdir())
    if not entries or _is_export(out / "config.json"):
        return
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    raise ExportError(
        f"{out} is not an earlier export (no config.json with a '{CONVENTIONS_KEY}' entry) "
        f"and holds {shown}: an export replaces its output directory whole, so it refuses "
        "this one; choose a new or empty output directory"
    )


def _is_export(config_file: Path) -> bool:
    try:
        return CONVENTIONS_KEY in json.loads(config_file.read_text())
    except (OSError, ValueError, TypeError):
        return False
