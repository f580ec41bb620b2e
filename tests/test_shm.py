"""Shared-memory slots: a /dev/shm too small for the run fails at start-up, naming the
size it needs and how to raise it; slots grow by doubling but never past the run's
largest request."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from specforge_dspark.engines import shm
from specforge_dspark.engines.shm import SlotLayout, make_slots
from specforge_dspark.recipe import recipe_from_dict

Usage = namedtuple("Usage", "total used free")


def _recipe(max_length: int = 4096, micro: int = 1):
    return recipe_from_dict(
        {"data": {"max_length": max_length}, "train": {"micro_batch_size": micro}}
    )


def test_too_small_shm_fails_at_start_up_with_the_size_needed(monkeypatch):
    monkeypatch.setattr(shm.shutil, "disk_usage", lambda p: Usage(2**30, 2**30 - 2**20, 2**20))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    per_slot = SlotLayout.plan(2 * 4096, 2, 5 * 6144, 6144, torch.bfloat16).nbytes
    need = 8 * 5 * per_slot / 2**30
    with pytest.raises(RuntimeError) as e:
        make_slots(0, 5, 5 * 6144, 6144, torch.bfloat16, _recipe(micro=2))
    msg = str(e.value)
    assert f"need {need:.2f} GiB in {shm.SHM_DIR}" in msg and "8 rank(s) x 5 slots" in msg
    assert "--shm-size" in msg and "0.00 GiB free" in msg


def test_slots_that_fit_are_made_and_growth_stops_at_the_largest_request():
    slots = make_slots(0, 2, 6, 4, torch.float32, _recipe(max_length=100))
    try:
        s = slots[0]
        s.prepare(1, 60)
        assert s.layout.capacity == 60
        s.prepare(1, 70)  # doubling would give 120 > the 100 a request can need
        assert s.layout.capacity == 100
    finally:
        for s in slots:
            s.close()
