"""Greedy speculative decoding, one loop for DSpark and DFlash drafters (DSPARK_SPEC.md
section 4; SGLang 0.5.23's DSPARK and DFLASH workers).

Legend: G block size, D drafts per step (`drafter.num_drafts`), S committed tokens with
hidden states (= ctx_len), H hidden size.

One verify step, with the bonus token b at position S (not yet in the target's cache):
  drafter: block [b, MASK*(G-1)] at positions S..S+G-1 over context < S -> D drafts
           d_0..d_{D-1}, d_k the guess for position S+k+1 (argmax over ALL LM-head rows,
           as SGLang's drafts take it, so a padded row the target never emits can be
           drafted). DSpark drafts from every row (D = G); DFlash drafts from rows
           1..G-1 (D = G-1, `DFlashDraft.propose`, `dflash_worker_v2.py`).
  target:  forward [b, d_0..d_{D-1}] -> greedy t_0..t_D (t_k is the token at S+k+1)
  accept:  n = longest prefix with d_k == t_k; commit t_0..t_n (n drafts + 1 new token),
           keep b, d_0..d_{n-1} in the cache and their aux features as new context.

Accounting (exact, used by the tests): the prefill emits the first token and is not a
verify step. A step's `committed` count is what it appended to the output, cut at the
first end-of-turn token and at `max_new_tokens`; `accepted` is the verifier's n before
any cut. Accept length = sum(committed) / steps (SGLang's completion_tokens /
spec_verify_ct without the prefill's token), so len(output) = 1 + sum(committed); every
step but the last commits exactly accepted + 1. The greedy output equals plain greedy
exactly (`check_lossless`).

Temperature T > 0 (`temperature=`, with a `SamplingTarget`, DSpark only): the drafter
samples its block and the verifier runs SGLang DSPARK's chain rejection rule
(decoding/sampling.py); n is the accepted drafts and the new token comes from the rule. A
verify budget (`budget=`, evaluation/budget.py) verifies only the first v <= D drafts of
a step (the target runs on [b, d_0..d_{v-1}]); `Step.verified` records v (None without a
budget).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specforge_dspark.decoding.hf_target import HFTarget


class Drafter(Protocol):
    """What the loop needs of a drafter (DSparkDraft and DFlashDraft have it)."""

    config: object  # .block_size, .target_layer_ids
    num_drafts: int  # drafts per block: block_size (DSpark) or block_size - 1 (DFlash)

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
    accepted: int  # drafts the verifier accepted, 0..D
    committed: int  # tokens appended to the output, 1..accepted+1
    confidence: list[float]  # sigmoid of the D confidence logits ([] without a head)
    drafts: list[int] = field(default_factory=list)  # the D drafted token ids
    confidence_logits: list[float] = field(default_factory=list)  # raw head outputs
    verified: int | None = None  # drafts sent to the verifier (None: all D)


@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[int]
    steps: list[Step] = field(default_factory=list)
    seconds: float = 0.0


class LosslessError(RuntimeError):
    """Speculative output differs from plain target greedy decoding."""


def check_lossless(spec: list[int], ref: list[int], where: str) -> None:
    """Raise `LosslessError` (naming `where` and the first differing token) unless the
    speculative output `spec` equals the plain greedy output `ref`."""
    if spec == ref:
        return
    i = next(
        (j for j, (a, b) in enumerate(zip(spec, ref, strict=False)) if a != b),
        min(len(spec), len(ref)),
    )
    got = spec[i] if i < len(spec) else "<end>"
    want = ref[i] if i < len(ref) else "<end>"
    raise LosslessError(
        f"{where}: speculative output differs from plain greedy at new token {i} "
        f"(speculative {got}, greedy {want}; lengths {len(spec)} vs {len(ref)})"
    )


def cut_new_tokens(new: list[int], eos_ids: set[int], budget: int) -> tuple[list[int], bool]:
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
    """Speculative decoding of one prompt by a DSpark or DFlash drafter (module
    docstring). Greedy (temperature 0): the output equals plain greedy. T > 0 (DSpark):
    SGLang's DSPARK speculative sampling, lossless in distribution (`target` must keep its
    logits: decoding.sampling.SamplingTarget; `generator` seeds every draw). `budget` (a
    VerifyBudget) picks how many drafts each step verifies."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    D = int(drafter.num_drafts)
    sampling = temperature > 0
    if sampling:
        from specforge_dspark.decoding import sampling as smp

        if D != int(drafter.config.block_size):
            raise ValueError("temperature > 0: speculative sampling needs a DSpark drafter")
        gen = generator if generator is not None else torch.Generator().manual_seed(0)
    if budget is not None:
        budget.reset()

    def context(aux_SD: torch.Tensor) -> torch.Tensor:
        return drafter.context(aux_SD[None])  # [1, S, H]: per position, so it extends

    if hasattr(drafter, "begin"):  # drafters that keep token history (decoding/ngram.py)
        drafter.begin(list(prompt_ids))
    t0 = time.perf_counter()
    pre = target.prefill(prompt_ids)
    ctx_1SH = context(pre.aux_SD)
    ctx_len = len(prompt_ids)
    if sampling:
        bonus = smp.draw(smp.target_probs(target.last_logits_LV[-1:], temperature), gen)[0]
    else:
        bonus = pre.next_tokens[-1]
    gen_out = Generation(prompt_ids=list(prompt_ids), tokens=[bonus])
    done = bonus in target.eos_ids or max_new_tokens == 1
    while not done:
        if sampling:
            d_1G, q_1GW, conf_D = smp.sample_block(
                drafter,
                ctx_1SH,
                torch.tensor([ctx_len], device=ctx_1SH.device),
                torch.tensor([bonus], device=ctx_1SH.device),
                embed_fn,
                logits_fn,
                temperature,
                gen,
            )
            drafts_D = d_1G[0]
        else:
            drafts_D, conf_D = drafter.propose(ctx_1SH, ctx_len, bonus, embed_fn, logits_fn)
        drafts = [int(t) for t in drafts_D.reshape(-1).tolist()]
        assert len(drafts) == D, f"drafter returned {len(drafts)} tokens, num_drafts {D}"
        raw = [] if conf_D is None else conf_D.float().reshape(-1).tolist()
        v = D if budget is None else budget.drafts_to_verify(raw)
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
        new, done = cut_new_tokens(
            step_tokens, target.eos_ids, max_new_tokens - len(gen_out.tokens)
        )
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
