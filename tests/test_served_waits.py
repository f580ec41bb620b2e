"""The trainer's waits on a served engine (engines/served.py), without a server: the
tickets say what the writer did (a writer error is a lost server, named with its slot
and reason at once; a refused request stops the run; a late writer's answer to an
earlier request is never this one's), the tickets get their own time after a reply, and a
rank that did not start its node's server sees it gone from the pid file."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from specforge_dspark.engines.served import ServedEngine
from specforge_dspark.transport.features import PaddedBatch, TargetLost, TargetRefused
from specforge_dspark.transport.request import issue_tickets
from specforge_dspark.transport.shm import ShmSlot
from specforge_dspark.transport.slot_writer import SlotAccess, write_features
from specforge_dspark.transport.tickets import DONE, FAILED, WRITER_FAILED


def test_the_trainer_never_takes_a_late_writers_answer_for_the_reissued_ticket():
    """A late writer's ticket record that lands in the window between its nonce check and
    its write (DONE, with the old nonce) is not this request's answer: the wait times out."""
    slot = ShmSlot("noncewait", aux_width=6, hidden=4, dtype=torch.float32)
    ids = torch.ones(1, 3, dtype=torch.long)
    batch = PaddedBatch([1], ids, ids, torch.tensor([3]))
    engine = _waiter(timeout_s=0.05)
    try:
        issue_tickets(slot, batch)
        late = slot.read_ticket(0)
        issue_tickets(slot, batch)
        late.status, late.written = DONE, 3
        off = slot.ticket_offset(0)
        slot.buf[off : off + len(late.pack())] = late.pack()  # not through write_ticket
        with pytest.raises(RuntimeError, match="wrote no features"):
            engine._wait_ticket(slot, 0, 3, time.monotonic() + 0.05, "batch 0")
    finally:
        slot.close()


def _waiter(timeout_s: float, pid_file=None, server_pid=None) -> ServedEngine:
    """A ServedEngine with only what the waits read: no server of its own (a rank that did
    not start it), `pid_file` naming the node's server of pid `server_pid`."""
    engine = object.__new__(ServedEngine)
    engine.engine, engine.keeper, engine.url = "sglang", None, "http://stand-in"
    engine.timeout_s = timeout_s
    engine.pid_file, engine._server_pid, engine._group_look_at = pid_file, server_pid, 0.0
    engine._wrote = True
    engine.api_key, engine.key_file = None, None  # a stand-in that asks for no key
    return engine


@pytest.mark.usefixtures("writer_maps")  # the writer's mappings closed after it
def test_a_writer_error_fails_the_ticket_and_the_trainer_counts_the_server_lost(monkeypatch):
    """Any error inside the writer (here a failed transfer) marks the ticket FAILED as the
    writer's, with the reason; the trainer raises TargetLost (restart, failover) naming
    the server, the slot and the reason, from the ticket, long before its deadline."""

    def transfer_fails(self, regions):
        raise RuntimeError("Mooncake write of 96 bytes failed (status -1)")

    monkeypatch.setattr(SlotAccess, "regions", transfer_fails)
    slot = ShmSlot("writerr", aux_width=6, hidden=4, dtype=torch.float32)
    try:
        _write_one(slot, aux_width=6)
        t = slot.read_ticket(0)
        reason = "RuntimeError: Mooncake write of 96 bytes failed (status -1)"
        assert t.status == FAILED and t.error == WRITER_FAILED + reason
        with pytest.raises(TargetLost) as e:  # a deadline an hour away: the ticket says it
            _waiter(timeout_s=3600)._wait_ticket(slot, 0, 3, time.monotonic() + 3600, "b 0")
        assert str(e.value) == (
            f"sglang server http://stand-in could not write b 0 into slot {slot.location}: "
            f"writer failed: {reason}"
        )
    finally:
        slot.close()


def test_a_request_the_writer_refuses_stops_the_run_instead():
    slot = ShmSlot("refused", aux_width=6, hidden=4, dtype=torch.float32)
    try:
        _write_one(slot, aux_width=5)  # the trainer's slot is 6 wide
        with pytest.raises(RuntimeError, match="aux width 5 / hidden 4, trainer expects 6") as e:
            _waiter(timeout_s=3600)._wait_ticket(slot, 0, 3, time.monotonic() + 3600, "b 0")
        assert not isinstance(e.value, TargetLost)
    finally:
        slot.close()


@pytest.mark.usefixtures("writer_maps")  # the writer's mappings closed after it
def test_a_reply_at_the_deadline_still_leaves_the_writer_time(monkeypatch):
    """The reply comes when the deadline has already passed (a loaded server) and the
    writer rank writes a moment later: the tickets get their own allowance after the
    reply, so the features are taken, not refused for the reply's lateness."""
    slot = ShmSlot("replylate", aux_width=6, hidden=4, dtype=torch.float32)
    ids = torch.ones(1, 3, dtype=torch.long)
    batch = PaddedBatch([1], ids, ids, torch.tensor([3]))
    engine = _waiter(timeout_s=5.0)
    engine.slots, engine.slot_open, engine._ready, engine.dtype = (
        [slot],
        [False],
        True,
        torch.float32,
    )
    reply: Future = Future()
    reply.set_result([{"meta_info": {"finish_reason": {"type": "length"}}}])
    engine.futures = {0: reply}
    try:
        issue_tickets(slot, batch)
        nonce, rows = slot.read_ticket(0).nonce, torch.arange(18.0).view(3, 6)
        writer = threading.Timer(
            0.2, write_features, (str(slot.path), 0, nonce, 0, rows, torch.ones(3, 4))
        )
        writer.start()
        feats = engine.result(0, batch, deadline=time.monotonic() - 1.0)  # already passed
        writer.join()
        assert torch.equal(feats.aux_hidden[0], rows)
    finally:
        slot.close()


def test_a_rank_with_only_the_pid_file_sees_the_servers_group_killed(tmp_path):
    """The rank waits on a request to the node's server, which another rank started: its
    process group (a stand-in) is killed, and the wait ends with TargetLost naming it,
    not at the deadline an hour away. A pid file naming another server says replaced."""
    group = subprocess.Popen(["sleep", "600"], start_new_session=True)
    pid_file = tmp_path / "sglang_server_rank0.pid"
    pid_file.write_text(str(group.pid))
    engine = _waiter(3600, pid_file, group.pid)
    try:
        engine._check_server("the wait")  # alive: nothing
        os.killpg(group.pid, signal.SIGKILL)
        group.wait()
        with pytest.raises(TargetLost, match=rf"\(pid {group.pid}\) is gone: its process group"):
            engine._wait_reply(Future(), time.monotonic() + 3600, "batch 0")
        pid_file.write_text(str(os.getpid()))
        engine._group_look_at = 0.0
        with pytest.raises(TargetLost, match=rf"was replaced by pid {os.getpid()}"):
            engine._check_server("the wait")
    finally:
        group.kill()
        group.wait()


def test_a_rank_that_did_not_start_the_server_sees_its_first_start_fail_at_once(tmp_path):
    """The node's server exits while loading (its pid file current, its group gone): the
    other ranks end with TargetRefused naming it and its log's end, not after
    startup_timeout_s (an hour here)."""
    group = subprocess.Popen(["sleep", "600"], start_new_session=True)
    group.kill()
    group.wait()
    pid_file = tmp_path / "sglang_server_rank0.pid"
    pid_file.write_text(str(group.pid))
    engine = _waiter(3600, pid_file)
    engine.url, engine.startup_timeout_s, engine._ready = "http://127.0.0.1:9", 3600.0, False
    engine._wrote, engine.log_path = False, tmp_path / "sglang_server_rank0.log"
    engine.log_path.write_text("loading weights\ntorch.OutOfMemoryError: CUDA out of memory\n")
    with pytest.raises(TargetRefused) as e:
        engine.wait_ready()
    assert str(e.value).startswith(
        "sglang server http://127.0.0.1:9 never answered once, so a retry would fail the same "
        f"way (check target.sglang.server_args, its memory, its install): sglang server "
        f"http://127.0.0.1:9 (pid {group.pid}) exited in start-up; last log lines "
        f"({engine.log_path}):\nloading weights\ntorch.OutOfMemoryError"
    )


def _write_one(slot: ShmSlot, aux_width: int) -> None:
    """Issue one 3-token request in `slot` and have the writer hand it rows of
    `aux_width` aux columns (and hidden 4), as a server does."""
    ids = torch.ones(1, 3, dtype=torch.long)
    issue_tickets(slot, PaddedBatch([1], ids, ids, torch.tensor([3])))
    nonce = slot.read_ticket(0).nonce
    write_features(str(slot.path), 0, nonce, 0, torch.ones(3, aux_width), torch.ones(3, 4))
