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
"""

from __future__ import annotations

from collections.abc import Iterable

from evaluation.spec_decode import Step

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
        "calibration": {
            "pairs": len(conf),
            "ece": ece(conf, label),
            "auroc": auroc(conf, label),
            "mean_confidence": sum(conf) / len(conf) if conf else None,
            "acceptance": sum(label) / len(label) if label else None,
            "bins": reliability(conf, label),
        },
    }
