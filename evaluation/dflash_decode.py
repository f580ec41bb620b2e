"""Greedy speculative decoding with a DFlash drafter, as SGLang 0.5.23's DFLASH serves it.

Legend: G block size, S committed tokens with hidden states (= ctx_len).

One verify step, with the bonus token b at position S (not yet in the target's cache):
  drafter: block [b, MASK*(G-1)] at positions S..S+G-1 over context < S -> drafts from
           rows 1..G-1: d_1..d_{G-1}, d_i the guess for position S+i (argmax over every
           LM-head row; `dflash.DFlashDraft.propose`, `dflash_worker_v2.py`)
  target:  forward [b, d_1..d_{G-1}] (G tokens) -> greedy t_0..t_{G-1}, t_j the token at S+j+1
  accept:  n = longest prefix with d_{j+1} == t_j (0 <= n <= G-1); commit t_0..t_n, keep
           b, d_1..d_n in the cache and their aux features as new context.
DSpark (decoding/spec_decode.py) drafts G tokens from all G rows and verifies G+1; here
a block of the same G yields G-1 drafts. Accounting is spec_decode's (`Step`,
`Generation`; accept length = sum(committed) / steps, SGLang's completion_tokens /
spec_verify_ct without the prefill's token), and the output equals plain greedy exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from specforge_dspark.decoding.hf_target import HFTarget
from specforge_dspark.decoding.spec_decode import Generation, Step, _cut


@torch.inference_mode()
def dflash_generate(
    target: HFTarget,
    drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    embed_fn: Callable,
    logits_fn: Callable,
) -> Generation:
    """Greedy DFlash speculative decoding of one prompt (module docstring); `drafter` is a
    `DFlashDraft` (`.context`, `.propose`, `.config.block_size`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    D = int(drafter.config.block_size) - 1  # drafts per step

    def context(aux_SD: torch.Tensor) -> torch.Tensor:
        return drafter.context(aux_SD[None])  # [1, S, H]

    t0 = time.perf_counter()
    pre = target.prefill(prompt_ids)
    ctx_1SH, ctx_len = context(pre.aux_SD), len(prompt_ids)
    bonus = pre.next_tokens[-1]
    out = Generation(prompt_ids=list(prompt_ids), tokens=[bonus])
    done = bonus in target.eos_ids or max_new_tokens == 1
    while not done:
        drafts_D, _ = drafter.propose(ctx_1SH, ctx_len, bonus, embed_fn, logits_fn)
        drafts = [int(t) for t in drafts_D.reshape(-1).tolist()]
        assert len(drafts) == D, f"drafter returned {len(drafts)} tokens, expected G-1 = {D}"
        verify_ids = [bonus, *drafts]
        ver = target.verify(verify_ids)
        t = ver.next_tokens  # [G]
        n = 0
        while n < D and drafts[n] == t[n]:
            n += 1
        step_tokens = t[: n + 1]
        new, done = _cut(step_tokens, target.eos_ids, max_new_tokens - len(out.tokens))
        out.steps.append(Step(accepted=n, committed=len(new), confidence=[], drafts=drafts))
        out.tokens.extend(new)
        if done:
            break
        fresh = target.commit(verify_ids, n + 1)
        kept_aux = ver.aux_SD[: n + 1] if fresh is None else fresh
        ctx_1SH = torch.cat([ctx_1SH, context(kept_aux)], dim=1)
        ctx_len += n + 1
        assert target.cache_length() == ctx_len, "the cache must hold exactly the context"
        bonus = step_tokens[n]
    out.seconds = time.perf_counter() - t0
    return out


def generate_fn(drafter) -> Callable:
    """The decoding loop of a drafter's kind: `dflash_generate` for a DFlash drafter,
    `spec_decode.speculative_generate` (greedy) for a DSpark one."""
    from specforge_dspark.drafters.dflash import DFlashDraft

    if isinstance(drafter, DFlashDraft):
        return dflash_generate
    from specforge_dspark.decoding.spec_decode import speculative_generate

    return speculative_generate


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
    from evaluation.acceptance import check_lossless
    from specforge_dspark.drafters.registry import load_draft
    from specforge_dspark.frozen_head import load_frozen_head

    drafter = load_draft(draft) if isinstance(draft, (str, Path)) else draft
    drafter = drafter.float().eval()
    target = HFTarget.load(target_path, drafter.config.target_layer_ids)
    head = head or load_frozen_head(target_path)
    generate = generate_fn(drafter)
    rows = []
    for i, ids in enumerate(prompts):
        ref = target.greedy(ids, max_new_tokens)
        gen = generate(target, drafter, ids, max_new_tokens, head.embed, head.logits)
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
