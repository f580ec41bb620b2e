"""Acceptance statistics of verify steps (see spec_decode.py for the accounting).

- accept_length: committed tokens / verify steps.
- per_position[k]: P(draft slot k accepted) = fraction of steps with accepted > k, so
  1 + sum(per_position) = mean(accepted + 1) (equal to accept_length when no final step
  was cut by end-of-turn or max-new-tokens).
- accept_length_hist[c]: number of steps that committed c tokens (c = 1..G+1).
- padded_draft_rate: drafted tokens whose id >= the logical vocabulary / all drafted
  tokens (None when the logical vocabulary is not given or nothing was drafted). The
  draft's argmax runs over every LM-head row, as SGLang serves it; a padded-row draft is
  never accepted, so it cuts its block there.
- calibration: sigmoid(confidence_k) against whether slot k was accepted, over the slots
  the verifier actually judged with a correct prefix (k <= accepted, k < G): the
  conditional acceptance that the confidence head is trained on and that serving
  multiplies into a survival probability. ECE uses equal-width bins; AUROC is the
  Mann-Whitney statistic with ties counted half (None when one class is absent).
- verified_tokens: tokens the target verified (bonus + drafts sent, G + 1 per step
  without a verify budget); tokens_per_verified_token = committed / verified.
- survival calibration (`survival_calibration`): per position k over all steps, the
  predicted survival prod_{i<=k} c_i against "draft k accepted" (accepted > k), the
  quantity SGLang's verify budget ranks; ECE, Brier score and AUROC per position.
"""

from __future__ import annotations

from collections.abc import Iterable

from specforge_dspark.decoding.spec_decode import Step

ECE_BINS = 10


def calibration_pairs(steps: Iterable[Step], G: int) -> tuple[list[float], list[int]]:
    conf: list[float] = []
    label: list[int] = []
    for s in steps:
        if not s.confidence:  # a drafter without a confidence head
            continue
        for k in range(min(s.accepted + 1, G)):
            conf.append(s.confidence[k])
            label.append(int(k < s.accepted))
    return conf, label


def ece(conf: list[float], label: list[int], bins: int = ECE_BINS) -> float | None:
    if not conf:
        return None
    total = 0.0
    for b in range(bins):
        idx = [i for i, c in enumerate(conf) if _bin(c, bins) == b]
        if idx:
            gap = sum(conf[i] for i in idx) / len(idx) - sum(label[i] for i in idx) / len(idx)
            total += abs(gap) * len(idx)
    return total / len(conf)


def reliability(conf: list[float], label: list[int], bins: int = ECE_BINS) -> list[dict]:
    """Per bin: mean confidence, observed acceptance, count (empty bins left out)."""
    rows = []
    for b in range(bins):
        idx = [i for i, c in enumerate(conf) if _bin(c, bins) == b]
        if idx:
            rows.append(
                {
                    "bin": b,
                    "confidence": sum(conf[i] for i in idx) / len(idx),
                    "accepted": sum(label[i] for i in idx) / len(idx),
                    "count": len(idx),
                }
            )
    return rows


def _bin(c: float, bins: int) -> int:
    return min(int(c * bins), bins - 1)


def auroc(conf: list[float], label: list[int]) -> float | None:
    pos = [c for c, y in zip(conf, label, strict=True) if y]
    neg = [c for c, y in zip(conf, label, strict=True) if not y]
    if not pos or not neg:
        return None
    # rank-sum with average ranks for ties: O(n log n)
    order = sorted(range(len(conf)), key=lambda i: conf[i])
    ranks = [0.0] * len(conf)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and conf[order[j + 1]] == conf[order[i]]:
            j += 1
        for r in range(i, j + 1):
            ranks[order[r]] = (i + j) / 2 + 1
        i = j + 1
    rank_pos = sum(r for r, y in zip(ranks, label, strict=True) if y)
    return (rank_pos - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def brier(conf: list[float], label: list[int]) -> float | None:
    if not conf:
        return None
    return sum((c - y) ** 2 for c, y in zip(conf, label, strict=True)) / len(conf)


def calibration_summary(conf: list[float], label: list[int]) -> dict:
    return {
        "pairs": len(conf),
        "ece": ece(conf, label),
        "brier": brier(conf, label),
        "auroc": auroc(conf, label),
        "mean_confidence": sum(conf) / len(conf) if conf else None,
        "acceptance": sum(label) / len(label) if label else None,
        "bins": reliability(conf, label),
    }


def survival_calibration(surv_NG: list[list[float]], accepted_N: list[int]) -> list[dict]:
    """Per position k: calibration of survival s_k against accepted > k (all steps)."""
    G = len(surv_NG[0]) if surv_NG else 0
    return [
        calibration_summary([s[k] for s in surv_NG], [int(a > k) for a in accepted_N])
        for k in range(G)
    ]


def step_stats(steps: list[Step], G: int, logical_vocab: int | None = None) -> dict:
    """Acceptance statistics of a pool of verify steps (one workload, or all of them)."""
    n = len(steps)
    drafted = sum(len(s.drafts) for s in steps)
    padded = None
    if logical_vocab is not None:
        padded = sum(t >= logical_vocab for s in steps for t in s.drafts)
    committed = sum(s.committed for s in steps)
    hist = [0] * (G + 2)
    for s in steps:
        hist[s.committed] += 1
    conf, label = calibration_pairs(steps, G)
    verified = sum((G if s.verified is None else s.verified) + 1 for s in steps)
    return {
        "steps": n,
        "committed_tokens": committed,
        "accept_length": committed / n if n else None,
        "accept_length_uncut": sum(s.accepted + 1 for s in steps) / n if n else None,
        "per_position": [sum(s.accepted > k for s in steps) / n if n else 0.0 for k in range(G)],
        "accept_length_hist": {str(c): hist[c] for c in range(1, G + 2)},
        "drafted_tokens": drafted,
        "padded_drafts": padded,
        "padded_draft_rate": padded / drafted if padded is not None and drafted else None,
        "verified_tokens": verified,
        "tokens_per_verified_token": committed / verified if verified else None,
        "calibration": calibration_summary(conf, label),
    }


def bootstrap_ci(
    numer: list[float],
    denom: list[float] | None = None,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> list[float] | None:
    """Percentile bootstrap interval over units (prompts) of sum(numer) / sum(denom).

    With `denom` None it is the mean of `numer`. For accept length pass each prompt's
    committed tokens and verify steps, so every resample is the pooled ratio the point
    estimate is. Returns [low, high], or None with no units.
    """
    import torch

    if not numer:
        return None
    num = torch.tensor(numer, dtype=torch.float64)
    den = torch.ones_like(num) if denom is None else torch.tensor(denom, dtype=torch.float64)
    if num.shape != den.shape:
        raise ValueError(f"bootstrap_ci: {len(num)} numerators but {len(den)} denominators")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(num), (n_boot, len(num)), generator=gen)
    ratios = num[idx].sum(1) / den[idx].sum(1).clamp_min(1e-12)
    alpha = (1 - level) / 2
    low, high = torch.quantile(ratios, torch.tensor([alpha, 1 - alpha], dtype=torch.float64))
    return [round(float(low), 4), round(float(high), 4)]
