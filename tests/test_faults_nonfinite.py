"""Non-finite values on CPU, 2 gloo ranks, DeepSpeed ZeRO-2 fp32 (training/nonfinite.py).

Injected from the test side (SPECFORGE_INJECT_NAN, tests/inject/drills.py) into a run
with the reference run's data: a NaN loss on rank 0 at step 3, NaN features in rank 0's
sample of micro-batch 5 and a NaN gradient on rank 1 at step 6. A skipped step leaves
weights, Adam state, master weights and the LR scheduler bitwise as they were; the bad
sample does not train; counters and sample ids are logged; a resume from a checkpoint
after a skip continues exactly; too many skipped steps in a row stop the run with a
message and a complete checkpoint of the good state.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from tests import faults_tiny as ft
from tests.inject.drills import NAN, Injection

pytestmark = pytest.mark.slow

INJECT = {NAN: "loss:3,features:5,grad:6@1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target_dir):
    ref = ft.reference(tmp_path_factory.getbasetemp())
    out = tmp_path_factory.mktemp("nonfinite") / "injected"
    p = ft.train(out, "--resume", "none", env=INJECT)
    assert p.returncode == 0, p.stderr[-3000:]
    return ref, out, p


def test_injection_spec_parses():
    assert Injection.parse("", 0).ranges == {}
    spec = "loss:3,features:5-7,grad:9-,loss:2@1"
    inj = Injection.parse(spec, 0)
    assert inj.hits("loss", 3) and not inj.hits("loss", 2)
    assert [inj.hits("features", n) for n in (4, 5, 7, 8)] == [False, True, True, False]
    assert inj.hits("grad", 9) and inj.hits("grad", 10**6)
    assert Injection.parse(spec, 1).hits("loss", 2)
    with pytest.raises(ValueError, match="cannot parse 'loss=3'"):
        Injection.parse("loss=3", 0)


def test_skipped_steps_change_no_weight_moment_or_schedule(runs):
    ref, out, _ = runs
    ck = out / "ckpt"
    before = ft.state(ref / "ckpt" / "step-2")
    assert ft.same_update_state(ft.state(ck / "step-2"), before)  # same run up to the NaN
    assert ft.same_update_state(ft.state(ck / "step-3"), before)  # NaN loss: nothing moved
    assert ft.state(ck / "step-3")["skipped_steps"] == 1
    assert ft.same_update_state(ft.state(ck / "step-6"), ft.state(ck / "step-5"))  # NaN grad
    assert ft.state(ck / "step-6")["skipped_steps"] == 2
    assert not ft.same_update_state(ft.state(ck / "step-5"), ft.state(ck / "step-4"))
    assert all(torch.isfinite(v).all() for v in ft.state(ck / "step-8")["module"].values())
    m, r = ft.metrics(out), ft.metrics(ref)
    # the scheduler lags one step per skip: step 4 runs at the reference's step-3 rate
    assert m[3]["lr"] == m[2]["lr"] == r[2]["lr"] and m[4]["lr"] == r[3]["lr"]
    assert m[7]["lr"] == r[5]["lr"]


def test_counters_and_sample_ids_are_reported(runs):
    ref, out, p = runs
    ids0 = dict(ft.trained_ids(ref, 0))  # micro step -> rank 0's sample ids
    m = ft.metrics(out)
    assert "loss" not in m[3] and m[3]["nonfinite_steps"] == 1
    assert m[2]["nonfinite_steps"] == 0 and m[8]["nonfinite_steps"] == 2
    assert m[4]["nonfinite_samples"] == 0 and m[5]["nonfinite_samples"] == 1
    assert m[6]["nonfinite_in_a_row"] == 1 and m[7]["nonfinite_in_a_row"] == 0
    log = p.stdout + p.stderr
    for landed in ("rank 0: NaN loss at step 3", "rank 0: NaN features in micro-batch 5"):
        assert f"[drill] {landed}" in log
    assert "[drill] rank 1: NaN gradient at step 6" in log
    assert f"step 3: non-finite loss in sample(s) {ids0[3]}: update skipped (1 in a row" in log
    assert f"step 5: non-finite target features in sample(s) {ids0[5]}: not trained" in log
    assert "step 6: non-finite gradient norm" in log
    micro = [mb for mb, _ in ft.trained_ids(out, 0)]
    assert micro == list(range(1, ft.STEPS + 1))  # every micro-batch went through once


def test_resume_after_a_skipped_step_is_exact(runs, tmp_path):
    _, out, _ = runs
    again = tmp_path / "again"
    shutil.copytree(out / "ckpt" / "step-3", again / "ckpt" / "step-3")
    shutil.copy(out / "metrics.jsonl", again / "metrics.jsonl")
    p = ft.train(again, "--resume", "auto", env=INJECT)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = ft.losses(again), ft.losses(out)
    assert [a[s] for s in range(4, ft.STEPS + 1)] == [b[s] for s in range(4, ft.STEPS + 1)]
    assert ft.same_update_state(
        ft.state(again / "ckpt" / f"step-{ft.STEPS}"), ft.state(out / "ckpt" / f"step-{ft.STEPS}")
    )


def test_too_many_nonfinite_steps_in_a_row_stop_with_a_good_checkpoint(runs, tmp_path):
    ref, _, _ = runs
    out = tmp_path / "stops"
    p = ft.train(
        out,
        "--resume",
        "none",
        "train.max_nonfinite_steps=2",
        "checkpoint.save_interval=100",
        env={NAN: "loss:3-"},
    )
    assert p.returncode != 0
    assert "error: step 4: 2 non-finite steps in a row (train.max_nonfinite_steps=2" in p.stderr
    assert "weights, optimizer and LR scheduler are unchanged since step 2" in p.stderr
    assert 'train.py", line' not in p.stderr  # a message, not a traceback
    status = json.loads((out / "run_status.json").read_text())  # a retry would loop: no
    assert (status["status"], status["exit_code"], status["resumable"]) == ("failed", 1, False)
    # every rank stops at step 4; the first rank to end writes the cause (run_status.py)
    assert re.match(r"(rank 1: )?NonFiniteError: step 4", status["detail"]), status
    saved = out / "ckpt" / "step-4"
    assert (saved / "COMPLETE").is_file()
    assert [x.name for x in (out / "ckpt").glob("step-*")] == ["step-4"]
    assert ft.same_update_state(ft.state(saved), ft.state(ref / "ckpt" / "step-2"))
