"""Lockstep speculative sampling of many continuations of one prompt, for the
distribution test (test_sampling_lossless.py): the harness's draft sampler and accept
rule (specforge_dspark/decoding/sampling.py), batched without a KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specforge_dspark.decoding.hf_target import HFTarget
from specforge_dspark.decoding.sampling import chain_accept, sample_block, target_probs


@torch.inference_mode()
def batched_forward(target: HFTarget, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [R, L, V] and aux features [R, L, D] of right-padded rows (a causal model's
    real positions never see the padding after them). The rows' common prefix runs once
    and its KV cache is repeated for the rest (a cache that can't be repeated: no sharing)."""
    from transformers import DynamicCache

    lcp = len(rows[0]) - 1
    for r in rows[1:]:
        lcp = min(
            lcp,
            len(r) - 1,
            next((i for i, (a, b) in enumerate(zip(r, rows[0], strict=False)) if a != b), lcp),
        )
    cache = DynamicCache(config=target.model.config) if lcp > 0 else None
    parts_logits, parts_aux = [], []
    if cache is not None and hasattr(cache, "batch_repeat_interleave"):
        with target.tap:
            out = target.model(input_ids=torch.tensor([rows[0][:lcp]]), past_key_values=cache)
        parts_logits.append(out.logits.float().expand(len(rows), -1, -1))
        parts_aux.append(torch.cat(target.tap.taps(), dim=-1).expand(len(rows), -1, -1))
        cache.batch_repeat_interleave(len(rows))
        rows = [r[lcp:] for r in rows]
    else:
        cache = None
    L = max(len(r) for r in rows)
    x = torch.zeros(len(rows), L, dtype=torch.long, device=target.device)
    for i, r in enumerate(rows):
        x[i, : len(r)] = torch.tensor(r)
    with target.tap:
        out = target.model(input_ids=x, past_key_values=cache, use_cache=cache is not None)
    parts_logits.append(out.logits.float())
    parts_aux.append(torch.cat(target.tap.taps(), dim=-1))
    return torch.cat(parts_logits, 1), torch.cat(parts_aux, 1)


def draft_context(target: HFTarget, drafter, rows: list[list[int]]) -> torch.Tensor:
    """Draft context features [R, S, H] of right-padded rows; identical rows (all of them
    in the first rounds of one prompt) go through the target once."""
    uniq = sorted(set(map(tuple, rows)))
    _, aux = batched_forward(target, [list(r) for r in uniq])
    index = torch.tensor([uniq.index(tuple(r)) for r in rows])
    return drafter.context(aux)[index]


@torch.inference_mode()
def sample_continuations(
    target: HFTarget,
    drafter,
    prompt_ids: list[int],
    num_samples: int,
    length: int,
    temperature: float,
    embed_fn: Callable,
    logits_fn: Callable,
    gen: torch.Generator,
    speculative: bool = True,
    accept_bias: float = 0.0,
    chunk: int = 1024,
    first_token: int | None = None,
) -> torch.Tensor:
    """`num_samples` continuations [num_samples, length] of one prompt, decoded in lockstep
    batches without a KV cache: the same draft sampler (`sample_block`) and accept rule
    (`chain_accept`) as the harness loop, each row an independent speculative decoding
    (`speculative=False`: plain sampling). For distribution tests of short continuations;
    end-of-turn is not special here. `first_token`: every row starts from it (the bonus
    of the first speculative step) instead of a plain sample; it counts in `length`."""
    out = []
    for start in range(0, num_samples, chunk):
        B = min(chunk, num_samples - start)
        if first_token is not None:
            seqs = [[first_token] for _ in range(B)]
        else:
            logits, _ = batched_forward(target, [prompt_ids])
            p0 = target_probs(logits[0, -1:], temperature).expand(B, -1)
            seqs = [[t] for t in torch.multinomial(p0, 1, generator=gen)[:, 0].tolist()]
        while True:
            active = [i for i in range(B) if len(seqs[i]) < length]
            if not active:
                break
            if not speculative:
                logits, _ = batched_forward(target, [prompt_ids + seqs[i] for i in active])
                lens = [len(prompt_ids) + len(seqs[i]) - 1 for i in active]
                p = target_probs(logits[torch.arange(len(active)), lens], temperature)
                for i, t in zip(
                    active, torch.multinomial(p, 1, generator=gen)[:, 0].tolist(), strict=True
                ):
                    seqs[i].append(t)
                continue
            # context: every committed token but the bonus has its hidden state
            ctx = draft_context(target, drafter, [prompt_ids + seqs[i][:-1] for i in active])
            ctx_len = torch.tensor([len(prompt_ids) + len(seqs[i]) - 1 for i in active])
            bonus = torch.tensor([seqs[i][-1] for i in active])
            d_RG, q_RGW, _ = sample_block(
                drafter, ctx, ctx_len, bonus, embed_fn, logits_fn, temperature, gen
            )
            G = d_RG.shape[1]
            logits, _ = batched_forward(
                target, [prompt_ids + seqs[i] + d_RG[j].tolist() for j, i in enumerate(active)]
            )
            pos_RG1 = ctx_len[:, None] + torch.arange(G + 1)  # row k judges draft k
            rows = torch.arange(len(active))[:, None]
            p_RG1W = target_probs(logits[rows, pos_RG1], temperature, q_RGW.shape[-1])
            n_R, next_R = chain_accept(d_RG, q_RGW, p_RG1W, gen, accept_bias)
            for j, i in enumerate(active):
                n = int(n_R[j])
                seqs[i].extend([*d_RG[j, :n].tolist(), int(next_R[j])])
        out.append(torch.tensor([s[:length] for s in seqs]))
    return torch.cat(out)
