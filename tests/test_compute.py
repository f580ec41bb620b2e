"""The served-step draft cost (evaluation/compute.py): with the context's keys and values
cached, a step's projections do not grow with the context, only its attention does, and
the attention counted by hand equals what torch's FLOP counter sees when the same shapes
go through explicit matmuls; a sliding window caps it."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from evaluation.compute import attention_flops, served_step_cost
from tests.test_dflash import draft_and_head

pytestmark = pytest.mark.usefixtures("one_thread")


def _cost(draft, head, ctx_len: int, committed: float = 2.0) -> dict:
    return served_step_cost(draft.float(), head.embed, head.logits, ctx_len, committed, repeats=1)


FULL = {"layer_types": ["full_attention"] * 2}


def test_attention_by_hand_equals_the_counted_matmuls():
    draft, _ = draft_and_head(**FULL)
    cfg = draft.config
    G, A, E, S = cfg.block_size, cfg.num_attention_heads, cfg.head_dim, 40
    q, k = torch.randn(1, A, G, E), torch.randn(1, A, S + G, E)
    with FlopCounterMode(display=False) as counter:
        for _ in cfg.layer_types:
            p = (q @ k.transpose(-1, -2)).softmax(-1)
            p @ k
    assert attention_flops(cfg, S) == counter.get_total_flops()


def test_a_served_step_grows_with_the_context_by_its_attention_only():
    draft, head = draft_and_head(**FULL)
    short, long = (_cost(draft, head, n) for n in (24, 96))
    grew = long["flops_per_step"] - short["flops_per_step"]
    assert grew == long["attention_flops"] - short["attention_flops"] > 0
    assert short["draft_ms_per_step"] > 0 and short["num_drafts"] == draft.config.block_size - 1
    more = _cost(draft, head, 24, committed=3.0)  # one more committed row: its K/V and fc
    assert more["flops_per_step"] > short["flops_per_step"]


def test_a_sliding_window_caps_the_attention():
    window = 16
    draft, head = draft_and_head(layer_types=["sliding_attention"] * 2, sliding_window=window)
    a, b = (_cost(draft, head, n) for n in (40, 80))  # both contexts past the window
    assert a["flops_per_step"] == b["flops_per_step"]
    G, A, E = draft.config.block_size, draft.config.num_attention_heads, draft.config.head_dim
    assert a["attention_flops"] == 2 * 4 * G * (window + G) * A * E
