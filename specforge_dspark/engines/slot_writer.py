"""The producer side of a slot: an engine's process copies one request's rows in and
answers its ticket.

Called inside the engine's server (the SGLang plugin's hook, the vLLM connector's worker)
with the slot path and ticket index the trainer put in the request. `SLOTS` keeps each
slot mapped once per process (page-locked on CUDA, shm.SlotMaps), so the device-to-host
copy is one DMA into the slot. A request's rows may arrive in chunks (a split prefill):
each lands at its offset in the sequence, and the ticket turns DONE once all of them are
there. Nothing here raises into the engine: a failure goes to the trainer through the
ticket (FAILED, with the reason), and the server keeps serving.

Imports only torch, the standard library, shm.py and tickets.py: it is installed with
`--no-deps` in each engine's own environment.
"""

from __future__ import annotations

import logging

import torch

from specforge_dspark.engines.shm import CODE_DTYPES, SlotMaps, view
from specforge_dspark.engines.tickets import DONE, FAILED, PENDING, TICKET_SIZE, Ticket

logger = logging.getLogger(__name__)

SLOTS = SlotMaps()  # this process's slot mappings, kept open


def write_features(path: str, ticket: int, row0: int | None, aux_ND, last_NH) -> None:
    """Copy one request's rows [row0, row0 + N) into its slot and update the ticket:
    done once all of its rows are written (row0 None: right after those written so far).
    Never raises."""
    try:
        buf, layout = SLOTS.get(path)
        off = layout.tickets_off + ticket * TICKET_SIZE
        t = Ticket.unpack(buf, off)
        if t is None:
            raise RuntimeError(f"no ticket {ticket} in {path}")
        if row0 is None:
            row0 = t.written
        rows = aux_ND.shape[0]
        problem = _check(t, row0, aux_ND, last_NH)
        if problem:
            t.status, t.error = FAILED, problem
        elif t.status != FAILED:
            dtype = CODE_DTYPES[t.dtype_code]
            item = torch.empty((), dtype=dtype).element_size()
            aux_off = t.aux_off + row0 * t.aux_width * item
            last_off = t.last_off + row0 * t.hidden * item
            view(buf, dtype, aux_off, (rows, t.aux_width)).copy_(aux_ND)
            view(buf, dtype, last_off, (rows, t.hidden)).copy_(last_NH)
            t.written = row0 + rows
            t.status = DONE if t.written == t.rows else PENDING
        buf[off : off + TICKET_SIZE] = t.pack()
    except Exception:
        logger.exception("specforge_dspark: could not hand features to %s", path)


def _check(t: Ticket, row0: int, aux_ND, last_NH) -> str:
    rows = aux_ND.shape[0]
    if last_NH is None:
        return "server returned no last hidden states (--enable-return-aux-hidden-states off?)"
    if row0 != 0 and row0 != t.written:
        return (
            f"server sent rows [{row0}, {row0 + rows}) of {t.rows} after only {t.written} "
            "were written (a prefix cache hit? pass --disable-radix-cache)"
        )
    if row0 + rows > t.rows:
        return (
            f"server prefilled rows [{row0}, {row0 + rows}) of a {t.rows}-token sequence "
            "(the request and the ticket disagree)"
        )
    if aux_ND.shape[-1] != t.aux_width or last_NH.shape[-1] != t.hidden:
        return (
            f"server captured aux width {aux_ND.shape[-1]} / hidden {last_NH.shape[-1]}, "
            f"trainer expects {t.aux_width} / {t.hidden} (layer ids or target differ)"
        )
    return ""


def fail(path: str, ticket: int, message: str) -> None:
    """Mark a ticket failed with `message` (best effort)."""
    try:
        buf, layout = SLOTS.get(path)
        off = layout.tickets_off + ticket * TICKET_SIZE
        t = Ticket.unpack(buf, off)
        if t is not None:
            t.status, t.error = FAILED, message
            buf[off : off + TICKET_SIZE] = t.pack()
    except Exception:
        logger.exception("specforge_dspark: could not report to %s", path)
