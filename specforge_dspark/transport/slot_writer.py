"""The producer side of a slot: an engine's process copies one request's rows in and
answers its ticket.

Called inside the engine's server (the SGLang plugin's hook, the vLLM connector's worker)
with the slot's location (a /dev/shm path, or with `target.transport: mooncake` a
trainer's slot on any host, mooncake.py: `SlotAccess`), ticket index and nonce the trainer
put in the request. `SLOTS` keeps each slot mapped once per process (page-locked on CUDA,
`SlotMaps`; the hf worker keeps its own), so the device-to-host copy is one DMA into the
slot. A writer whose nonce is not the ticket's writes nothing: it checks before copying
and again before answering. A request the trainer gave up on is never followed in its
slot's file or registration (the next request there gets a fresh one, served.py `submit`),
so a late writer reaches only memory no request reads again. A request's rows may arrive
in chunks (a split prefill): each lands at its offset in the sequence, and the ticket
turns DONE once all of them are there. A ticket with a window (tickets.py: positions [lo,
lo + count), a rank's slice under dist.sequence_parallel) gets only the rows inside it:
the rest of each chunk never leaves the engine's device. In an fp8 slot
(target.transport_dtype fp8_e4m3) the aux rows are quantized where they are (on the GPU in
production: fewer bytes to the host), a bounded block of rows at a time straight into the
slot or the Mooncake staging buffer, with a scale per (row, aux layer); the last hidden
rows go in bfloat16 (fp8_rows.py). Nothing here raises into the engine: a failure goes to
the trainer through the ticket (FAILED, with the reason; a writer's own error, a failed
transfer or an out-of-memory say, marked tickets.WRITER_FAILED, best effort), and the
server keeps serving.

Imports only torch, the standard library, shm.py, fp8_rows.py, tickets.py and mooncake.py:
it is installed with `--no-deps` in each engine's own environment.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from specforge_dspark.transport.fp8_rows import FP8, quantize_into
from specforge_dspark.transport.mooncake import Region, Remote, RemoteSlot
from specforge_dspark.transport.pinning import pin, unpin
from specforge_dspark.transport.shm import (
    HEADER_SIZE,
    SlotLayout,
    SlotViews,
    identity,
    map_path,
    release,
    view,
)
from specforge_dspark.transport.tickets import (
    DONE,
    FAILED,
    PENDING,
    TICKET_SIZE,
    WRITER_FAILED,
    Ticket,
)

logger = logging.getLogger(__name__)


class SlotMaps:
    """Producer side (the SGLang plugin, the vLLM connector, the hf worker): slot path ->
    its mapping and layout, opened once and kept (page-locked where CUDA is present).
    A path whose file was replaced (another device, inode or size) is mapped again; one
    whose file is gone is dropped, and so is, whenever a new mapping is made, every other
    whose file is gone or replaced (a regrown slot, a trainer that exited or restarted).
    Thread-safe."""

    def __init__(self):
        self._maps: dict[str, tuple[tuple[int, int, int], mmap.mmap, SlotLayout, int]] = {}
        self._lock = threading.Lock()
        self.mapped = 0  # mappings made so far

    def get(self, path: str) -> tuple[mmap.mmap, SlotLayout]:
        """The mapping of `path` and its layout; FileNotFoundError when it is gone."""
        with self._lock:
            cached = self._maps.get(path)
            try:
                now = identity(os.stat(path))
            except FileNotFoundError:
                self._drop(path)
                raise
            if cached is not None and cached[0] == now:
                return cached[1], cached[2]
            self._drop_stale()
            buf, now = map_path(path)
            try:
                layout = SlotLayout.unpack(buf, path)
            except Exception:
                release(buf)
                raise
            self._maps[path] = (now, buf, layout, pin(buf))
            self.mapped += 1
            return buf, layout

    def views(self, path: str, lengths: Sequence[int]) -> SlotViews:
        """Views of the slot at `path` for a request of sequences `lengths`."""
        return SlotViews(*self.get(path), lengths)

    def close(self) -> None:
        with self._lock:
            for path in list(self._maps):
                self._drop(path)

    def _drop(self, path: str) -> None:
        cached = self._maps.pop(path, None)
        if cached is not None:
            unpin(cached[3])
            release(cached[1])

    def _drop_stale(self) -> None:
        for path, cached in list(self._maps.items()):
            try:
                current = identity(os.stat(path)) == cached[0]
            except FileNotFoundError:
                current = False
            if not current:
                self._drop(path)


SLOTS = SlotMaps()  # this process's slot mappings, kept open


class SlotAccess:
    """One slot as a writer sees it, by the location a request names: a /dev/shm path
    mapped here (SLOTS), or a trainer's slot reached through Mooncake (mooncake.py): its
    layout, its tickets, and row writes."""

    def __init__(self, location: str):
        self.location = location
        remote = Remote.parse(location)
        self.remote = None if remote is None else RemoteSlot(remote)
        self.refusal = "" if self.remote is None else self.remote.refusal  # rows not written
        if self.remote is None:
            self.buf, self.layout = SLOTS.get(location)
        else:
            self.layout = SlotLayout.unpack(self.remote.read(0, HEADER_SIZE), location)

    def _off(self, index: int) -> int:
        return self.layout.tickets_off + index * TICKET_SIZE

    def ticket(self, index: int) -> Ticket:
        """Ticket `index`; RuntimeError when none was issued there."""
        off = self._off(index)
        if self.remote is None:
            t = Ticket.unpack(self.buf, off)
        else:
            t = Ticket.unpack(self.remote.read(off, TICKET_SIZE), 0)
        if t is None:
            raise RuntimeError(f"no ticket {index} in {self.location}")
        return t

    def put_ticket(self, index: int, t: Ticket) -> None:
        off = self._off(index)
        if self.remote is None:
            self.buf[off : off + TICKET_SIZE] = t.pack()
        else:
            self.remote.write(off, t.pack())

    @contextmanager
    def regions(self, regions: list[Region]) -> Iterator[list[torch.Tensor]]:
        """A tensor to fill for each (byte offset, dtype, shape) region of the slot: views
        of the mapping, or of the Mooncake staging buffer, written out when the `with`
        ends without an error."""
        if self.remote is not None:
            with self.remote.staged(regions) as tensors:
                yield tensors
        else:
            yield [view(self.buf, dtype, off, shape) for off, dtype, shape in regions]


def write_features(
    location: str, ticket: int, nonce: int, row0: int | None, aux_ND, last_NH
) -> None:
    """Copy one request's rows [row0, row0 + N) (those inside the ticket's window) into its
    slot (a /dev/shm path or a Mooncake location, SlotAccess) and update the ticket:
    done once every position is prefilled (row0 None: right after those so far). Nothing
    when the ticket's nonce is not `nonce` (module docstring). Never raises: an error
    marks the ticket FAILED as the writer's (`fail(lost=True)`), best effort."""
    try:
        slot = SlotAccess(location)
        t = _mine(slot, nonce, ticket)
        if t is None:
            return
        if row0 is None:
            row0 = t.written
        rows = aux_ND.shape[0]
        problem = slot.refusal or _check(t, row0, aux_ND, last_NH)
        if problem:
            t.status, t.error = FAILED, problem
        elif t.status != FAILED:
            lo, count = t.window
            a, b = max(row0, lo), min(row0 + rows, lo + count)  # the chunk's rows it asks for
            if a < b:
                _put_rows(
                    slot, t, a - lo, aux_ND[a - row0 : b - row0], last_NH[a - row0 : b - row0]
                )
            t.written = row0 + rows
            t.status = DONE if t.written == t.rows else PENDING
        if _mine(slot, nonce, ticket) is not None:
            slot.put_ticket(ticket, t)
    except FileNotFoundError:  # the trainer gave the slot up (or exited): no one to tell
        logger.warning("specforge_dspark: slot %s is gone: writing nothing", location)
    except Exception as e:
        logger.exception("specforge_dspark: could not hand features to %s", location)
        fail(location, ticket, nonce, f"{type(e).__name__}: {e}", lost=True)


def _put_rows(slot: SlotAccess, t: Ticket, row0: int, aux_ND, last_NH) -> None:
    """N rows into ticket `t`'s rows [row0, row0 + N) of the slot in its dtypes (fp8 aux
    rows quantized block by block beside their scales: module docstring)."""
    lay, N = slot.layout, aux_ND.shape[0]
    aux_row, last_row = t.aux_width * lay.dtype.itemsize, t.hidden * lay.last_dtype.itemsize
    aux_off, last_off = t.aux_off + row0 * aux_row, t.last_off + row0 * last_row
    regions = [(aux_off, lay.dtype, (N, t.aux_width)), (last_off, lay.last_dtype, (N, t.hidden))]
    if lay.dtype == FP8:
        row = (aux_off - lay.aux_off) // aux_row  # the slot row of the first
        regions.append((lay.scales_off + row * lay.layers * 4, torch.float32, (N, lay.layers)))
    with slot.regions(regions) as (aux, last, *scale):
        last.copy_(last_NH.to(last.dtype))  # converted where the rows are
        if scale:
            quantize_into(aux_ND, aux, scale[0])
        else:
            aux.copy_(aux_ND.to(aux.dtype))


def _mine(slot: SlotAccess, nonce: int, index: int) -> Ticket | None:
    """Ticket `index` when it is this request's (its nonce is `nonce`), else None."""
    t = slot.ticket(index)
    if t.nonce != nonce:
        logger.warning(
            "specforge_dspark: ticket %d of %s was reissued (the trainer gave up on this "
            "request): writing nothing",
            index,
            slot.location,
        )
        return None
    return t


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


def fail(location: str, ticket: int, nonce: int, message: str, lost: bool = False) -> None:
    """Mark a ticket failed with `message` (best effort; nothing on another nonce);
    `lost`: the writer failed, not the request (tickets.WRITER_FAILED)."""
    try:
        slot = SlotAccess(location)
        t = _mine(slot, nonce, ticket)
        if t is not None:
            t.status, t.error = FAILED, (WRITER_FAILED if lost else "") + message
            slot.put_ticket(ticket, t)
    except Exception:
        logger.exception("specforge_dspark: could not report to %s", location)
