"""The n-gram baseline drafter and the bootstrap intervals of the evaluation report."""

from __future__ import annotations

import random

import pytest
import torch

from specforge_dspark.decoding.intervals import bootstrap_ci
from specforge_dspark.decoding.ngram import NgramDrafter, lookup


def test_lookup_copies_what_followed_the_latest_match():
    #          0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # suffix (6, 7) last occurred at 5..6 followed by 9, 2, 6, 7, then self-extension
    assert lookup(history, 4, max_ngram=2) == [9, 2, 6, 7]
    # a longer n-gram wins over the latest shorter one: (2, 6, 7) has no earlier match,
    # (6, 7) does; with max_ngram=3 the result is the same
    assert lookup(history, 4, max_ngram=3) == [9, 2, 6, 7]


def test_lookup_extends_through_its_own_drafts_and_falls_back():
    assert lookup([1, 2, 3, 1, 2], 5, max_ngram=2) == [3, 1, 2, 3, 1]  # period 3 copied
    assert lookup([4, 4], 3) == [4, 4, 4]
    assert lookup([1, 2, 3], 2) == [3, 3]  # no match: repeat the last token


def test_drafter_rebuilds_the_committed_context_from_ctx_len():
    d = NgramDrafter(block_size=3, max_ngram=2)
    prompt = [1, 2, 3, 4, 1, 2]
    d.begin(prompt)
    ctx = torch.zeros(1, len(prompt), 0)
    drafts, conf = d.propose(ctx, len(prompt), bonus_token=3)
    assert conf is None and drafts.tolist() == [4, 1, 2]
    # the verifier accepted 2 drafts: bonus 3 and drafts 4, 1 are committed
    drafts, _ = d.propose(ctx, len(prompt) + 3, bonus_token=7)
    assert d.history == [*prompt, 3, 4, 1]
    assert drafts.tolist() == [7, 7, 7]  # no earlier 7 (nor "1 7")
    with pytest.raises(RuntimeError, match="begin"):
        d.propose(ctx, len(prompt) + 99, bonus_token=1)


def test_bootstrap_interval_covers_the_true_mean_at_its_level():
    rng = random.Random(0)
    covered = 0
    trials = 200
    for t in range(trials):
        xs = [rng.expovariate(1.0) for _ in range(30)]  # true mean 1.0, skewed
        low, high = bootstrap_ci(xs, n_boot=500, seed=t)
        assert low <= sum(xs) / len(xs) <= high
        covered += low <= 1.0 <= high
    assert 0.86 <= covered / trials <= 0.99  # nominal 95%, percentile bootstrap at n=30


def test_bootstrap_of_a_ratio_resamples_units_not_steps():
    # two prompts: one long with accept length 3, one short with 1 -> pooled 2.6
    committed, steps = [300.0, 20.0], [100.0, 20.0]
    low, high = bootstrap_ci(committed, steps, seed=0)
    assert low == pytest.approx(1.0) and high == pytest.approx(3.0)  # all-one-prompt draws
    assert bootstrap_ci([2.0] * 10, [1.0] * 10) == [2.0, 2.0]
    assert bootstrap_ci([]) is None
    with pytest.raises(ValueError, match="denominators"):
        bootstrap_ci([1.0, 2.0], [1.0])


def test_paired_difference_sees_what_overlapping_intervals_hide():
    """Prompts of very different difficulty: each drafter's own interval is wide and the two
    overlap, but `b` commits more than `a` on every prompt (0.2 a step on average), and the
    paired interval of a - b (the same resampled prompts for both) lies below 0. An
    independent paired bootstrap (python's random, another generator) gives the same
    interval within resampling noise; `a` against itself is 0 exactly."""
    from specforge_dspark.decoding.intervals import paired_difference

    rng = random.Random(7)
    a, b = {}, {}
    for k in range(40):
        steps = rng.randint(20, 40)
        easy = rng.random() < 0.5
        c = steps * (4.0 if easy else 1.5)
        a[("gsm8k", k)] = (c, steps)
        b[("gsm8k", k)] = (c + steps * rng.uniform(0.0, 0.4), steps)  # 0.2 more on average
    ca, na = zip(*a.values(), strict=True)
    cb, nb = zip(*b.values(), strict=True)
    ia, ib = bootstrap_ci(list(ca), list(na)), bootstrap_ci(list(cb), list(nb))
    assert ia[1] > ib[0]  # unpaired: the intervals overlap
    got = paired_difference(a, b)
    assert got["difference"] == pytest.approx(-0.2, abs=0.05)
    assert got["ci"][0] < got["difference"] < got["ci"][1]
    assert got["ci"][1] < 0 and got["better"] == "b" and got["units"] == 40

    keys = list(a)
    ref = []
    for _ in range(4000):  # the reference: sum-ratio difference over resampled prompts
        pick = [keys[rng.randrange(len(keys))] for _ in keys]
        ref.append(
            sum(a[k][0] for k in pick) / sum(a[k][1] for k in pick)
            - sum(b[k][0] for k in pick) / sum(b[k][1] for k in pick)
        )
    ref.sort()
    assert got["ci"][0] == pytest.approx(ref[100], abs=0.01)
    assert got["ci"][1] == pytest.approx(ref[3899], abs=0.01)

    same = paired_difference(a, a)
    assert same["difference"] == 0 and same["ci"] == [0, 0] and same["better"] is None
    with pytest.raises(ValueError, match="1 units decoded by one only"):
        paired_difference(a, {**b, ("math500", 0): (3, 1)})
