"""The dispatch of a checkpoint to the export of its drafter kind (train.py and the
`python -m specforge_dspark.cli.export` command both export through it)."""

from __future__ import annotations

from pathlib import Path

from specforge_dspark.export import dflash, dspark
from specforge_dspark.export.source import checkpoint_kind


def export_checkpoint(
    ckpt_dir: str | Path,
    fmt: str,
    out_dir: str | Path,
    target_path: str | Path | None = None,
    verifier_name: str | None = None,
    speculators_vocab: str | None = None,
    dtype: str | None = None,
) -> Path:
    """Export a training checkpoint (or an exported SGLang directory) as `fmt`: a DFlash
    or DFlash2 one (recipe `draft.kind`) with `dflash.export_dflash_checkpoint`, else with
    `dspark.export_dspark_checkpoint` (its docstring: defaults taken from the recipe);
    `dtype` ("bfloat16" or "float32") overrides the recipe's `export.dtype`."""
    if checkpoint_kind(ckpt_dir) != "dspark":
        return dflash.export_dflash_checkpoint(ckpt_dir, fmt, out_dir, target_path, dtype)
    return dspark.export_dspark_checkpoint(
        ckpt_dir, fmt, out_dir, target_path, verifier_name, speculators_vocab, dtype
    )
