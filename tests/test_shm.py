"""Shared-memory slots: a /dev/shm too small for the run fails at start-up, naming the
size it needs and how to raise it; slots grow by doubling but never past the run's
largest request. Producers map a slot once and keep it (SlotMaps), mapping it again when
the trainer replaced the file. A late writer (stale nonce) writes nothing, and one already
past its nonce check reaches only the file (or Mooncake registration) the re-sent request
no longer uses. Without CUDA
nothing is page-locked and TargetFeatures.to is a plain copy; a failed cudaHostRegister
(mocked) leaves no CUDA error behind; with CUDA (skipped here) the copy is asynchronous
and the slot waits for it before it is rewritten. Budget and ragged layout:
test_slot_budget.py."""

from __future__ import annotations

import os
from collections import namedtuple

import pytest
import torch

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.transport import features, pinning, shm, slot_budget
from specforge_dspark.transport.features import PaddedBatch, TargetFeatures
from specforge_dspark.transport.request import issue_tickets
from specforge_dspark.transport.shm import DTYPE_CODES, ShmSlot, SlotLayout
from specforge_dspark.transport.slot_budget import make_slots
from specforge_dspark.transport.slot_writer import SlotAccess, fail, write_features
from specforge_dspark.transport.tickets import DONE, PENDING, Ticket

Usage = namedtuple("Usage", "total used free")


def _recipe(max_length: int = 4096, micro: int = 1):
    return recipe_from_dict(
        {"data": {"max_length": max_length}, "train": {"micro_batch_size": micro}}
    )


pytestmark = pytest.mark.usefixtures("writer_maps")  # pinning tests find nothing left over


def test_too_small_shm_fails_at_start_up_with_the_size_needed(monkeypatch):
    monkeypatch.setattr(
        slot_budget.shutil, "disk_usage", lambda p: Usage(2**30, 2**30 - 2**20, 2**20)
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    # 2 x 4096 tokens; 4 sequences: the preflight's batch of train.preflight_samples rows
    per_slot = SlotLayout.plan(2 * 4096, 4, 5 * 6144, 6144, torch.bfloat16).nbytes
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
        s.prepare([60])
        assert s.layout.capacity == 60
        s.prepare([70])  # doubling would give 120 > the 100 a request can need
        assert s.layout.capacity == 100
    finally:
        for s in slots:
            s.close()


def _ticketed(slot: ShmSlot, S: int, nonce: int = 7) -> None:
    lay = slot.layout
    code = DTYPE_CODES[slot.dtype]
    t = Ticket(PENDING, S, 0, lay.aux_off, lay.last_off, lay.aux_width, 4, code, nonce=nonce)
    slot.write_ticket(0, t)


def test_a_producer_maps_a_slot_once_and_again_when_the_file_is_replaced(writer_maps):
    maps = writer_maps
    slot = ShmSlot("mapstest", aux_width=6, hidden=4, dtype=torch.float32)
    try:
        views = slot.prepare([3])
        for i in range(5):
            _ticketed(slot, 3)
            write_features(str(slot.path), 0, 7, 0, torch.full((3, 6), i), torch.full((3, 4), -i))
            assert slot.read_ticket(0).status == DONE
            assert views.aux.eq(i).all() and views.last.eq(-i).all()
        assert maps.mapped == 1
        path = slot.path  # the trainer restarts: a new, larger file at the same path
        slot.close()
        slot.prepare([8])
        slot.path.rename(path)
        slot.path = path
        views = slot.prepare([8])
        _ticketed(slot, 8)
        write_features(str(path), 0, 7, 0, torch.full((8, 6), 7.0), torch.full((8, 4), 8.0))
        assert maps.mapped == 2 and slot.read_ticket(0).status == DONE
        assert views.aux.eq(7).all() and views.last.eq(8).all()
        slot.close()  # gone: dropped, and a write to it fails without raising
        write_features(str(path), 0, 7, 0, torch.zeros(8, 6), torch.zeros(8, 4))
        assert maps.mapped == 2 and not maps._maps
    finally:
        slot.close()
        maps.close()


def test_a_window_keeps_only_its_rows_of_every_chunk():
    """A request for positions [3, 8) (a rank's slice, PaddedBatch.window): the slot has
    room for those rows alone; chunks of a split prefill (rows [0, 4), [4, 10)) land where
    their window rows go, the rest dropped; the ticket is done once every position was
    prefilled, also for a sequence the window misses (length 2)."""
    from specforge_dspark.transport.request import slot_features

    slot = ShmSlot("windowtest", aux_width=6, hidden=4, dtype=torch.float32)
    ids = torch.zeros(3, 10, dtype=torch.long)
    batch = PaddedBatch([1, 2, 3], ids, ids, torch.tensor([10, 6, 2]), window=(3, 5))
    try:
        views = issue_tickets(slot, batch)
        assert views.lengths == [5, 3, 0] and slot.layout.capacity == 8
        path = str(slot.path)
        rows = torch.arange(10, dtype=torch.float32)[:, None]  # row r holds r
        for b, n in enumerate([10, 6, 2]):
            nonce = slot.read_ticket(b).nonce
            for a, z in ((0, min(4, n)), (4, n)):
                if a < z:
                    aux, last = rows[a:z].expand(-1, 6) + 100 * b, rows[a:z].expand(-1, 4)
                    write_features(path, b, nonce, a, aux, -last)
            t = slot.read_ticket(b)
            assert (t.status, t.written, t.window) == (DONE, n, (3, [5, 3, 0][b]))
        f = slot_features(views, batch, torch.float32)
        assert f.row0 == 3 and f.aux_hidden.shape == (3, 5, 6) and f.last_hidden.shape == (3, 5, 4)
        assert f.aux_hidden[0, :, 0].tolist() == [3, 4, 5, 6, 7]
        assert f.aux_hidden[1, :, 0].tolist() == [103, 104, 105, 0, 0]
        assert f.last_hidden[1, :, 0].tolist() == [-3, -4, -5, 0, 0]
        assert not f.aux_hidden[2].any()
    finally:
        slot.close()


def test_a_late_writer_after_a_timeout_and_slot_reuse_writes_nothing(monkeypatch):
    slot = ShmSlot("noncetest", aux_width=6, hidden=4, dtype=torch.float32)
    ids = torch.ones(1, 3, dtype=torch.long)
    batch = PaddedBatch([1], ids, ids, torch.tensor([3]))
    try:
        issue_tickets(slot, batch)
        stale = slot.read_ticket(0).nonce
        views = issue_tickets(slot, batch)  # timed out: the slot goes to the next request
        issued = slot.read_ticket(0)
        assert issued.nonce != stale and issued.status == PENDING
        path = str(slot.path)
        write_features(path, 0, stale, 0, torch.full((3, 6), 9.0), torch.full((3, 4), 9.0))
        fail(path, 0, stale, "the late request failed")
        assert slot.read_ticket(0) == issued and views.aux.eq(0).all() and views.last.eq(0).all()
        write_features(path, 0, issued.nonce, 0, torch.full((3, 6), 2.0), torch.full((3, 4), 2.0))
        done = slot.read_ticket(0)
        assert done.status == DONE and done.written == 3
        write_features(path, 0, stale, 0, torch.full((3, 6), 9.0), torch.full((3, 4), 9.0))
        fail(path, 0, stale, "the late request failed")
        assert slot.read_ticket(0) == done and views.aux.eq(2).all() and views.last.eq(2).all()
    finally:
        slot.close()


def test_a_late_writer_cannot_change_a_byte_of_the_slot_the_resent_request_uses(monkeypatch):
    """A writer paused inside its copy (slot mapped, ticket read, nonce checked) resumes
    after the trainer gave up and re-sent the request: the re-send went to a fresh file
    (`fresh`, what ServedEngine.submit asks for a slot not taken back), so the writer's
    rows and ticket land only in the old one."""
    slot = ShmSlot("latewriter", aux_width=6, hidden=4, dtype=torch.float32)
    ids = torch.ones(2, 3, dtype=torch.long)
    batch = PaddedBatch([1, 2], ids, ids, torch.tensor([3, 3]))
    try:
        issue_tickets(slot, batch)
        old = str(slot.path)
        paused = SlotAccess(old)  # the writer, paused after its nonce check
        t = paused.ticket(1)
        views = issue_tickets(slot, batch, fresh=True)  # the re-send
        assert str(slot.path) != old and not os.path.exists(old)
        issued, before = slot.read_ticket(1), bytes(slot.buf)
        regions = [(t.aux_off, torch.float32, (3, 6)), (t.last_off, torch.float32, (3, 4))]
        with paused.regions(regions) as rows:
            for r in rows:
                r.fill_(9.0)
        t.status, t.written = DONE, 3
        paused.put_ticket(1, t)
        assert bytes(slot.buf) == before and slot.read_ticket(1) == issued
        assert views.aux.eq(0).all() and paused.ticket(1).status == DONE  # it went to the old
    finally:
        slot.close()


class _Exposer:
    """Stand-in for mooncake.Exposer: which mappings are registered, by location."""

    def __init__(self):
        self.registered: dict[str, object] = {}

    def expose(self, buf) -> str:
        location = f"mooncake://tcp@127.0.0.1:1/{pinning.buffer_address(buf):x}/{len(buf)}"
        self.registered[location] = buf
        return location

    def withdraw(self, location: str) -> None:
        del self.registered[location]


def test_a_renewed_mooncake_slot_withdraws_the_old_registration_and_keeps_its_mapping():
    """No late transfer lands in memory the slot uses again: the old registration is
    withdrawn at once, its mapping kept (so its addresses are not handed out again) until
    close."""
    exposer = _Exposer()
    slot = ShmSlot("renew", aux_width=6, hidden=4, dtype=torch.float32, exposer=exposer)
    try:
        slot.prepare([3])
        old, old_buf = slot.location, slot.buf
        slot.prepare([3], fresh=True)
        assert list(exposer.registered) == [slot.location] and slot.location != old
        assert slot.retired == [old_buf] and not old_buf.closed
        old_buf[0:4] = b"late"  # a late transfer into the retired mapping harms nothing
        slot.prepare([3])  # taken back: the same file
        assert list(exposer.registered) == [slot.location]
    finally:
        slot.close()
    assert not exposer.registered and old_buf.closed and not slot.retired


class _Runtime:
    """The CUDA runtime calls pin() makes, with the runtime's per-thread last error."""

    def __init__(self, register_error: int):
        self.register_error, self.last_error, self.registered = register_error, 0, []

    def cudaHostRegister(self, addr, nbytes, flags):  # the runtime's names
        self.last_error = self.register_error
        if not self.register_error:
            self.registered.append(addr)
        return self.register_error

    def cudaHostUnregister(self, addr):
        self.registered.remove(addr)
        return 0

    def cudaGetLastError(self):
        error, self.last_error = self.last_error, 0
        return error


@pytest.mark.parametrize("error", [0, 712])  # 712: cudaErrorHostMemoryAlreadyRegistered
def test_a_failed_cuda_host_register_leaves_no_cuda_error_behind(monkeypatch, caplog, error):
    runtime = _Runtime(error)
    monkeypatch.setattr(shm.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinning.torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(pinning, "_cuda_runtime", lambda: runtime)
    slot = ShmSlot("registertest", aux_width=6, hidden=4, dtype=torch.float32)
    try:
        slot.prepare([3])
        assert bool(slot.pinned) == (error == 0) and len(runtime.registered) == (error == 0)
        assert runtime.cudaGetLastError() == 0  # what the next kernel launch check reads
        if error:
            assert "failed (error 712; last error cleared)" in caplog.text
    finally:
        slot.close()
    assert not runtime.registered and not pinning._PINNED


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine loads the CUDA runtime")
def test_without_a_cuda_runtime_loaded_there_is_no_error_to_clear():
    assert pinning.clear_cuda_error() == -1


def test_without_cuda_nothing_is_pinned_and_to_is_a_plain_copy(monkeypatch):
    monkeypatch.setattr(shm.torch.cuda, "is_available", lambda: False)
    slot = ShmSlot("pintest", aux_width=6, hidden=4, dtype=torch.bfloat16)
    try:
        v = slot.prepare([3, 3])
        assert slot.pinned == 0 and not pinning._PINNED
        v.aux.copy_(torch.randn(6, 6))
        v.last.copy_(torch.randn(6, 4))
        ids = torch.arange(6).view(2, 3)
        aux, last = v.padded(3)  # equal lengths: views of the slot
        feats = TargetFeatures([4, 5], ids, ids.ne(0), torch.tensor([3, 3]), aux, last)
        monkeypatch.setattr(features, "_to_gpu", lambda *a: pytest.fail("no async copy on CPU"))
        moved = feats.to("cpu", non_blocking=True)
        assert moved.copy_done is None and moved.sample_ids == [4, 5]
        for name in ("input_ids", "loss_mask", "lengths", "aux_hidden", "last_hidden"):
            a, b = getattr(moved, name), getattr(feats, name)
            assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
        assert moved.aux_hidden.data_ptr() == v.aux.data_ptr()  # Tensor.to: same storage
    finally:
        slot.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_with_cuda_slots_are_pinned_and_the_copy_is_asynchronous():
    slot = ShmSlot("cudatest", aux_width=6, hidden=4, dtype=torch.bfloat16)
    try:
        v = slot.prepare([5])
        assert slot.pinned and v.aux.is_pinned()
        v.aux.copy_(torch.randn(5, 6))
        v.last.copy_(torch.randn(5, 4))
        ids = torch.ones(1, 5, dtype=torch.long)
        aux, last = v.padded(5)
        feats = TargetFeatures([0], ids, ids, torch.tensor([5]), aux, last)
        moved = feats.to("cuda")
        assert moved.copy_done is not None and pinning._PINNED[slot.pinned][1]
        assert torch.equal(moved.aux_hidden.cpu(), aux)
        slot.prepare([5])  # waits for the copy before the slot may be rewritten
        assert moved.copy_done.query() and not pinning._PINNED[slot.pinned][1]
    finally:
        slot.close()
    assert not pinning._PINNED
