"""One request's trainer side, whatever the served engine: issue its tickets in a slot
(tickets.py, shm.py), check the server's reply, and say where a server had to write when
nothing came (served.py waits for both)."""

from __future__ import annotations

from typing import Any

import torch

from specforge_dspark.transport.features import PaddedBatch, TargetFeatures
from specforge_dspark.transport.shm import DTYPE_CODES, ShmSlot, SlotViews
from specforge_dspark.transport.tickets import (
    DONE,
    FAILED,
    PENDING,
    WRITER_FAILED,
    Ticket,
    new_nonce,
)


def issue_tickets(slot: ShmSlot, batch: PaddedBatch, fresh: bool = False) -> SlotViews:
    """Fit `slot` to `batch` (ValueError, nothing written, when it is over the run's slot
    budget; `fresh`: in a new file, ShmSlot.prepare) and issue a pending ticket per
    sequence with a fresh nonce: its positions, the window of them the slot holds
    (`batch.window`: the rows of [lo, lo + W) only), and where those rows go (ragged:
    sequence b's rows follow those of sequences 0..b-1, shm.py)."""
    views = slot.prepare(batch.window_rows(), fresh)
    lay = slot.layout
    code = DTYPE_CODES[lay.dtype]
    lo = 0 if batch.window is None else batch.window[0]
    for b, (n, count) in enumerate(zip(batch.lengths.tolist(), views.lengths, strict=True)):
        aux_off, last_off = views.offsets(b)
        ticket = Ticket(PENDING, n, 0, aux_off, last_off, lay.aux_width, lay.hidden, code)
        ticket.nonce, ticket.lo, ticket.count = new_nonce(), lo, count
        slot.write_ticket(b, ticket)
    return views


def slot_features(views: SlotViews, batch: PaddedBatch, dtype: torch.dtype) -> TargetFeatures:
    """`batch`'s features from the written rows of `views`, padded to the batch (views of
    the slot when every length is the same), the last hidden rows in `dtype`
    (target.dtype). fp8 aux rows stay fp8 beside their scales: `TargetFeatures.to`
    dequantizes them where they land (on the GPU after an asynchronous copy). With a
    window (`batch.window`) the rows are [lo, lo + W) of each sequence, row0 = lo."""
    rows = batch.shape[1] if batch.window is None else batch.window[1]
    aux, last = views.padded(rows)
    return TargetFeatures(
        batch.sample_ids,
        batch.input_ids,
        batch.loss_mask,
        batch.lengths,
        aux,
        last.to(dtype),
        aux_scale=views.padded_scale(rows),
        row0=None if batch.window is None else batch.window[0],
    )


def check_reply(reply: Any, name: str, what: str) -> None:
    """RuntimeError when the server's reply (one JSON object or a list of them) says it
    refused or aborted the request."""
    outputs = reply if isinstance(reply, list) else [reply]
    for out in outputs:
        if not isinstance(out, dict) or "error" in out:
            raise RuntimeError(f"{name} refused {what}: {str(out)[:500]}")
        finish = (out.get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            raise RuntimeError(f"{name} aborted {what}: {finish.get('message')}")


LATE_HINT = (
    ": it wrote features before, so a writer rank died, stalled or could not reach the slot "
    "(its log names the failure)"
)


def reach_hint(slot: ShmSlot) -> str:
    """With Mooncake, where the server had to write (what to check when nothing came)."""
    exposer = slot.exposer
    if exposer is None:
        return ""
    return (
        f"; with target.transport=mooncake the server writes to this rank at "
        f"{exposer.peer} ({exposer.protocol}): can it reach that address "
        "(target.mooncake.host)? its log names the failed transfer"
    )


def ticket_state(slot: ShmSlot, b: int, rows: int) -> tuple[str, str]:
    """Sequence b's ticket now, with the writer's reason: ("done", "") once all `rows`
    rows are written; ("lost", reason) when the writer failed (tickets.WRITER_FAILED: the
    server is counted lost); ("refused", reason) when it refused the request (its rows
    disagree with it); else ("pending", ""), also for a late writer's answer to an earlier
    request (another nonce than the one issued)."""
    t = slot.read_ticket(b)
    if t is None or t.nonce != slot.issued.get(b):
        return "pending", ""
    if t.status == DONE and t.written == rows:
        return "done", ""
    if t.status == FAILED:
        return ("lost" if t.error.startswith(WRITER_FAILED) else "refused"), t.error
    return "pending", ""
