"""Speculative sampling at temperature 1 is lossless in distribution on a tiny target.

Continuations of one fixed context (prompt + bonus token x1) from the harness's draft
sampler and SGLang's chain accept rule (specforge_dspark/decoding/sampling.py) are compared with the
target's exact distribution of (x2, x3) = p(x2) p(x3 | x2) by a chi-square goodness-of-fit
test. x2 comes from the first verify step (draft 0 accepted, or the residual); x3 from
draft 1, the bonus row, or a second step after a rejection. Power: the same test, same
number of samples, rejects the rule biased to accept 2 points more often (u*q < p + 0.02 q).
"""

from __future__ import annotations

import pytest
import torch

from specforge_dspark.decoding.loading import head_fns
from specforge_dspark.decoding.sampling import SamplingTarget, target_probs
from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft
from specforge_dspark.objective.frozen_head import load_frozen_head
from tests.sampling_lockstep import sample_continuations

pytestmark = pytest.mark.usefixtures("one_thread")

N = 6000
T = 1.0
LAYERS = [0, 2]
ALPHA = 1e-3


@pytest.fixture(scope="module")
def setup(tiny_qwen3_dir, one_thread):
    target = SamplingTarget.load(tiny_qwen3_dir, LAYERS)
    cfg = target.model.config
    torch.manual_seed(0)
    draft = DSparkDraft(
        DSparkConfig(
            hidden_size=cfg.hidden_size,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            vocab_size=cfg.vocab_size,
            block_size=2,
            target_layer_ids=LAYERS,
            num_target_layers=cfg.num_hidden_layers,
            mask_token_id=target.tokenizer.mask_token_id,
            markov_rank=16,
        )
    ).eval()
    head = load_frozen_head(tiny_qwen3_dir)
    ids = target.tokenizer("He has 3 + 5 =")["input_ids"]
    return target, draft, head_fns(head), ids[:-1], ids[-1]


def _exact_pairs(target, prompt: list[int], x1: int) -> torch.Tensor:
    """P(x2, x3 | prompt, x1) [V, V] from the target itself (plain sampling's law)."""
    with torch.inference_mode():
        base = target.model(input_ids=torch.tensor([prompt + [x1]])).logits[0, -1]
        p2 = target_probs(base[None], T)[0]
        V = p2.shape[0]
        rows = torch.tensor([prompt + [x1, v] for v in range(V)])
        p3 = torch.cat(
            [target_probs(target.model(input_ids=r).logits[:, -1], T) for r in rows.split(512)]
        )
    return p2[:, None] * p3


def chi_square(samples_N2: torch.Tensor, P_VV: torch.Tensor) -> tuple[float, int]:
    """Chi-square GoF of (x2, x3) samples: pairs with expected count >= 5 are categories,
    the rest pooled per x2 when that pool expects >= 5, the remainder one category.
    Categories depend only on the exact law. Returns (p-value, categories)."""
    V = P_VV.shape[0]
    E = P_VV.double() * samples_N2.shape[0]
    cat = torch.full((V, V), -1, dtype=torch.long)
    big = E >= 5
    cat[big] = torch.arange(int(big.sum()))
    nxt = int(big.sum())
    rest = torch.where(big, 0.0, E).sum(1)
    for v in torch.nonzero(rest >= 5).reshape(-1).tolist():
        cat[v][~big[v]] = nxt
        nxt += 1
    cat[cat < 0] = nxt
    K = nxt + 1
    expected = torch.zeros(K, dtype=torch.float64).index_add_(0, cat.reshape(-1), E.reshape(-1))
    flat = cat[samples_N2[:, 0], samples_N2[:, 1]]
    observed = torch.bincount(flat, minlength=K).double()
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a sample the target gives probability 0"
    stat = (((observed - expected) ** 2) / expected)[keep].sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2)), df + 1


def _sample(setup, accept_bias: float, seed: int) -> torch.Tensor:
    target, draft, (embed_fn, logits_fn), prompt, x1 = setup
    out = sample_continuations(
        target, draft, prompt, N, 3, T, embed_fn, logits_fn,
        torch.Generator().manual_seed(seed), accept_bias=accept_bias, chunk=4000, first_token=x1,
    )  # fmt: skip
    assert (out[:, 0] == x1).all()
    return out[:, 1:]


def test_speculative_sampling_at_temperature_1_matches_plain_sampling(setup):
    target, draft, _, prompt, x1 = setup
    P = _exact_pairs(target, prompt, x1)
    p_value, categories = chi_square(_sample(setup, 0.0, seed=1), P)
    assert categories > 30, "too few categories to see a bias"
    print(f"p={p_value:.3g} categories={categories}")
    assert p_value > ALPHA, f"speculative sampling differs from plain sampling (p={p_value:.2e})"
    biased_p, _ = chi_square(_sample(setup, 0.02, seed=1), P)
    print(f"biased p={biased_p:.3g}")
    assert biased_p < ALPHA, f"the test misses a 2% acceptance bias (p={biased_p:.2e})"
