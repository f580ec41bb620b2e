"""Checkpoint bookkeeping: completeness, keep-last-k, resume selection, refusals."""

from __future__ import annotations

import pytest

from specforge_dspark import checkpoint as ck
from specforge_dspark.recipe import recipe_from_dict


def _fake(root, step, complete=True):
    p = ck.step_dir(root, step)
    p.mkdir(parents=True)
    (p / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        (p / ck.MARKER).write_text("")
    return p


def test_latest_complete_skips_partial_saves(tmp_path):
    _fake(tmp_path, 10)
    _fake(tmp_path, 20)
    _fake(tmp_path, 30, complete=False)  # killed while saving
    assert ck.latest_complete(tmp_path) == ck.step_dir(tmp_path, 20)
    assert ck.resolve_resume("auto", tmp_path) == ck.step_dir(tmp_path, 20)
    assert ck.resolve_resume("none", tmp_path) is None
    assert ck.resolve_resume("auto", tmp_path / "nothing") is None
    with pytest.raises(ck.ResumeError, match="incomplete"):
        ck.resolve_resume(str(ck.step_dir(tmp_path, 30)), tmp_path)
    with pytest.raises(ck.ResumeError, match="no such checkpoint"):
        ck.resolve_resume(str(tmp_path / "step-99"), tmp_path)


def test_prune_keeps_last_k_complete(tmp_path):
    for s in (1, 2, 3, 4):
        _fake(tmp_path, s)
    _fake(tmp_path, 5, complete=False)  # newer than all: a save in progress, kept
    _fake(tmp_path, 0, complete=False)  # stale partial, dropped
    ck.prune(tmp_path, keep_last=2)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [3, 4, 5]


def _meta(recipe, world=2, version=ck.FORMAT_VERSION):
    return {"format_version": version, "world_size": world, "recipe": recipe.to_dict()}


def test_compatible_resume_allows_logging_and_path_changes(tmp_path):
    a = recipe_from_dict({})
    b = recipe_from_dict(
        {
            "train": {"log_interval": 3},
            "checkpoint": {"keep_last": 9},
            "target": {"prefetch": 5},
            "tracking": {"run_name": "x"},
        }
    )
    ck.check_compatible(_meta(a), b, 2, tmp_path)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"objective": {"num_anchors": 7}}, "objective.num_anchors: 512 -> 7"),
        ({"optim": {"lr": 1e-3}}, "optim.lr"),
        ({"draft": {"block_size": 4}}, "draft.block_size"),
        ({"train": {"seed": 3}}, "train.seed"),
        ({"train": {"max_steps": 5}}, "train.max_steps"),
        ({"data": {"max_length": 100}}, "data.max_length"),
    ],
)
def test_resume_refuses_training_changes_naming_the_field(tmp_path, change, field):
    saved = recipe_from_dict({})
    with pytest.raises(ck.ResumeError) as e:
        ck.check_compatible(_meta(saved), recipe_from_dict(change), 2, tmp_path)
    assert field in str(e.value)


def test_resume_refuses_other_world_size_and_format(tmp_path):
    r = recipe_from_dict({})
    with pytest.raises(ck.ResumeError, match="world_size 2, resuming with 4"):
        ck.check_compatible(_meta(r, world=2), r, 4, tmp_path)
    with pytest.raises(ck.ResumeError, match="format_version 0"):
        ck.check_compatible(_meta(r, version=0), r, 2, tmp_path)


def test_rng_state_round_trip():
    import random

    import numpy as np
    import torch

    s = ck.rng_state()
    a = (torch.rand(3), np.random.rand(3), random.random())
    ck.set_rng_state(s)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and (a[1] == b[1]).all() and a[2] == b[2]
