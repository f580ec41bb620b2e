"""A drafter and the frozen head as the decoding loop takes them, checked against the
target they will run with (shared by acceptance, calibration and the serve check)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from specforge_dspark.decoding.hf_target import HFTarget
from specforge_dspark.decoding.spec_decode import Drafter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


NO_SELECTOR = "no-selector:"


def load_drafter(draft: str | Path | Drafter, device: str, dtype: torch.dtype) -> Drafter:
    """An exported SGLang-layout directory (config.json + model.safetensors; DSpark or
    DFlash), `ngram:G` (the training-free prompt-lookup drafter of block size G,
    decoding/ngram.py), `no-selector:DIR` (a DFlash2 export drafting its backbone's
    argmax, the selector off) or a drafter; a module is moved to `device` and `dtype`, in eval
    mode."""
    if isinstance(draft, str) and draft.startswith("ngram:"):
        from specforge_dspark.decoding.ngram import NgramDrafter

        return NgramDrafter(int(draft.removeprefix("ngram:")))
    if isinstance(draft, str) and draft.startswith(NO_SELECTOR):
        drafter = load_drafter(draft.removeprefix(NO_SELECTOR), device, dtype)
        if not hasattr(drafter, "use_selector"):
            raise ValueError(f"--draft {draft}: not a DFlash2 export (it has no selector)")
        drafter.use_selector = False
        return drafter
    if isinstance(draft, (str, Path)):
        from specforge_dspark.drafters.registry import load_draft

        draft = load_draft(Path(draft))
    if isinstance(draft, torch.nn.Module):
        draft = draft.to(device=device, dtype=dtype).eval()
    return draft


def check_pair(drafter: Drafter, target: HFTarget) -> None:
    """A drafter trained for another target reads the wrong features: refuse it."""
    tcfg = target.model.config
    for field, want in (
        ("hidden_size", tcfg.hidden_size),
        ("num_target_layers", tcfg.num_hidden_layers),
    ):
        got = getattr(drafter.config, field, None)
        if got is not None and got != want:
            raise ValueError(f"--draft: config {field}={got}, but the target has {want}")


def head_fns(head) -> tuple[Callable, Callable]:
    """(embed_fn, logits_fn) of a frozen head. The draft's logits are NOT cropped to the
    logical vocabulary: SGLang 0.5.23's DSpark draft takes its argmax over every LM-head
    row (`models/dspark.py` crops only to `lm_head.org_vocab_size`, the padded row count
    for Inkling), so a padded row can be drafted (and is always rejected) when served. The
    target's greedy choice stays over its logical rows (see hf_target.py)."""
    return head.embed, head.logits
