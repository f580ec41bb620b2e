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
  multiplies into a survival probability (ECE, Brier, AUROC: decoding/calibration_metrics.py).
- verified_tokens: tokens the target verified (bonus + drafts sent, G + 1 per step
  without a verify budget); tokens_per_verified_token = committed / verified.
Also the bootstrap interval of accept length over prompts (`accept_length_ci`), accept
length by the context position each verify step drafts from (`by_context`), and the
wall-clock figures of plain vs speculative decoding (`speed_stats`).
"""

from __future__ import annotations

from collections.abc import Iterable

from specforge_dspark.decoding.calibration_metrics import calibration_summary
from specforge_dspark.decoding.intervals import bootstrap_ci
from specforge_dspark.decoding.spec_decode import Generation, Step


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


def prompt_units(eval_dir) -> dict:
    """(workload, prompt index) -> (committed tokens, verify steps) of an evaluation's
    generations.jsonl, an MT-Bench conversation's turns summed: the units a paired
    comparison of two drafters on the same prompts resamples."""
    import json
    from pathlib import Path

    units: dict = {}
    for line in (Path(eval_dir) / "generations.jsonl").open():
        g = json.loads(line)
        c, n = units.get((g["workload"], g["index"]), (0, 0))
        units[(g["workload"], g["index"])] = (c + g["committed"], n + g["verify_steps"])
    return units


def accept_length_ci(gens: list[Generation], units: list) -> list[float] | None:
    """95% bootstrap interval of the pooled accept length, resampling conversations
    (`units[i]` names generation i's; an MT-Bench conversation's two turns stay together)."""
    committed: dict = {}
    steps: dict = {}
    for gen, unit in zip(gens, units, strict=True):
        committed[unit] = committed.get(unit, 0) + sum(st.committed for st in gen.steps)
        steps[unit] = steps.get(unit, 0) + len(gen.steps)
    keys = [k for k in committed if steps[k]]
    return bootstrap_ci([committed[k] for k in keys], [steps[k] for k in keys])


CONTEXT_EDGES = (0, 1024, 2048, 4096, 8192)
"""Lower edges of the context buckets `by_context` reports (tokens; the last is open)."""


def by_context(gens: list[Generation], units: list, edges=CONTEXT_EDGES) -> list[dict]:
    """Accept length per bucket of context position: a verify step drafts after its
    generation's prompt and the tokens committed before it, and counts in the bucket
    [edges[i], edges[i + 1]) holding that position. Each non-empty bucket:
    {"from", "to" (None: open), "steps", "committed_tokens", "accept_length",
    "accept_length_ci"} (95% bootstrap over `units`, as accept_length_ci)."""
    cells: list[dict] = [{} for _ in _checked(edges)]  # bucket -> unit -> [committed, steps]
    for gen, unit in zip(gens, units, strict=True):
        steps = [st.committed for st in gen.steps]
        for b, committed in bucketed_steps(len(gen.prompt_ids), steps, edges):
            cell = cells[b].setdefault(unit, [0, 0])
            cell[0] += committed
            cell[1] += 1
    out = []
    for i, cell in enumerate(cells):
        if not cell:
            continue
        committed, steps = [c for c, _ in cell.values()], [n for _, n in cell.values()]
        out.append({
            "from": edges[i], "to": edges[i + 1] if i + 1 < len(edges) else None,
            "steps": sum(steps), "committed_tokens": sum(committed),
            "accept_length": sum(committed) / sum(steps),
            "accept_length_ci": bootstrap_ci(committed, steps),
        })  # fmt: skip
    return out


def _checked(edges) -> list[int]:
    if list(edges) != sorted(set(edges)) or edges[0] != 0:
        raise ValueError(f"context bucket edges must rise from 0, got {list(edges)}")
    return list(edges)


def bucketed_steps(start: int, committed_per_step: list[int], edges) -> list[tuple[int, int]]:
    """(bucket, committed) of each verify step of a generation whose prompt holds `start`
    tokens: a step drafts from the prompt plus what the steps before it committed."""
    import bisect

    out, position = [], start
    for committed in committed_per_step:
        out.append((bisect.bisect_right(edges, position) - 1, committed))
        position += committed
    return out


def context_units(eval_dir, edges=CONTEXT_EDGES) -> list[dict]:
    """Per bucket of `by_context`, (workload, prompt index) -> (committed, steps) from an
    evaluation's generations.jsonl (a step commits its accepted drafts and one more; the
    last step of a generation cut by its end is cut as the record's total says): the
    units a paired comparison of two drafters per bucket resamples."""
    import json
    from pathlib import Path

    cells: list[dict] = [{} for _ in _checked(edges)]
    for line in (Path(eval_dir) / "generations.jsonl").open():
        g = json.loads(line)
        steps = [a + 1 for a in g["accepted_per_step"]]
        if steps:
            steps[-1] -= sum(steps) - g["committed"]
        for b, committed in bucketed_steps(g["prompt_tokens"], steps, edges):
            c, n = cells[b].get((g["workload"], g["index"]), (0, 0))
            cells[b][(g["workload"], g["index"])] = (c + committed, n + 1)
    return cells


def pooled_speed(stats: Iterable[dict]) -> dict:
    """`speed_stats` pooled over several workloads' statistics."""
    stats = list(stats)
    plain = [s["seconds_plain"] for s in stats]
    return speed_stats(
        sum(s["generations"] for s in stats),
        sum(s["new_tokens"] for s in stats),
        None if None in plain else sum(plain),
        sum(s["seconds_spec"] for s in stats),
    )


def speed_stats(generations: int, tokens: int, plain_s: float | None, spec_s: float) -> dict:
    """Wall-clock figures of plain vs speculative decoding (reported, never asserted);
    plain_s None: the references came batched (greedy_references), not timed per prompt."""
    if plain_s is None:
        return {
            "generations": generations,
            "new_tokens": tokens,
            "seconds_plain": None,
            "seconds_spec": spec_s,
            "tokens_per_s_plain": None,
            "tokens_per_s_spec": tokens / spec_s if spec_s else None,
            "speedup": None,
        }
    return {
        "generations": generations,
        "new_tokens": tokens,
        "seconds_plain": plain_s,
        "seconds_spec": spec_s,
        "tokens_per_s_plain": tokens / plain_s if plain_s else None,
        "tokens_per_s_spec": tokens / spec_s if spec_s else None,
        "speedup": plain_s / spec_s if spec_s else None,
    }
