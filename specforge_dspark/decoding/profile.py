"""The speculation profile an export carries (`speculation_profile.json` beside the
weights): how often each draft position is accepted, measured by our engine-faithful
harness (decoding/spec_decode.py) on held-out prompts, per workload and overall.

Per workload (and "overall", pooled over verify steps), D = drafts per step:
  steps                      verify steps measured
  accept_length              committed tokens per verify step (bonus token included)
  marginal_acceptance[k]     P(draft k accepted) = fraction of steps with accepted > k
  conditional_acceptance[k]  P(draft k accepted | drafts 0..k-1 accepted): what a
                             confidence head predicts and an engine's adaptive verifier
                             multiplies into a survival probability (None where no step
                             reached slot k)
  accept_length_histogram[c] steps that committed c + 1 tokens (c = 0..D)
Model Optimizer's proposed `speculation_profile.json` is not published yet; these names
are ours, and the `format` field versions them.
"""

from __future__ import annotations

import json
from pathlib import Path

from specforge_dspark.decoding.spec_decode import Step

PROFILE_FILE = "speculation_profile.json"
FORMAT = "specforge_dspark.speculation_profile/1"


def acceptance_by_position(accepted_hist: list[int], drafts: int) -> dict:
    """Marginal and conditional acceptance per draft position from a histogram of verify
    steps by drafts accepted (`accepted_hist[j]`: steps that accepted j drafts, as SGLang's
    `spec_correct_drafts_histogram`; shorter lists mean zeros beyond)."""
    h = [*accepted_hist[: drafts + 1], *[0] * max(0, drafts + 1 - len(accepted_hist))]
    n = sum(h)
    reached = [sum(h[k:]) for k in range(drafts)]
    passed = [sum(h[k + 1 :]) for k in range(drafts)]
    return {
        "marginal_acceptance": [p / n if n else None for p in passed],
        "conditional_acceptance": [
            p / r if r else None for p, r in zip(passed, reached, strict=True)
        ],
    }


def profile_of(steps: list[Step], drafts: int) -> dict:
    """The figures above for `steps` of a drafter drafting `drafts` tokens per step."""
    n = len(steps)
    accepted = [sum(s.accepted == j for s in steps) for j in range(drafts + 1)]
    hist = [sum(s.committed == c + 1 for s in steps) for c in range(drafts + 1)]
    return {
        "steps": n,
        "accept_length": sum(s.committed for s in steps) / n if n else None,
        **acceptance_by_position(accepted, drafts),
        "accept_length_histogram": hist,
    }


def write_profile(
    export_dir: Path, by_workload: dict[str, list[Step]], drafts: int, how: dict
) -> Path:
    """EXPORT/speculation_profile.json from each workload's held-out steps; `how` says how
    they were measured (target, prompts, tokens, temperature)."""
    every = [s for steps in by_workload.values() for s in steps]
    profile = {
        "format": FORMAT,
        "drafts_per_step": drafts,
        "measured_by": {"harness": "specforge_dspark.decoding.spec_decode", **how},
        "workloads": {w: profile_of(steps, drafts) for w, steps in by_workload.items()},
        "overall": profile_of(every, drafts),
    }
    path = Path(export_dir) / PROFILE_FILE
    path.write_text(json.dumps(profile, indent=1))
    return path


def read_profile(export_dir: Path) -> dict:
    """An export's profile, checked: its format and that each workload's histogram counts
    its steps."""
    path = Path(export_dir) / PROFILE_FILE
    profile = json.loads(path.read_text())
    if profile.get("format") != FORMAT:
        raise ValueError(f"{path}: format {profile.get('format')!r}, expected {FORMAT!r}")
    for name, p in {**profile["workloads"], "overall": profile["overall"]}.items():
        if sum(p["accept_length_histogram"]) != p["steps"]:
            raise ValueError(f"{path}: {name}: the histogram does not count its {p['steps']} steps")
    return profile
