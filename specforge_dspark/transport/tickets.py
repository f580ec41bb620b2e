"""The ticket protocol: one fixed-size record per sequence inside a shared-memory slot.

The trainer issues a ticket per sequence of a request (status PENDING, the rows it
expects, where its rows go in the slot, their width and dtype); the producer inside the
engine (slot_writer.py, called by the SGLang plugin and the vLLM connector) copies the rows
there and marks the ticket DONE once all of them are written, or FAILED with the reason
(WRITER_FAILED first when the writer failed, not the request).
Each ticket carries a nonce, fresh per request, that the trainer also puts in the request:
a writer whose nonce is not the ticket's (a request the trainer gave up on, its slot since
reused) writes nothing (slot_writer.py).
The trainer reads the tickets, not the engine's reply, to know what was written
(served.py): with tensor parallelism any rank may write, and vLLM's connector writes after
the reply may have left. Standard library only: it runs inside every engine's venv.

A ticket may ask for a window of its sequence's rows (`lo`, `count`: positions
[lo, lo + count), dist.sequence_parallel: a rank holds only its slice): the engine still
prefills the whole sequence, and the writer copies only the rows inside the window, at
slot row (position - lo); `written` counts the positions prefilled, so the ticket is done
once it reaches `rows` whatever the window holds.

Record (256 bytes, little-endian): magic, status, rows, written, aux_off, last_off,
aux_width, hidden, dtype code, nonce, lo, count, then up to 160 bytes of UTF-8 error text.
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass

_TICKET = struct.Struct("<8s11q160s")  # magic, status, rows, written, ..., nonce, window, error
TICKET_SIZE = _TICKET.size  # 256
_TICKET_MAGIC = b"SFDTKT02"  # 02: a window of rows (lo, count)

PENDING, DONE, FAILED = 0, 1, 2
WRITER_FAILED = "writer failed: "
"""How a FAILED ticket's error starts when the writer itself failed (a transfer, memory, a
stale copy of this package) rather than refused the request: the trainer counts the
server as lost (restart, or failover in a pool: served.py), where a refusal stops the run."""


@dataclass
class Ticket:
    """One sequence's request/answer record inside a slot."""

    status: int
    rows: int  # the sequence's positions (tokens) the engine prefills
    written: int  # positions prefilled so far (their rows inside the window written)
    aux_off: int  # byte offset of this sequence's first aux row
    last_off: int  # byte offset of its first last-hidden row
    aux_width: int
    hidden: int
    dtype_code: int
    error: str = ""
    nonce: int = 0  # the request's: a writer presenting another one writes nothing
    lo: int = 0  # the window's first position
    count: int = -1  # rows in the window (-1: every row, [0, rows))

    @property
    def window(self) -> tuple[int, int]:
        """(first position, rows) the slot holds of this sequence."""
        return (self.lo, self.count) if self.count >= 0 else (0, self.rows)

    def pack(self) -> bytes:
        """The record: TICKET_SIZE bytes."""
        err = self.error.encode()[:160]
        return _TICKET.pack(
            _TICKET_MAGIC,
            self.status,
            self.rows,
            self.written,
            self.aux_off,
            self.last_off,
            self.aux_width,
            self.hidden,
            self.dtype_code,
            self.nonce,
            self.lo,
            self.count,
            err,
        )

    @staticmethod
    def unpack(buf, offset: int) -> Ticket | None:
        """The ticket at `offset` of `buf`; None when none was issued there."""
        magic, status, rows, written, a_off, l_off, aux_w, hidden, code, nonce, lo, count, err = (
            _TICKET.unpack_from(buf, offset)
        )
        if magic != _TICKET_MAGIC:
            return None
        text = err.rstrip(b"\0").decode(errors="replace")
        return Ticket(
            status, rows, written, a_off, l_off, aux_w, hidden, code, text, nonce, lo, count
        )


def new_nonce() -> int:
    """A request's nonce: random, 63 bits (never 0, the nonce of a ticket issued without)."""
    return secrets.randbits(63) | 1
