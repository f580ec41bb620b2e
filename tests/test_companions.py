"""One capture, several drafters (issue 35 item 3; config/companions.py, training/drafters.py).

A 2-rank job trains recipes/tiny_cpu.yaml's DSpark and a DFlash companion (its own
objective and optimizer) from one feature stream. Each drafter's logged losses and its
weights, Adam state and LR schedule must equal, BITWISE, those of a job that trains that
drafter alone with the same seed (the shared fault-test reference for the DSpark; one
DFlash-only job). The two-drafter job is stopped at step 4 and the companion's step-4
checkpoint is then made incomplete (a kill between the two drafters' saves): `--resume
auto` must go back to step 3, the step every drafter saved, and still end equal.
"""

from __future__ import annotations

import json

import pytest
import yaml

from specforge_dspark.config.recipe import RecipeError, load_recipe
from specforge_dspark.training import memory
from tests import faults_tiny as ft

DFLASH = {
    "draft": {
        "kind": "dflash",
        "layer_types": ["sliding_attention", "sliding_attention"],
        "sliding_window": 64,
    },
    "objective": {"bce_weight": 0.0, "slot_weighting": "dpace"},
    "optim": {"lr": 1.0e-3, "warmup_ratio": 0.0},
}
COMPANION = "companions=" + yaml.safe_dump([{"name": "dflash", **DFLASH}], default_flow_style=True)
ALONE = [f"{sec}.{k}={json.dumps(v)}" for sec, keys in DFLASH.items() for k, v in keys.items()]
TRAINED = ("loss", "ce", "l1", "grad_norm", "lr", "tau")


def _logged(out, steps) -> dict:
    got = ft.metrics(out)
    return {s: {k: got[s][k] for k in TRAINED if k in got[s]} for s in steps}


@pytest.mark.slow
def test_each_drafter_of_a_two_drafter_job_trains_as_it_would_alone(tmp_path, tmp_path_factory):
    dspark = ft.reference(tmp_path_factory.getbasetemp())
    dflash = tmp_path / "dflash-alone"
    p = ft.train(dflash, "--resume", "none", *ALONE)
    assert p.returncode == 0, p.stderr[-3000:]

    both = tmp_path / "both"
    tracked = "tracking.enabled=true"  # trackio holds one run per process: the companion's go in it
    p = ft.train(both, "--resume", "none", "--stop-at-step", "4", COMPANION, tracked)
    assert p.returncode == 0, p.stderr[-3000:]
    companion = both / "companions" / "dflash"
    assert _logged(both, range(1, 5)) == _logged(dspark, range(1, 5))
    assert _logged(companion, range(1, 5)) == _logged(dflash, range(1, 5))
    assert _logged(companion, [4]) != _logged(both, [4]), "the companion is its own drafter"

    (companion / "ckpt" / "step-4" / "COMPLETE").unlink()  # killed between the two saves
    p = ft.train(both, "--resume", "auto", COMPANION, tracked)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {both / 'ckpt' / 'step-3'} at step 3" in p.stdout + p.stderr
    assert _logged(both, range(1, 9)) == _logged(dspark, range(1, 9))
    assert _logged(companion, range(1, 9)) == _logged(dflash, range(1, 9))
    for mine, alone in ((both, dspark), (companion, dflash)):
        step = f"step-{ft.STEPS}"
        assert ft.same_update_state(ft.state(mine / "ckpt" / step), ft.state(alone / "ckpt" / step))


def _recipe(*overrides: str):
    return load_recipe(ft.REPO / "recipes/tiny_cpu.yaml", list(overrides))


def test_a_companion_problem_names_its_key():
    bad = "companions=[{name: x, draft: {kind: dflash, block_sise: 4}, optim: {lr: fast}}]"
    with pytest.raises(RecipeError) as e:
        _recipe(bad)
    said = str(e.value)
    assert (
        "unknown key companions[0].draft.block_sise; did you mean companions[0].draft.block_size?"
        in said
    )
    assert "companions[0].optim.lr: expected a number, got 'fast'" in said
    with pytest.raises(
        RecipeError, match=r"companions\[0\].draft.target_layer_ids: \[0, 1\] differs"
    ):
        _recipe("companions=[{name: x, draft: {target_layer_ids: [0, 1]}}]")
    with pytest.raises(RecipeError, match=r"companions\[1\].name: 'a' is used twice"):
        _recipe("companions=[{name: a}, {name: a}]")
    with pytest.raises(RecipeError, match=r"companions\[0\] \(x\): draft.layer_types: sliding"):
        _recipe(
            "companions=[{name: x, draft: {layer_types: [sliding_attention, sliding_attention]}}]"
        )


def test_the_dry_run_sizes_the_set_of_drafters():
    recipe = _recipe(COMPANION)
    lines = memory.dry_run_summary(recipe)
    assert "companion dflash:" in lines
    assert any(x.startswith("  draft (dflash): 2 layers") for x in lines)
    head = lines.index("memory per rank for the 2 drafters (estimate; 1 rank(s)):")
    rows = {x[:36].strip(): float(x.split()[-2]) for x in lines[head + 1 :]}
    alone = [memory.drafter_summary(r, 1)[1][0] for r in (recipe, _companion(recipe))]
    mb = 1e6
    for name, est in zip(("main", "dflash"), alone, strict=True):
        state = est["draft weights"] + est["gradients"] + est["optimizer state"]
        assert rows[f"{name}: weights, grads, optimizer"] == pytest.approx(state / mb, abs=0.01)
    shared = alone[0]["frozen head"] + alone[0]["activations: features"]
    largest = max(e["activations"] - e["activations: features"] for e in alone)
    want = (
        shared
        + largest
        + sum(rows[f"{n}: weights, grads, optimizer"] * mb for n in ("main", "dflash"))
    )
    assert rows["total"] == pytest.approx(want / mb, abs=0.02)


def _companion(recipe):
    from specforge_dspark.config.companions import companion_recipe

    return companion_recipe(recipe, 0)
