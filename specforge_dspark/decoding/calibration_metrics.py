"""Calibration of predicted probabilities against 0/1 outcomes (pure functions on lists).

- ECE: equal-width bins (ECE_BINS), |mean confidence - observed rate| weighted by count.
- AUROC: the Mann-Whitney statistic with ties counted half (None when one class is absent).
- `survival_calibration`: per position k over all steps, the predicted survival
  prod_{i<=k} c_i against "draft k accepted" (accepted > k), the quantity SGLang's verify
  budget ranks; ECE, Brier score and AUROC per position.
Used by the STS calibration (decoding/calibration.py) and the acceptance report.
"""

from __future__ import annotations

ECE_BINS = 10


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
