"""Greedy speculative decoding with a DSpark drafter (DSPARK_SPEC.md section 4).

Legend: G block size, S committed tokens with hidden states (= ctx_len), H hidden size.

One verify step, with the bonus token b at position S (not yet in the target's cache):
  drafter: block [b, MASK*(G-1)] at positions S..S+G-1 over context < S -> drafts d_0..d_{G-1}
           (slot k drafts position S+k+1; argmax over ALL LM-head rows, as SGLang's DSpark
           draft takes it, so a padded row the target never emits can be drafted)
  target:  forward [b, d_0..d_{G-1}] -> greedy t_0..t_G (t_k is the token at S+k+1)
  accept:  n = longest prefix with d_k == t_k; commit t_0..t_n (n drafts + 1 new token),
           keep b, d_0..d_{n-1} in the cache and their aux features as new context.

Accounting (exact, used by the tests): the prefill emits the first token and is not a
verify step. A step's `committed` count is what it appended to the output, cut at the
first end-of-turn token and at `max_new_tokens`; `accepted` is the verifier's n before
any cut. Accept length = sum(committed) / steps, so len(output) = 1 + sum(committed);
every step but the last commits exactly accepted + 1.

Temperature T > 0 (`temperature=`, with a `SamplingTarget`): the drafter samples its
block and the verifier runs SGLang DSPARK's chain rejection rule (decoding/sampling.py);
n is the accepted drafts and the new token comes from the rule. A verify budget
(`budget=`, evaluation/budget.py) verifies only the first v <= G drafts of a step (the
target runs on [b, d_0..d_{v-1}]); `Step.verified` records v (G without a budget).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specforge_dspark.decoding.hf_target import HFTarget


class Drafter(Protocol):
    """What the loop needs of a drafter (DSparkDraft has it)."""

    config: object  # .block_size, .target_layer_ids

    def context(self, aux_BSD: torch.Tensor) -> torch.Tensor: ...

    def propose(
        self,
        ctx_1SH: torch.Tensor,
        ctx_len: int,
        bonus_token: int,
        embed_fn: Callable,
        logits_fn: Callable,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass
class Step:
    accepted: int  # drafts the verifier accepted, 0..G
    committed: int  # tokens appended to the output, 1..accepted+1
    confidence: list[float]  # sigmoid of the G confidence logits ([] without a head)
    drafts: list[int] = field(default_factory=list)  # the G drafted token ids
    confidence_logits: list[float] = field(default_factory=list)  # raw head outputs
    verified: int | None = None  # drafts sent to the verifier (None: all G)


@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[int]
    steps: list[Step] = field(default_factory=list)
    seconds: float = 0.0


def _cut(new: list[int], eos_ids: set[int], budget: int) -> tuple[list[int], bool]:
    """`new` cut after its first end-of-turn token and to `budget`; True if decoding ends."""
    for i, tok in enumerate(new[:budget]):
        if tok in eos_ids:
            return new[: i + 1], True
    return new[:budget], len(new) >= budget


@torch.inference_mode()
def speculative_generate(
    target: HFTarget,
    drafter: Drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    embed_fn: Callable,
    logits_fn: Callable,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    budget=None,
) -> Generation:
    """Speculative decoding of one prompt. Greedy (temperature 0): the output equals
    plain greedy. T > 0: SGLang's DSPARK speculative sampling, lossless in distribution
    (`target` must keep its logits: specforge_dspark.decoding.sampling.SamplingTarget; `generator`
    seeds every draw). `budget` (a VerifyBudget) picks how many drafts each step verifies."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    G = int(drafter.config.block_size)
    sampling = temperature > 0
    if sampling:
        from specforge_dspark.decoding import sampling as smp

        gen = generator if generator is not None else torch.Generator().manual_seed(0)
    if budget is not None:
        budget.reset()

    def context(aux_SD: torch.Tensor) -> torch.Tensor:
        return drafter.context(aux_SD[None])  # [1, S, H]: per position, so it extends

    if hasattr(
        drafter, "begin"
    ):  # drafters that keep token history (decoding/ngram.py)
        drafter.begin(list(prompt_ids))
    t0 = time.perf_counter()
    pre = target.prefill(prompt_ids)
    ctx_1SH = context(pre.aux_SD)
    ctx_len = len(prompt_ids)
    if sampling:
        bonus = smp._draw(smp.target_probs(target.last_logits_LV[-1:], temperature), gen)[0]
    else:
        bonus = pre.next_tokens[-1]
    gen_out = Generation(prompt_ids=list(prompt_ids), tokens=[bonus])
    done = bonus in target.eos_ids or max_new_tokens == 1
    while not done:
        if sampling:
            d_1G, q_1GW, conf_G = smp.sample_block(
                drafter,
                ctx_1SH,
                torch.tensor([ctx_len], device=ctx_1SH.device),
                torch.tensor([bonus], device=ctx_1SH.device),
                embed_fn,
                logits_fn,
                temperature,
                gen,
            )
            drafts_G = d_1G[0]
        else:
            drafts_G, conf_G = drafter.propose(ctx_1SH, ctx_len, bonus, embed_fn, logits_fn)
        drafts = [int(t) for t in drafts_G.reshape(-1).tolist()]
        assert len(drafts) == G, f"drafter returned {len(drafts)} tokens, block size {G}"
        raw = [] if conf_G is None else conf_G.float().reshape(-1).tolist()
        v = G if budget is None else budget.drafts_to_verify(raw)
        verify_ids = [bonus, *drafts[:v]]
        ver = target.verify(verify_ids)
        t = ver.next_tokens  # [v+1]
        if sampling:
            p_1VW = smp.target_probs(target.last_logits_LV, temperature, q_1GW.shape[-1])
            n_1, next_1 = smp.chain_accept(d_1G[:, :v], q_1GW[:, :v], p_1VW[None], gen)
            n = int(n_1[0])
            step_tokens = [*drafts[:n], int(next_1[0])]
        else:
            n = 0
            while n < v and drafts[n] == t[n]:
                n += 1
            step_tokens = t[: n + 1]
        new, done = _cut(step_tokens, target.eos_ids, max_new_tokens - len(gen_out.tokens))
        conf = torch.sigmoid(torch.tensor(raw)).tolist() if raw else []
        gen_out.steps.append(
            Step(
                accepted=n,
                committed=len(new),
                confidence=conf,
                drafts=drafts,
                confidence_logits=raw,
                verified=None if budget is None else v,
            )
        )
        gen_out.tokens.extend(new)
        if done:
            break
        fresh = target.commit(verify_ids, n + 1)
        kept_aux = ver.aux_SD[: n + 1] if fresh is None else fresh
        ctx_1SH = torch.cat([ctx_1SH, context(kept_aux)], dim=1)
        ctx_len += n + 1
        assert target.cache_length() == ctx_len, "the cache must hold exactly the context"
        bonus = step_tokens[n]
    gen_out.seconds = time.perf_counter() - t0
    return gen_out
