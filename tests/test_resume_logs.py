"""A resumed run logs what an uninterrupted one logs (issue 23, item 5).

The logged loss of a step is the mean over the micro-steps since the last logged step.
A stop between two logged steps used to drop the micro-steps before the stop from that
mean. Here a run logging every 3 steps is stopped at step 4 (saved there, one micro-step
into the window that step 6 logs) and resumed; every step it logs must equal the mean,
over the same micro-steps, of the shared uninterrupted reference, which logs every step
(same training math: log_interval changes only what is written). The first run also
runs the feature preflight (preflight.py) before training, which must change nothing.
"""

from __future__ import annotations

import pytest
import torch

from tests import faults_tiny as ft

pytestmark = pytest.mark.slow
TIMING = {"tokens_per_s", "wait_fraction"}  # wall-clock figures differ between any two runs


def _window_mean(ref: dict[int, dict], steps: range, key: str) -> float:
    """What train.py logs for `key` after the micro-steps `steps` (one per step here)."""
    vals = torch.tensor([ref[s].get(key, float("nan")) for s in steps], dtype=torch.float64)
    return vals.nanmean().item()


def test_logged_metrics_of_a_resumed_run_equal_the_uninterrupted_run(
    tmp_path, tmp_path_factory, tiny_target_dir
):
    ref = ft.metrics(ft.reference(tmp_path_factory.getbasetemp()))
    out = tmp_path / "stopped"
    every = "train.log_interval=3"
    # the feature preflight runs first (as production recipes do) and must change nothing
    checked = "train.preflight_samples=2"
    first = ft.train(out, "--resume", "none", "--stop-at-step", "4", every, checked)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "preflight: hf engine" in first.stdout + first.stderr
    assert sorted(ft.metrics(out)) == [3], "only step 3 is logged before the stop at 4"
    again = ft.train(out, "--resume", "auto", every)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout + again.stderr

    got = ft.metrics(out)
    assert sorted(got) == [3, 6, 8]  # every 3rd step and the last
    windows = {3: range(1, 4), 6: range(4, 7), 8: range(7, 9)}
    for step, window in windows.items():
        averaged = {k for k in got[step] if k not in TIMING | {"step", "lr", "grad_norm", "epoch"}}
        assert "loss" in averaged
        for key in sorted(averaged):
            want = _window_mean(ref, window, key)
            assert got[step][key] == pytest.approx(want, rel=1e-12, abs=1e-15), (step, key)
        for key in ("lr", "grad_norm", "epoch"):  # read at the logged step itself
            assert got[step][key] == ref[step][key], (step, key)
    # the window that spans the stop differs from the mean of the steps after it alone
    assert got[6]["loss"] != pytest.approx(_window_mean(ref, range(5, 7), "loss"), rel=1e-9)
