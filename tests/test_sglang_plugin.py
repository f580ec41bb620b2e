"""The SGLang plugin's writers, without a server: every attention-TP rank of a fake
`sglang.srt.runtime_context` runs the hook on the same rows; each request is written by
exactly one rank (all of its chunks by the same one), and a server whose ranks cannot be
read fails the ticket saying so instead of letting every rank write."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from specforge_dspark.engines import sglang_plugin as plugin
from specforge_dspark.transport import slot_writer
from specforge_dspark.transport.shm import DTYPE_CODES, ShmSlot
from specforge_dspark.transport.tickets import DONE, FAILED, PENDING, Ticket

D, H, TP = 6, 2, 4
FULL = SimpleNamespace(is_full=lambda: True, is_last=lambda: False)


def _fake_context(monkeypatch, parallel) -> None:
    """Install a fake runtime_context whose get_parallel() returns `parallel()` (or raises)."""
    module = ModuleType("sglang.srt.runtime_context")
    module.get_parallel = parallel
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", module)
    monkeypatch.setattr(plugin, "_in_sglang", True)


NONCE = 5  # the nonce of every ticket here (the rids carry it)


def _slot(tickets: list[int]) -> ShmSlot:
    """A slot with one pending ticket per entry of `tickets` (its row count), ragged."""
    slot = ShmSlot("plugintest", aux_width=D, hidden=H, dtype=torch.float32)
    views = slot.prepare(tickets)
    code = DTYPE_CODES[torch.float32]
    for b, rows in enumerate(tickets):
        t = Ticket(PENDING, rows, 0, *views.offsets(b), D, H, code, nonce=NONCE)
        slot.write_ticket(b, t)
    return slot


def _run_hook(rid: str, rows_ND: torch.Tensor, row0: int, store: bool) -> None:
    """One request's rows [row0, row0 + N) through the hook, as one forward of SGLang."""
    n = rows_ND.shape[0]
    out = SimpleNamespace(hidden_states=rows_ND[:, :D], last_hidden_states=rows_ND[:, D:])
    req = SimpleNamespace(rid=rid, inflight_middle_chunks=int(not store), extend_end=row0 + n)
    end = plugin.append_prefill_hidden_states(
        None,
        None,
        req=req,
        logits_output=out,
        hidden_state_offset=0,
        capture_hidden_mode=FULL,
        extend_input_len=n,
        store=store,
    )
    assert end == n


def test_each_request_is_written_by_exactly_one_tp_rank(monkeypatch):
    rank = {"now": 0}
    _fake_context(monkeypatch, lambda: SimpleNamespace(attn_tp_rank=rank["now"], attn_tp_size=TP))
    writers: dict[int, list[int]] = {}
    real = plugin.write_features

    def counting(path, ticket, nonce, row0, aux_ND, last_NH):
        writers.setdefault(ticket, []).append(rank["now"])
        real(path, ticket, nonce, row0, aux_ND, last_NH)

    monkeypatch.setattr(plugin, "write_features", counting)
    lengths = [5] * 16
    slot = _slot(lengths)
    try:
        rows = torch.randn(5, D + H)
        rids = [plugin.make_rid(NONCE, b, str(slot.path)) for b in range(len(lengths))]
        for b, rid in enumerate(rids):  # two chunks: [0, 2) (middle) and [2, 5)
            for r in range(TP):
                rank["now"] = r
                _run_hook(rid, rows[:2], 0, store=False)
                _run_hook(rid, rows[2:], 2, store=True)
            mine = plugin.writer_rank(rid, TP)
            assert writers[b] == [mine, mine], f"ticket {b}: writers {writers[b]}"
            t = slot.read_ticket(b)
            assert t.status == DONE and t.written == 5
            aux_ND, last_NH = slot.views(lengths).rows(b)
            assert torch.equal(aux_ND, rows[:, :D]) and torch.equal(last_NH, rows[:, D:])
        assert len({plugin.writer_rank(rid, TP) for rid in rids}) > 1  # shared, not rank 0
    finally:
        slot.close()


def test_a_server_that_cannot_read_its_ranks_fails_the_ticket(monkeypatch):
    def unpublished():
        raise RuntimeError("parallel name 'attn_tp_rank' has not been written in this process")

    _fake_context(monkeypatch, unpublished)
    slot = _slot([3])
    try:
        _run_hook(plugin.make_rid(NONCE, 0, str(slot.path)), torch.ones(3, D + H), 0, store=True)
        t = slot.read_ticket(0)
        assert t.status == FAILED and t.written == 0
        assert "cannot read its attention-TP rank" in t.error
        assert "attn_tp_rank' has not been written" in t.error
        monkeypatch.delitem(sys.modules, "sglang.srt.runtime_context")
        slot.write_ticket(0, Ticket(PENDING, 3, 0, *_offsets(slot), nonce=NONCE))
        _run_hook(plugin.make_rid(NONCE, 0, str(slot.path)), torch.ones(3, D + H), 0, store=True)
        t = slot.read_ticket(0)
        assert t.status == FAILED and "runtime_context is not loaded" in t.error
    finally:
        slot.close()


def test_outside_sglang_the_caller_writes(monkeypatch):
    monkeypatch.setattr(plugin, "_in_sglang", False)
    slot = _slot([3])
    try:
        _run_hook(plugin.make_rid(NONCE, 0, str(slot.path)), torch.ones(3, D + H), 0, store=True)
        assert slot.read_ticket(0).status == DONE
    finally:
        slot.close()


def _offsets(slot: ShmSlot) -> tuple[int, ...]:
    lay = slot.layout
    return lay.aux_off, lay.last_off, D, H, DTYPE_CODES[torch.float32]


@pytest.fixture(autouse=True)
def _fresh_mappings():
    yield
    slot_writer.SLOTS.close()
