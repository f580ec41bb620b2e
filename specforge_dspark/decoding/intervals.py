"""Bootstrap intervals of accept length over prompts: one drafter's (`bootstrap_ci`); the
paired difference of two drafters decoded on the same prompts (`paired_difference`), which
evaluation reports and the serving loop's gate (loop/gate.py) promotes on; and the
unpaired one of two drafters served on different requests (`unpaired_difference`), with
which the loop watches a promoted drafter's served traffic."""

from __future__ import annotations


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


def paired_difference(
    a: dict, b: dict, n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> dict:
    """Accept length of drafter `a` minus drafter `b` decoded on the SAME prompts: each maps
    a unit (a prompt, or an MT-Bench conversation) to (committed tokens, verify steps).
    Both are resampled with the same units, so the interval is the paired one (the
    prompts' own difficulty cancels). Returns {"difference", "ci", "units", "better"}:
    "better" is "a" or "b" only where the interval excludes 0, else None."""
    import torch

    if set(a) != set(b):
        raise ValueError(f"paired_difference: {len(set(a) ^ set(b))} units decoded by one only")
    keys = sorted(a, key=repr)
    tensors = [torch.tensor([d[k] for k in keys], dtype=torch.float64) for d in (a, b)]
    (ca, na), (cb, nb) = (t.unbind(1) for t in tensors)
    point = float(ca.sum() / na.sum() - cb.sum() / nb.sum())
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(keys), (n_boot, len(keys)), generator=gen)
    diffs = ca[idx].sum(1) / na[idx].sum(1).clamp_min(1e-12) - cb[idx].sum(1) / nb[idx].sum(
        1
    ).clamp_min(1e-12)
    alpha = (1 - level) / 2
    low, high = (float(x) for x in torch.quantile(diffs, torch.tensor([alpha, 1 - alpha]).double()))
    better = "a" if low > 0 else "b" if high < 0 else None
    return {"difference": round(point, 4), "ci": [round(low, 4), round(high, 4)],
            "units": len(keys), "better": better}  # fmt: skip


def unpaired_difference(
    a: list[tuple[float, float]],
    b: list[tuple[float, float]],
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> dict:
    """Pooled accept length of units `a` minus that of units `b`, each unit (committed
    tokens, verify steps), where the two were decoded on DIFFERENT requests (two drafter
    versions' served traffic): each side is resampled on its own, so the interval is wider
    than a paired one. Returns {"difference", "ci", "units": [len(a), len(b)]}."""
    import torch

    if not a or not b:
        raise ValueError(f"unpaired_difference: {len(a)} and {len(b)} units (need both)")
    gen = torch.Generator().manual_seed(seed)

    def resampled(units: list[tuple[float, float]]) -> tuple[float, torch.Tensor]:
        c, n = torch.tensor(units, dtype=torch.float64).unbind(1)
        idx = torch.randint(0, len(units), (n_boot, len(units)), generator=gen)
        return float(c.sum() / n.sum()), c[idx].sum(1) / n[idx].sum(1).clamp_min(1e-12)

    (pa, ra), (pb, rb) = resampled(a), resampled(b)
    alpha = (1 - level) / 2
    low, high = (
        float(x) for x in torch.quantile(ra - rb, torch.tensor([alpha, 1 - alpha]).double())
    )
    return {"difference": round(pa - pb, 4), "ci": [round(low, 4), round(high, 4)],
            "units": [len(a), len(b)]}  # fmt: skip
