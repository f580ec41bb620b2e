"""Non-finite losses, gradients and target features: skip, count, report, stop.

train.py calls, for every micro-batch (every rank, the same number of times):
    feats = guard.screen(feats, micro)       # samples with non-finite features: masked out
    loss = guard.check(out.loss, ...)        # collective; None: this step's update is skipped
    engine.backward(nan_loss(module) if loss is None else loss)
and at every optimizer-step boundary, right after `engine.step()`:
    report = guard.after_step(engine, state) # lines to print, metrics to log, why to stop

Samples: a sample whose aux or last hidden states hold a NaN/inf does not train: its
loss mask and features are zeroed before the draft sees them (the objective pools its
weights over ranks, so a zero-weight sample adds exactly nothing). Counted, reported by
sample id.

Steps: a non-finite loss on any rank (all-reduced flag), a step with no sample left to
train on any rank, or a non-finite global gradient norm skips the optimizer update: no
weight, optimizer-moment or LR-scheduler change. How, with DeepSpeed ZeRO-1/2: its ZeRO
optimizer computes the global gradient norm (all-reduced over ranks) at each boundary;
a non-finite norm marks the step as an overflow, and it then drops the gradients without
touching the fp32 master weights or the Adam state, and the engine does not advance the
LR scheduler (`engine.was_step_applied()` is False; `skipped_steps` counts it). A bad
loss is caught before backward: instead of it, a NaN surrogate (`nan_loss`) is
backpropagated on every rank, so the real backward never runs on a NaN graph and the
norm is NaN everywhere, giving that same skip. Backward and step are still called once
per micro-batch, so DeepSpeed's micro-step counter and accumulation boundaries stay in
step with ours and a resume stays exact. bf16 needs `bf16.check_grad_overflow` (train.py
sets it); ZeRO-0 in fp32 and ZeRO-3 outside fp16 do not check the norm (`skip_supported`):
there a non-finite update stops the run right after the step that applied it.

`train.max_nonfinite_steps` skipped steps in a row stop the run (NonFiniteError) after a
checkpoint of the current state: its weights, optimizer and scheduler are still those
of the last good step, its data cursor is past the skipped steps (what a periodic save
of that step holds too, so --resume auto continues as the uninterrupted run would).

The fault drills inject non-finite values from the test side (tests/inject/drills.py
wraps `screen` and `check`); nothing here reads a test switch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """Too many non-finite steps in a row, or an update DeepSpeed could not skip."""


def skip_supported(zero_stage: int, precision: str) -> bool:
    """Whether DeepSpeed (0.19) skips a step with a non-finite gradient norm."""
    if zero_stage in (1, 2):
        return True
    return zero_stage == 0 and precision == "bf16"


def nan_loss(module: torch.nn.Module) -> torch.Tensor:
    """A scalar whose gradient is NaN for every trainable parameter, graph-free of the
    batch: what a skipped micro-batch backpropagates (see the module docstring)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.stack([p.sum() for p in params]).sum() * float("nan")


def finite_rows(feats) -> torch.Tensor:
    """[B] bool: the sample's aux and last hidden states are all finite."""
    aux = torch.isfinite(feats.aux_hidden).flatten(1).all(1)
    return aux & torch.isfinite(feats.last_hidden).flatten(1).all(1)


class NonFiniteGuard:
    """Per-rank bookkeeping of one run; `check` and `after_step` are collective."""

    def __init__(self, recipe, rank: int, device: torch.device, start_step: int = 0):
        self.max_in_a_row = recipe.train.max_nonfinite_steps
        self.grad_accum = recipe.train.grad_accum
        self.rank, self.device = rank, device
        self.in_a_row = 0
        self.last_good_step = start_step  # the weights are unchanged since this step
        self._new_window()

    def _new_window(self) -> None:
        self.bad_loss = 0  # micro-batches with a non-finite loss, all ranks
        self.trained = 0  # samples trained, all ranks
        self.dropped = 0  # samples dropped for their features, all ranks
        self.local: dict[str, list[int]] = {"loss": [], "features": []}

    def screen(self, feats, micro_step: int, group=None):
        """`feats` with the samples of non-finite features zeroed and unsupervised.
        Collective over `group` when given (a sequence group whose ranks each hold a slice
        of the rows, dist.sequence_parallel): a sample is cleared on every rank of it."""
        ok = finite_rows(feats)
        if group is not None:
            ok_int = ok.to(torch.int32)
            dist.all_reduce(ok_int, op=dist.ReduceOp.MIN, group=group)
            ok = ok_int.bool()
        ok = ok.cpu()
        self._trained_here = int(ok.sum())
        if bool(ok.all()):
            return feats
        ids = zip(feats.sample_ids, ok.tolist(), strict=True)
        self.local["features"] += [i for i, good in ids if not good]
        return _cleared(feats, ~ok)

    def check(self, loss: torch.Tensor, sample_ids: list[int], micro_step: int, boundary: bool):
        """Collective. The loss to backpropagate, or None when this step's update is
        skipped (a non-finite loss on some rank now or earlier in the step, or, at the
        boundary, no sample trained on any rank)."""
        bad = not bool(torch.isfinite(loss.detach()).all())
        if bad:
            self.local["loss"] += list(sample_ids)
        dropped = len(sample_ids) - self._trained_here
        flags = torch.tensor([float(bad), self._trained_here, dropped], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flags)
        self.bad_loss += int(flags[0])
        self.trained += int(flags[1])
        self.dropped += int(flags[2])
        if self.bad_loss or (boundary and self.trained == 0):
            return None
        return loss

    def after_step(self, engine, state) -> StepReport:
        """Collective (a gather only when some rank saw a problem). Classifies the step
        just taken, updates `state`'s counters and says what to print, log and whether
        to stop."""
        applied = engine.was_step_applied()
        norm = engine.get_global_grad_norm()
        bad_norm = norm is not None and not math.isfinite(float(norm))
        withheld = self.bad_loss > 0 or self.trained == 0
        report = StepReport(skipped=not applied)
        if applied and (withheld or bad_norm):
            raise NonFiniteError(
                f"step {state.step}: DeepSpeed applied an update with a non-finite gradient "
                "(this dist.zero_stage / dist.precision does not skip one; use ZeRO-1 or 2)"
            )
        if self.dropped or not applied:
            seen = self._gather()
            if self.dropped:
                state.nonfinite_samples += self.dropped
                report.lines.append(
                    f"step {state.step}: non-finite target features in sample(s) "
                    f"{seen['features']}: not trained ({state.nonfinite_samples} so far)"
                )
            if not applied:
                self.in_a_row += 1
                state.nonfinite_steps += 1
                why = (
                    f"non-finite loss in sample(s) {seen['loss']}"
                    if self.bad_loss
                    else "no finite sample to train on"
                    if self.trained == 0
                    else "non-finite gradient norm"
                )
                good = self.last_good_step
                report.lines.append(
                    f"step {state.step}: {why}: update skipped ({self.in_a_row} in a row, "
                    f"train.max_nonfinite_steps={self.max_in_a_row}; weights unchanged since "
                    f"step {good})"
                )
                if self.in_a_row >= self.max_in_a_row:
                    report.stop = (
                        f"step {state.step}: {self.in_a_row} non-finite steps in a row "
                        f"(train.max_nonfinite_steps={self.max_in_a_row}; last: {why}); "
                        f"weights, optimizer and LR scheduler are unchanged since step {good}"
                    )
        if applied:
            self.in_a_row = 0
            self.last_good_step = state.step
        report.metrics = {
            "nonfinite_steps": state.nonfinite_steps,
            "nonfinite_in_a_row": self.in_a_row,
            "nonfinite_samples": state.nonfinite_samples,
        }
        self._new_window()
        return report

    def _gather(self) -> dict[str, list[int]]:
        """The offending sample ids of every rank, sorted."""
        parts = [self.local]
        if dist.is_initialized():
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, self.local)
        return {k: sorted({i for p in parts for i in p[k]}) for k in self.local}


@dataclass
class StepReport:
    skipped: bool
    lines: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    stop: str | None = None


def _cleared(feats, rows_B: torch.Tensor):
    """A copy of `feats` with rows `rows_B` cleared (zero features and loss mask). The
    stream's slot tensors stay untouched."""
    rows = rows_B.to(feats.aux_hidden.device)
    aux, last, mask = feats.aux_hidden.clone(), feats.last_hidden.clone(), feats.loss_mask.clone()
    aux[rows], last[rows], mask[rows.to(mask.device)] = 0, 0, 0
    return dataclasses.replace(
        feats, sample_ids=list(feats.sample_ids), loss_mask=mask, aux_hidden=aux, last_hidden=last
    )
