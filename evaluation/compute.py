"""Draft compute of one verify step, counted by torch's FLOP counter, not by formula.

`step_flops` runs an exported drafter's `propose` (the block forward, the LM head on its
drafting rows, and for DFlash2 the candidate selector's walk) over a context of `ctx_len`
tokens under `torch.utils.flop_counter.FlopCounterMode`, plus its `context` projection of
the aux hidden states for the tokens one step commits. Matmul-class ops are what it
counts (mm, bmm, addmm, attention); element-wise work is left out, as in every FLOP count.
The n-gram drafter costs no FLOPs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from specforge_dspark.decoding.loading import head_fns, load_drafter
from specforge_dspark.objective.frozen_head import load_frozen_head


@torch.inference_mode()
def step_flops(draft_dir: str | Path, target_path: str | Path, ctx_len: int, committed: float):
    """{"flops_per_step", "flops_per_drafted_token", "num_drafts"} of the drafter in
    `draft_dir` at a context of `ctx_len` tokens, `committed` tokens entering the context
    per step (the measured accept length)."""
    drafter = load_drafter(str(draft_dir), "cpu", torch.float32)
    head = load_frozen_head(str(target_path), device=torch.device("cpu"), dtype=torch.float32)
    embed_fn, logits_fn = head_fns(head)
    cfg = drafter.config
    g = torch.Generator().manual_seed(0)
    aux_1SD = torch.randn(1, ctx_len, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    ctx_1SH = drafter.context(aux_1SD)
    with FlopCounterMode(display=False) as propose:
        drafter.propose(ctx_1SH, ctx_len, 11, embed_fn, logits_fn)
    with FlopCounterMode(display=False) as context:
        drafter.context(aux_1SD[:, :1])
    per_step = propose.get_total_flops() + committed * context.get_total_flops()
    return {
        "flops_per_step": per_step,
        "flops_per_drafted_token": per_step / drafter.num_drafts,
        "num_drafts": drafter.num_drafts,
    }
