"""Draft compute of one served verify step, as an engine runs it: the context's keys and
values are cached, so a step computes them (and the fc projection of the aux hidden
states) only for the tokens it commits, and attends over the whole context.

`served_step_cost` counts the matmul-class FLOPs of the drafter's `propose` (the block
forward, the LM head on its drafting rows, the Markov head, the confidence head, DFlash2's
selector) with torch's FLOP counter, then
- removes the context rows' key/value projections `propose` recomputes (our harness has
  no KV cache) but a served step does not: (ctx_len - committed) x one row's, counted;
- adds the fc projection of the `committed` new rows, counted;
- adds attention by hand, which the counter does not see in torch's CPU SDPA kernel:
  per layer 4 x G x keys x heads x head_dim (QK^T and PV), keys = the context (capped at
  the sliding window for sliding layers) plus the block's G rows.
It also times the same pieces on this CPU (median of `repeats`), composed the same way.
The n-gram drafter costs no FLOPs.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from specforge_dspark.decoding.loading import head_fns, load_drafter
from specforge_dspark.drafters.layers import context_kv
from specforge_dspark.objective.frozen_head import load_frozen_head


def attention_flops(cfg, ctx_len: int) -> int:
    """QK^T and PV of one block's G query rows over its keys, every layer."""
    G, A, E = cfg.block_size, cfg.num_attention_heads, cfg.head_dim
    window = getattr(cfg, "sliding_window", None)
    total = 0
    for kind in cfg.layer_types:
        ctx_keys = min(ctx_len, window) if kind == "sliding_attention" and window else ctx_len
        total += 4 * G * (ctx_keys + G) * A * E
    return total


def _measure(fn, repeats: int) -> tuple[int, float]:
    """(FLOPs counted, median seconds) of `fn()`."""
    with FlopCounterMode(display=False) as counter:
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return counter.get_total_flops(), statistics.median(times) if times else 0.0


@torch.inference_mode()
def served_step_cost(
    drafter, embed_fn, logits_fn, ctx_len: int, committed: float, repeats: int = 5
) -> dict:
    """{"flops_per_step", "flops_per_drafted_token", "attention_flops", "num_drafts",
    "draft_ms_per_step"} of `drafter` at a context of `ctx_len` tokens, `committed` tokens
    entering it per step (the measured accept length)."""
    cfg = drafter.config
    g = torch.Generator().manual_seed(0)
    aux_1SD = torch.randn(1, ctx_len, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    ctx_1SH = drafter.context(aux_1SD)
    positions = torch.arange(ctx_len)[None]
    propose, t_propose = _measure(
        lambda: drafter.propose(ctx_1SH, ctx_len, 11, embed_fn, logits_fn), repeats
    )
    kv_all, t_kv_all = _measure(lambda: context_kv(drafter, ctx_1SH, positions), repeats)
    kv_row, t_kv_row = _measure(
        lambda: context_kv(drafter, ctx_1SH[:, :1], positions[:, :1]), repeats
    )
    fc_row, t_fc_row = _measure(lambda: drafter.context(aux_1SD[:, :1]), repeats)
    attention = attention_flops(cfg, ctx_len)
    flops = propose - kv_all + committed * (kv_row + fc_row) + attention
    seconds = t_propose - t_kv_all + committed * (t_kv_row + t_fc_row)
    return {
        "flops_per_step": flops,
        "flops_per_drafted_token": flops / drafter.num_drafts,
        "attention_flops": attention,
        "num_drafts": drafter.num_drafts,
        "draft_ms_per_step": round(1000 * seconds, 3),
    }


def step_flops(draft_dir: str | Path, target_path: str | Path, ctx_len: int, committed: float):
    """`served_step_cost` of the export in `draft_dir` with the target's frozen head."""
    drafter = load_drafter(str(draft_dir), "cpu", torch.float32)
    head = load_frozen_head(str(target_path), device=torch.device("cpu"), dtype=torch.float32)
    return served_step_cost(drafter, *head_fns(head), ctx_len, committed)
