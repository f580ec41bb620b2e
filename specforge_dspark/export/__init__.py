"""Serving export: a trained draft as an SGLang or a vLLM (`speculators`) checkpoint.

    python -m specforge_dspark.cli.export --checkpoint RUN/ckpt/step-N --format sglang --out DIR
    python -m specforge_dspark.cli.export --checkpoint DIR --format speculators --out DIR \
        [--speculators-vocab full|reduced]

`--checkpoint` is a training step directory (`step-N/` with DeepSpeed's files,
train_state.json and the COMPLETE marker), a checkpoint root holding step directories
(the latest complete one is used), or an exported SGLang directory (re-export). Every
layout is one directory with `config.json` + `model.safetensors`, floating tensors bf16.
DSPARK_SPEC.md section 6 is the contract; the installed serving code decided the details.

Modules: `source` reads what an export starts from; `conventions` is the record every
layout carries and the check of it; `sglang` writes the SGLang layout (DSPARK and
DFLASH); `speculators` builds the vLLM layout; `dspark` and `dflash` export one drafter
kind each; `dispatch` picks the export of the checkpoint's drafter kind (the command line
is cli/export.py).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


class ExportError(ValueError):
    """An export that cannot be made as asked; the message says what to change."""


def publish(out_dir: str | Path, write: Callable[[Path], None]) -> Path:
    """Run `write(staging)` on a fresh directory beside `out_dir`, then replace `out_dir`
    with it whole; `out_dir` is untouched when `write` raises. Returns `out_dir`."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        staging = Path(tmp) / "out"
        write(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    return out
