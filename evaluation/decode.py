"""Lossless greedy speculative decoding of token-id prompts by a drafter of either kind
(DSpark or DFlash), each output checked against plain greedy: the per-prompt counts the
DSpark/DFlash side-by-side (scripts/side_by_side.py) and the DFlash training test read."""

from __future__ import annotations

import torch

from specforge_dspark.decoding.hf_target import HFTarget
from specforge_dspark.decoding.loading import load_drafter
from specforge_dspark.decoding.spec_decode import check_lossless, speculative_generate


def decode_prompts(
    target_path: str,
    draft,
    prompts: list[list[int]],
    max_new_tokens: int,
    head=None,
) -> list[dict]:
    """Speculative decoding of every prompt (token ids) with `draft` (an exported SGLang
    directory of either kind, or a drafter), each checked against plain greedy; returns
    per prompt {committed, steps, accepted_hist} (accepted_hist[n]: steps accepting n)."""
    from specforge_dspark.objective.frozen_head import load_frozen_head

    drafter = load_drafter(draft, "cpu", torch.float32)
    target = HFTarget.load(target_path, drafter.config.target_layer_ids)
    head = head or load_frozen_head(target_path)
    rows = []
    for i, ids in enumerate(prompts):
        ref = target.greedy(ids, max_new_tokens)
        gen = speculative_generate(target, drafter, ids, max_new_tokens, head.embed, head.logits)
        check_lossless(gen.tokens, ref, f"prompt {i}")
        hist = [0] * (int(drafter.config.block_size) + 1)
        for s in gen.steps:
            hist[s.accepted] += 1
        rows.append(
            {
                "committed": sum(s.committed for s in gen.steps),
                "steps": len(gen.steps),
                "accepted_hist": hist,
            }
        )
    return rows
