"""Speculative sampling at temperature T > 0, with SGLang 0.5.23 DSPARK's accept rule.

Legend: B rows (independent sequences), G drafts per block, W draft vocabulary (every
LM-head row), V target vocabulary (logical rows; V <= W), L tokens in one forward.

What SGLang does at T > 0 (default path: `dspark_verify.accept_draft_tokens` ->
`AcceptSampling` -> `chain_speculative_sampling_triton`, classic chain, no top-k/top-p):
- draft (`dspark_draft.draft_markov_block`, sampled unless SGLANG_DSPARK_USE_GREEDY_DRAFT):
  slot by slot, z_k = base_k + markov_bias(prev_k), d_k ~ softmax(z_k / T) (Gumbel-max;
  prev_0 = the bonus token, prev_k = d_{k-1}); q_k = softmax(z_k / T) over all W rows.
- target: p_k = softmax(target_logits_k / T) (logical rows; 0 on padded rows).
- accept d_k, k = 0, 1, ... while u_k * q_k(d_k) < p_k(d_k) (u_k ~ U(0,1), and q_k(d_k)
  must be in (0, 1]); at the first rejection n the next token is drawn from
  max(p_n - q_n, 0) normalised; if all G drafts pass, from p_G (the bonus row).
- verifying only v < G drafts (a ragged verify budget) runs the same chain over v drafts.
The token emitted at each position is then distributed exactly as plain sampling from
the target at T (tests/test_sampling_lossless.py checks it on the tiny target).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specforge_dspark.decoding.hf_target import HFTarget
from specforge_dspark.drafters.dspark import build_visibility_mask


class SamplingTarget(HFTarget):
    """HFTarget that keeps the logits of its last forward (`last_logits_LV`, fp32)."""

    last_logits_LV: torch.Tensor | None = None

    @torch.inference_mode()
    def _forward(self, ids: list[int], cache) -> list[int]:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, past_key_values=cache, use_cache=True)
        self.last_logits_LV = out.logits[0].float()
        return self.last_logits_LV.argmax(-1).tolist()

    @torch.inference_mode()
    def sample(
        self, ids: list[int], max_new_tokens: int, temperature: float, gen: torch.Generator
    ) -> list[int]:
        """Plain sampling at `temperature`, one token per forward (the reference)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        self._forward(ids, cache)
        out = [draw(target_probs(self.last_logits_LV[-1:], temperature), gen)[0]]
        while len(out) < max_new_tokens and out[-1] not in self.eos_ids:
            self._forward(out[-1:], cache)
            out.append(draw(target_probs(self.last_logits_LV[-1:], temperature), gen)[0])
        return out


def target_probs(logits_LV: torch.Tensor, temperature: float, width: int | None = None):
    """softmax(logits / T) in fp32, zero-padded to `width` columns (the draft's rows)."""
    p = torch.softmax(logits_LV.float() / temperature, dim=-1)
    if width is not None and width > p.shape[-1]:
        p = torch.nn.functional.pad(p, (0, width - p.shape[-1]))
    return p


def draw(probs_BW: torch.Tensor, gen: torch.Generator) -> list[int]:
    """One token per row of `probs_BW`, drawn with `gen`."""
    return torch.multinomial(probs_BW, 1, generator=gen).reshape(-1).tolist()


@torch.no_grad()
def sample_block(
    drafter,
    ctx_BSH: torch.Tensor,
    ctx_len_B: torch.Tensor,
    bonus_B: torch.Tensor,
    embed_fn: Callable,
    logits_fn: Callable,
    temperature: float,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sampled drafts of one block per row (SGLang `draft_markov_block` at T > 0).

    ctx_BSH: context features (rows may be right-padded; row b uses its first
    ctx_len_B[b]); bonus_B: the anchor token of each row, at position ctx_len_B[b].
    Returns (drafts [B, G], q [B, G, W] = softmax(z / T), confidence logits [B, G] or None).
    A drafter may bring its own `sample_block(ctx, ctx_len, bonus, temperature, gen)`.
    """
    if hasattr(drafter, "sample_block"):
        return drafter.sample_block(ctx_BSH, ctx_len_B, bonus_B, temperature, gen)
    cfg = drafter.config
    G, device = cfg.block_size, ctx_BSH.device
    B, S = ctx_BSH.shape[:2]
    ids_BG = torch.full((B, G), cfg.mask_token_id, device=device)
    ids_BG[:, 0] = bonus_B
    ctx_valid_BS = torch.arange(S, device=device)[None] < ctx_len_B[:, None]
    anchors_B1 = ctx_len_B[:, None]
    visible = build_visibility_mask(
        anchors_B1, torch.ones(B, 1, dtype=torch.bool, device=device), ctx_valid_BS, G
    )
    h_BGH = drafter(
        ctx_BSH,
        torch.arange(S, device=device)[None].expand(B, S),
        embed_fn(ids_BG)[:, None],
        (anchors_B1 + torch.arange(G, device=device))[:, None],
        visible,
    )[:, 0]
    base_BGW = logits_fn(h_BGH).float()
    head = drafter.markov_head
    prev_B, state = bonus_B, head.init_state(h_BGH[:, 0])
    drafts, probs = [], []
    for k in range(G):
        z_BR, state = head.step(head.markov_w1(prev_B), h_BGH[:, k], state)
        q_BW = torch.softmax(
            (base_BGW[:, k] + head.bias(z_BR, base_BGW.shape[-1])) / temperature, -1
        )
        prev_B = torch.multinomial(q_BW, 1, generator=gen)[:, 0]
        drafts.append(prev_B)
        probs.append(q_BW)
    drafts_BG = torch.stack(drafts, 1)
    if drafter.confidence_head is None:
        return drafts_BG, torch.stack(probs, 1), None
    prev_BG = torch.cat((bonus_B[:, None], drafts_BG[:, :-1]), 1)
    return drafts_BG, torch.stack(probs, 1), drafter.confidence_head(h_BGH, head.markov_w1(prev_BG))


def chain_accept(
    drafts_BG: torch.Tensor,
    q_BGW: torch.Tensor,
    p_BG1W: torch.Tensor,
    gen: torch.Generator,
    accept_bias: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's classic chain rejection sampling (`speculative_sampling_classic_kernel`).

    p_BG1W: target probabilities of the G+1 verified positions (row k judges draft k; row
    G is the bonus row). Returns (accepted drafts n [B] in 0..G, next token [B]): the
    token at position n, from the residual max(p_n - q_n, 0) after a rejection or from
    p_G when every draft passed. `accept_bias` > 0 is a deliberately wrong rule (accept
    when u*q < p + accept_bias*q), only for showing a test's power.
    """
    B, G = drafts_BG.shape
    u_BG = torch.rand(B, G, generator=gen, device=drafts_BG.device)
    u_final_B = torch.rand(B, generator=gen, device=drafts_BG.device)
    q_BG = q_BGW.gather(-1, drafts_BG[..., None])[..., 0]
    p_BG = p_BG1W[:, :G].gather(-1, drafts_BG[..., None])[..., 0]
    ok_BG = (q_BG > 0) & (q_BG <= 1) & (u_BG * q_BG < p_BG + accept_bias * q_BG)
    n_B = ok_BG.int().cumprod(-1).sum(-1)  # the first rejection stops the chain
    rows = torch.arange(B, device=drafts_BG.device)
    p_BW = p_BG1W[rows, n_B]
    q_pad = torch.nn.functional.pad(q_BGW, (0, 0, 0, 1))  # row G: no draft, residual = p
    q_BW = q_pad[rows, n_B]
    q_BW = torch.where((q_BW >= 0) & (q_BW <= 1), q_BW, torch.zeros_like(q_BW))
    residual_BW = (p_BW - q_BW).clamp_min(0.0)
    # inverse-CDF draw with one uniform, as the kernel does (falls back to the last row
    # when the residual is all zero, numerically near-impossible)
    cdf_BW = residual_BW.double().cumsum(-1)
    target_B = u_final_B.double() * cdf_BW[:, -1]
    next_B = (cdf_BW <= target_B[:, None]).sum(-1).clamp_max(residual_BW.shape[-1] - 1)
    return n_B, next_B
