"""Serving export of a DSpark draft: the SGLang DSPARK layout (sglang.py) or the vLLM
speculators layout (speculators.py), each with the conventions record (conventions.py).

    python -m specforge_dspark.cli.export --checkpoint RUN/ckpt/step-N --format sglang --out DIR
dispatches here when the checkpoint's recipe has `draft.kind: dspark`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specforge_dspark.config.recipe import Recipe
from specforge_dspark.drafters.conventions import ConventionsError, check_recorded, conventions
from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft
from specforge_dspark.export import ExportError
from specforge_dspark.export.conventions import recorded_conventions
from specforge_dspark.export.sglang import write_sglang
from specforge_dspark.export.source import deepspeed_weights, resolve_checkpoint, step_recipe
from specforge_dspark.export.speculators import SPECULATORS_VOCABS, write_speculators

FORMATS = ("sglang", "speculators")


def export_draft(
    draft_or_state_dict: DSparkDraft | dict[str, torch.Tensor],
    cfg: DSparkConfig | None,
    out_dir: str | Path,
    fmt: str,
    verifier_name: str | None = None,
    target_path: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    speculators_vocab: str = "full",
    known: dict[str, Any] | None = None,
) -> Path:
    """Write one serving layout of a draft to `out_dir` (replaced whole); returns it.

    `cfg` may be None when a `DSparkDraft` is given. speculators needs `target_path` (the
    target directory: LM head, vocab and muP multiplier); `verifier_name` (what vLLM loads
    as the verifier) defaults to its absolute path; `speculators_vocab` is "full" or
    "reduced" (speculators.py). `known`: conventions already recorded for this draft
    (checked against the target; they fill in what the target does not say). `dtype`:
    the weights as written (a training checkpoint's `export.dtype`).
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; expected one of {list(FORMATS)}")
    if speculators_vocab not in SPECULATORS_VOCABS:
        raise ExportError(
            f"export.speculators_vocab (--speculators-vocab) is {speculators_vocab!r}; "
            f"expected one of {list(SPECULATORS_VOCABS)}"
        )
    draft = _as_draft(draft_or_state_dict, cfg)
    record = conventions(draft.config, target_path)
    if known:
        check_recorded(
            known, record, "the conventions recorded for this draft", f"target {target_path}"
        )
        record |= {k: known[k] for k, v in record.items() if v is None and k in known}
    if fmt == "sglang":
        return write_sglang(draft, out_dir, record, dtype)
    return write_speculators(
        draft, out_dir, record, target_path, verifier_name, dtype, speculators_vocab
    )


def export_dspark_checkpoint(
    ckpt_dir: str | Path,
    fmt: str,
    out_dir: str | Path,
    target_path: str | Path | None = None,
    verifier_name: str | None = None,
    speculators_vocab: str | None = None,
    dtype: str | None = None,
) -> Path:
    """Export a DSpark training checkpoint (or an exported SGLang directory) as `fmt`.

    For a training checkpoint the target, verifier name, speculators vocabulary and dtype
    default to the recipe's `target.path`, `export.verifier_name`, `export.speculators_vocab`
    (else "full") and `export.dtype` (else bfloat16). The conventions the checkpoint
    records must agree with the target.
    """
    cfg, weights, recipe = read_checkpoint(ckpt_dir)
    weights_dtype = dtype or "bfloat16"
    if recipe is not None:
        target_path = target_path or recipe.target.path or None
        verifier_name = verifier_name or recipe.export.verifier_name or None
        speculators_vocab = speculators_vocab or recipe.export.speculators_vocab
        weights_dtype = dtype or recipe.export.dtype
    known = recorded_conventions(ckpt_dir)
    try:
        return export_draft(
            weights,
            cfg,
            out_dir,
            fmt,
            verifier_name,
            target_path,
            dtype=getattr(torch, weights_dtype),
            speculators_vocab=speculators_vocab or "full",
            known=known,
        )
    except (ExportError, ConventionsError) as e:
        raise ExportError(f"--checkpoint {ckpt_dir}: {e}") from None


def read_checkpoint(
    ckpt_dir: str | Path,
) -> tuple[DSparkConfig, dict[str, torch.Tensor], Recipe | None]:
    """(config, fp32 weights, recipe or None) of a training step, a checkpoint root or an
    exported SGLang directory. An incomplete training checkpoint is refused."""
    path = Path(ckpt_dir)
    kind, resolved = resolve_checkpoint(path)
    if kind == "training":
        recipe = step_recipe(resolved)
        cfg = DSparkConfig.from_recipe(recipe.draft)
        return cfg, deepspeed_weights(resolved, recipe.dist.zero_stage), recipe
    if kind == "export":
        if "speculators_model_type" in json.loads((resolved / "config.json").read_text()):
            raise ExportError(
                f"--checkpoint {path}: a speculators export cannot be read back (its "
                "norm.weight or lm_head.weight carries the folded muP multiplier); export "
                "the training checkpoint or the SGLang export instead"
            )
        draft = DSparkDraft.from_pretrained(resolved)
        return draft.config, draft.state_dict(), None
    raise ExportError(
        f"--checkpoint {path}: neither a training checkpoint (step-N with train_state.json), "
        "a checkpoint root, nor an exported SGLang directory (config.json + model.safetensors)"
    )


def _as_draft(
    draft_or_state_dict: DSparkDraft | dict[str, torch.Tensor], cfg: DSparkConfig | None
) -> DSparkDraft:
    """The draft itself, or one built on the given weights (names and shapes checked)."""
    if isinstance(draft_or_state_dict, DSparkDraft):
        draft = draft_or_state_dict
        if cfg is not None and cfg != draft.config:
            raise ExportError("the config given differs from the draft's own config")
        with torch.device("meta"):
            want = {k: v.shape for k, v in DSparkDraft(draft.config).state_dict().items()}
        bad = [k for k, v in draft.state_dict().items() if v.shape != want[k]]
        if bad:  # e.g. a ZeRO-3 engine's module: its parameters live in the shards
            raise ExportError(
                f"the draft's tensors {bad[:3]} do not have their full shapes (partitioned "
                "by ZeRO-3?); gather them, or export the saved checkpoint instead"
            )
        return draft
    if cfg is None:
        raise ExportError("exporting a state_dict needs its DSparkConfig")
    with torch.device("meta"):
        draft = DSparkDraft(cfg)
    try:
        draft.load_state_dict(draft_or_state_dict, strict=True, assign=True)
    except RuntimeError as e:
        raise ExportError(f"the weights do not fit the draft config: {e}") from None
    return draft
