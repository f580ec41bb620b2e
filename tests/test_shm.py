"""Shared-memory slots: a /dev/shm too small for the run fails at start-up, naming the
size it needs and how to raise it; slots grow by doubling but never past the run's
largest request. Producers map a slot once and keep it (SlotMaps), mapping it again when
the trainer replaced the file. Without CUDA nothing is page-locked and
TargetFeatures.to is a plain copy; with CUDA (skipped here) the copy is asynchronous and
the slot waits for it before it is rewritten."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.engines import features, shm
from specforge_dspark.engines.features import TargetFeatures
from specforge_dspark.engines.shm import DTYPE_CODES, ShmSlot, SlotLayout, SlotMaps, make_slots
from specforge_dspark.engines.slot_writer import write_features
from specforge_dspark.engines.tickets import DONE, PENDING, Ticket

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


def _ticketed(slot: ShmSlot, S: int) -> None:
    lay = slot.layout
    code = DTYPE_CODES[slot.dtype]
    slot.write_ticket(0, Ticket(PENDING, S, 0, lay.aux_off, lay.last_off, lay.aux_width, 4, code))


def test_a_producer_maps_a_slot_once_and_again_when_the_file_is_replaced(monkeypatch):
    maps = SlotMaps()
    monkeypatch.setattr("specforge_dspark.engines.slot_writer.SLOTS", maps)
    slot = ShmSlot("mapstest", aux_width=6, hidden=4, dtype=torch.float32)
    try:
        views = slot.prepare(1, 3)
        for i in range(5):
            _ticketed(slot, 3)
            write_features(str(slot.path), 0, 0, torch.full((3, 6), i), torch.full((3, 4), -i))
            assert slot.read_ticket(0).status == DONE
            assert views.aux_hidden[0].eq(i).all() and views.last_hidden[0].eq(-i).all()
        assert maps.mapped == 1
        path = slot.path  # the trainer restarts: a new, larger file at the same path
        slot.close()
        slot.prepare(1, 8)
        slot.path.rename(path)
        slot.path = path
        views = slot.prepare(1, 8)
        _ticketed(slot, 8)
        write_features(str(path), 0, 0, torch.full((8, 6), 7.0), torch.full((8, 4), 8.0))
        assert maps.mapped == 2 and slot.read_ticket(0).status == DONE
        assert views.aux_hidden[0].eq(7).all() and views.last_hidden[0].eq(8).all()
        slot.close()  # gone: dropped, and a write to it fails without raising
        write_features(str(path), 0, 0, torch.zeros(8, 6), torch.zeros(8, 4))
        assert maps.mapped == 2 and not maps._maps
    finally:
        slot.close()
        maps.close()


def test_without_cuda_nothing_is_pinned_and_to_is_a_plain_copy(monkeypatch):
    monkeypatch.setattr(shm.torch.cuda, "is_available", lambda: False)
    slot = ShmSlot("pintest", aux_width=6, hidden=4, dtype=torch.bfloat16)
    try:
        v = slot.prepare(2, 3)
        assert slot.pinned == 0 and not shm._PINNED
        v.aux_hidden.copy_(torch.randn(2, 3, 6))
        v.last_hidden.copy_(torch.randn(2, 3, 4))
        ids = torch.arange(6).view(2, 3)
        feats = TargetFeatures(
            [4, 5], ids, ids.ne(0), torch.tensor([3, 2]), v.aux_hidden, v.last_hidden
        )
        monkeypatch.setattr(features, "_to_gpu", lambda *a: pytest.fail("no async copy on CPU"))
        moved = feats.to("cpu", non_blocking=True)
        assert moved.copy_done is None and moved.sample_ids == [4, 5]
        for name in ("input_ids", "loss_mask", "lengths", "aux_hidden", "last_hidden"):
            a, b = getattr(moved, name), getattr(feats, name)
            assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
        assert moved.aux_hidden.data_ptr() == v.aux_hidden.data_ptr()  # Tensor.to: same storage
    finally:
        slot.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_with_cuda_slots_are_pinned_and_the_copy_is_asynchronous():
    slot = ShmSlot("cudatest", aux_width=6, hidden=4, dtype=torch.bfloat16)
    try:
        v = slot.prepare(1, 5)
        assert slot.pinned and v.aux_hidden.is_pinned()
        v.aux_hidden.copy_(torch.randn(1, 5, 6))
        v.last_hidden.copy_(torch.randn(1, 5, 4))
        ids = torch.ones(1, 5, dtype=torch.long)
        feats = TargetFeatures([0], ids, ids, torch.tensor([5]), v.aux_hidden, v.last_hidden)
        moved = feats.to("cuda")
        assert moved.copy_done is not None and shm._PINNED[slot.pinned][1]
        assert torch.equal(moved.aux_hidden.cpu(), v.aux_hidden)
        slot.prepare(1, 5)  # waits for the copy before the slot may be rewritten
        assert moved.copy_done.query() and not shm._PINNED[slot.pinned][1]
    finally:
        slot.close()
    assert not shm._PINNED
