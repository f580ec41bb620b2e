"""Confidence-budgeted verification: SGLang 0.5.23's ragged verify budget, one request.

The rule (`dspark_planner.HostConfidenceBudgetPlanner`, `compute_verify_token_budget`,
`dspark_schedule.schedule_verify_lens_topk_from_survival`; SGLANG_RAGGED_VERIFY_MODE
other than `static`):
1. confidence c_k = sigmoid(raw_k / T_k) (T_k: the STS calibration, 1 without one);
   survival s_k = prod_{i<=k} c_i, the predicted probability that draft k is accepted.
2. budget: from the survival of the step `lag_steps` earlier in the same request
   (SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS, default 2; all ones before that), sort the
   candidates s_k >= eps (1e-6) descending; tau(b) = 1 + sum of the b largest (expected
   tokens of the step for one request); b* = argmax_b tau(b) / step_time(1 + b) (the
   first maximum), step_time from the cost table (`SpsAdditiveCostTable`).
3. verify length of this step = clamp(1 + #(the b* largest CURRENT survivals >= eps),
   1, G + 1) tokens: for one request the first min(b*, #valid) drafts.
Our cost model is the additive table step_time(m) = 1 + verify_token_cost * m for m
verified tokens (`sglang_cost_table` gives the same table as SGLang's JSON). With
verify_token_cost = 0 (SGLang's default uninitialised table) every draft with s >= eps
is verified. `verify_budgets` builds the uncalibrated and calibrated budgets of a draft.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

SURVIVAL_EPS = 1e-6  # DSparkScheduleConfig.survival_eps
SGLANG_LAG_STEPS = 2  # SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS default


def survival(
    raw_logits: list[float], temperatures: list[float] | None = None, offset: float = 0.0
) -> list[float]:
    """Cumulative product of sigmoid((raw_k + offset) / T_k) (DSparkConfidenceHead.apply_sts;
    `offset` undoes a calibration's confidence-bias shift for the uncalibrated budget)."""
    out, s = [], 1.0
    for k, z in enumerate(raw_logits):
        t = 1.0 if temperatures is None else temperatures[k]
        s *= 1.0 / (1.0 + math.exp(-(z + offset) / t))
        out.append(s)
    return out


def budget_from_survival(
    surv: list[float], verify_token_cost: float, eps: float = SURVIVAL_EPS
) -> int:
    """b* = argmax_b (1 + sum of the b largest s >= eps) / (1 + cost * (1 + b))."""
    cands = sorted((s for s in surv if s >= eps), reverse=True)
    best, best_theta, tau = 0, -math.inf, 1.0
    for b in range(len(cands) + 1):
        if b:
            tau += cands[b - 1]
        theta = tau / (1.0 + verify_token_cost * (1 + b))
        if theta > best_theta:  # strict: the first maximum, as torch.argmax
            best, best_theta = b, theta
    return best


def verify_drafts(surv: list[float], budget: int, eps: float = SURVIVAL_EPS) -> int:
    """Drafts verified: the `budget` largest survivals >= eps of one request (a
    non-increasing row, so its first ones), capped at G."""
    return min(budget, sum(s >= eps for s in surv), len(surv))


def sglang_cost_table(G: int, verify_token_cost: float) -> dict:
    """The SpsAdditiveCostTable JSON fields of our cost model, for m = 1 .. G+1 tokens
    (`--speculative-dspark-sps-table-path`): bias 1, no per-request term, theta = c*m."""
    return {
        "bias_seconds": 1.0,
        "bs_probes": [1],
        "alpha_seconds": [0.0],
        "m_probes": [1, G + 1],
        "theta_seconds": [verify_token_cost, verify_token_cost * (G + 1)],
    }


@dataclass
class VerifyBudget:
    """Per-request state of the budget rule; `reset()` at each new request."""

    block_size: int
    verify_token_cost: float
    temperatures: list[float] | None = None  # STS per position; None = uncalibrated
    logit_offset: float = 0.0  # added to every raw logit (undoes a calibrated bias shift)
    lag_steps: int = SGLANG_LAG_STEPS
    _history: deque = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        if self.verify_token_cost < 0:
            raise ValueError(f"verify_token_cost must be >= 0, got {self.verify_token_cost}")
        if self.temperatures is not None and len(self.temperatures) != self.block_size:
            raise ValueError(
                f"STS calibration has {len(self.temperatures)} temperatures, block size "
                f"is {self.block_size}"
            )

    def reset(self) -> None:
        self._history.clear()

    def drafts_to_verify(self, raw_logits: list[float]) -> int:
        if not raw_logits:  # no confidence head: SGLang refuses ragged verify; verify all
            return self.block_size
        surv = survival(raw_logits, self.temperatures, self.logit_offset)
        lagged = self._history[0] if len(self._history) == self.lag_steps else None
        self._history.append(surv)
        if len(self._history) > self.lag_steps:
            self._history.popleft()
        if self.lag_steps == 0:
            lagged = surv
        budget = budget_from_survival(
            [1.0] * self.block_size if lagged is None else lagged, self.verify_token_cost
        )
        return verify_drafts(surv, budget)


def verify_budgets(drafter, draft, cost: float | None, sts_path) -> dict:
    """{"uncalibrated": VerifyBudget, "calibrated": VerifyBudget (when an STS file is
    given or sits in the draft directory)} for a verify-token cost; {} without one.
    Uncalibrated is the head as trained: a confidence-bias shift that calibration added
    to the export (its safetensors metadata) is taken off again."""
    if cost is None:
        return {}
    from specforge_dspark.decoding.sts import STS_FILE, read_bias_shift, validate_sts_file

    G = int(drafter.config.block_size)
    shift = 0.0
    if isinstance(draft, (str, Path)):
        if (Path(draft) / "model.safetensors").is_file():
            shift = read_bias_shift(draft)
        if sts_path is None and (Path(draft) / STS_FILE).is_file():
            sts_path = Path(draft) / STS_FILE
    out = {"uncalibrated": VerifyBudget(G, cost, logit_offset=-shift)}
    if sts_path is not None:
        out["calibrated"] = VerifyBudget(G, cost, validate_sts_file(Path(sts_path), G))
    return out


def budget_row(stats: dict) -> dict:
    """The verify-budget figures of a `metrics.step_stats` pool (summary `verify_budget`)."""
    keys = ("steps", "accept_length", "verified_tokens", "tokens_per_verified_token")
    row = {k: stats[k] for k in keys}
    row["drafts_verified_per_step"] = (
        stats["verified_tokens"] / stats["steps"] - 1 if stats["steps"] else None
    )
    return row
