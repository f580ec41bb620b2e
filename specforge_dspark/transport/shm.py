"""Shared-memory slots: where a target engine writes features for the trainer to read.

A slot is one file under /dev/shm (tmpfs: pages exist only once touched), mapped by
the trainer and by the producer (the hf worker, or an engine's scheduler or worker
through slot_writer.py). Tensors are views of the mapping, so nothing is pickled or
copied on the way. Layout, all offsets 64-byte aligned:

    header   magic, capacity (tokens), max_seqs, aux width D, hidden H, dtype, offsets
    tickets  max_seqs x 256 bytes: per-sequence request/answer records (tickets.py)
    ids      int64 [capacity]          input ids, [T]
    aux      dtype [capacity, D]       aux hidden states, [T, D]
    last     last dtype [capacity, H]  post-norm last hidden states, [T, H]
    scales   float32 [capacity, m]     fp8 slots only: a scale per (row, aux layer), [T, m]

The dtype is the slot's (the trainer's target.dtype, or float8_e4m3fn with
target.transport_dtype fp8_e4m3); the last hidden rows are in it too, except in an fp8
slot, where they stay bfloat16 (they make the teacher's logits) and only the aux rows,
m = D / H layers each, are fp8 with a float32 scale per (row, layer) (fp8_rows.py).

Ragged: a request of B sequences of lengths n_0..n_{B-1} holds T = sum(n_b) rows, sequence
b's at rows [o_b, o_b + n_b), o_b = n_0 + ... + n_{b-1} (SlotViews), so its bytes are its
tokens' whatever the spread of its lengths. The trainer pads a copy for training
(`SlotViews.padded`; a view when every length is the same). A slot grows by doubling, up
to its SlotBudget (the most a request of the run can hold, slot_budget.py); a request over
it is refused before anything is written, naming the recipe keys that set it.

The trainer owns the files (creates, grows, unlinks), each under a shared flock for as
long as it is live (the stale-slot sweep unlinks only files it can lock exclusively:
slot_budget.py); producers open and write, keeping their mappings
(slot_writer.SlotMaps), or reach them through Mooncake (mooncake.py). A request the
trainer gave up on may still be written: the next request of its slot gets a fresh file
(`prepare(fresh=True)`) and, with Mooncake, a fresh registration, the old one withdrawn
and its mapping kept (its pages freed) until `close`, so no late transfer lands in memory
the slot uses again. With
CUDA both sides page-lock their mappings (`pin`: DMA at pinned bandwidth; the trainer's
copy to the GPU may be asynchronous, and a slot waits for it before it is rewritten or
unmapped: `note_read`, `wait_reads`). Imports only the standard library, torch and
tickets.py (and fp8_rows.py): the slot writer uses it inside every engine's server.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specforge_dspark.transport.fp8_rows import FP8
from specforge_dspark.transport.pinning import pin, unpin, wait_reads
from specforge_dspark.transport.ragged import pad_rows, starts
from specforge_dspark.transport.tickets import TICKET_SIZE, Ticket

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
FILE_PREFIX = "sfdspark-"

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, FP8: 4
}  # fmt: skip
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

_HEADER = struct.Struct("<8s10q")  # magic, capacity, max_seqs, D, H, dtype, 5 offsets
HEADER_SIZE = _HEADER.size
_MAGIC = b"SFDSPK04"  # 04: fp8 slots: per-(row, aux layer) scales, last rows bf16


def last_rows_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a slot's last hidden rows: the slot's, bfloat16 in an fp8 slot."""
    return torch.bfloat16 if dtype == FP8 else dtype


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


@dataclass(frozen=True)
class SlotLayout:
    capacity: int  # tokens
    max_seqs: int
    aux_width: int  # D
    hidden: int  # H
    dtype: torch.dtype
    tickets_off: int
    ids_off: int
    aux_off: int
    last_off: int
    scales_off: int  # fp8 only: float32 [capacity, m] aux scales
    nbytes: int

    @property
    def last_dtype(self) -> torch.dtype:
        """The dtype of the last hidden rows (`last_rows_dtype`)."""
        return last_rows_dtype(self.dtype)

    @property
    def layers(self) -> int:
        """m, the aux layers of a row (D / H)."""
        return self.aux_width // self.hidden

    @staticmethod
    def plan(capacity: int, max_seqs: int, aux_width: int, hidden: int, dtype) -> SlotLayout:
        fp8 = dtype == FP8
        assert not (fp8 and aux_width % hidden), "an fp8 slot's aux row is m whole layers"
        last_dtype = last_rows_dtype(dtype)
        tickets = _align(_HEADER.size)
        ids = _align(tickets + max_seqs * TICKET_SIZE)
        aux = _align(ids + capacity * 8)
        last = _align(aux + capacity * aux_width * dtype.itemsize)
        scales = _align(last + capacity * hidden * last_dtype.itemsize)
        end = _align(scales + (capacity * (aux_width // hidden) * 4 if fp8 else 0))
        return SlotLayout(
            capacity, max_seqs, aux_width, hidden, dtype, tickets, ids, aux, last, scales, end
        )

    def pack(self) -> bytes:
        return _HEADER.pack(
            _MAGIC,
            self.capacity,
            self.max_seqs,
            self.aux_width,
            self.hidden,
            DTYPE_CODES[self.dtype],
            self.tickets_off,
            self.ids_off,
            self.aux_off,
            self.last_off,
            self.scales_off,
        )

    @staticmethod
    def unpack(buf, where: str) -> SlotLayout:
        magic, cap, seqs, aux_w, hidden, code, *offs = _HEADER.unpack_from(buf, 0)
        if magic[:6] == _MAGIC[:6] and magic != _MAGIC:
            raise RuntimeError(
                f"{where}: slot layout version {magic[6:].decode(errors='replace')}, this "
                f"code reads {_MAGIC[6:].decode()}: the trainer and the engine's plugin differ "
                "(reinstall the plugin in the engine's environment from this checkout)"
            )
        if magic != _MAGIC or code not in CODE_DTYPES:
            raise RuntimeError(f"{where}: not a specforge_dspark feature slot (bad header)")
        plan = SlotLayout.plan(cap, seqs, aux_w, hidden, CODE_DTYPES[code])
        offsets = (plan.tickets_off, plan.ids_off, plan.aux_off, plan.last_off, plan.scales_off)
        if offsets != tuple(offs):
            raise RuntimeError(f"{where}: slot header offsets disagree with its sizes")
        return plan


def map_path(path: str | Path, size: int | None = None) -> tuple[mmap.mmap, tuple[int, int, int]]:
    """Map `path` read-write (create it with `size` bytes when size is given), with the
    identity of the file mapped: (device, inode, size)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if size is not None:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, 0), identity(os.fstat(fd))
    finally:
        os.close(fd)


def identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_dev, st.st_ino, st.st_size


def view(buf, dtype: torch.dtype, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor aliasing `buf` bytes [offset, offset + prod(shape) * itemsize)."""
    count = 1
    for n in shape:
        count *= n
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)


def release(buf: mmap.mmap | None) -> None:
    """Unmap when no tensor still aliases it; otherwise the GC unmaps it later."""
    if buf is None:
        return
    try:
        buf.close()
    except BufferError:
        pass


class SlotViews:
    """Tensors over one mapped slot for a ragged request of sequences `lengths` (producer
    or consumer side): input_ids [T], aux [T, D], last [T, H], T = sum(lengths), sequence
    b's rows at `starts[b]`; in an fp8 slot aux_scale [T, m] too (None otherwise)."""

    def __init__(self, buf: mmap.mmap, layout: SlotLayout, lengths: Sequence[int]):
        self.lengths = [int(n) for n in lengths]
        self.starts = starts(self.lengths)
        T, B = sum(self.lengths), len(self.lengths)
        if T > layout.capacity or B > layout.max_seqs:
            raise RuntimeError(
                f"slot holds {layout.capacity} tokens / {layout.max_seqs} sequences, "
                f"request needs {T} / {B}"
            )
        self.layout = layout
        self.input_ids = view(buf, torch.long, layout.ids_off, (T,))
        self.aux = view(buf, layout.dtype, layout.aux_off, (T, layout.aux_width))
        self.last = view(buf, layout.last_dtype, layout.last_off, (T, layout.hidden))
        self.aux_scale = None
        if layout.dtype == FP8:  # aux layer i of row r: aux[r, i*H:(i+1)*H] * aux_scale[r, i]
            self.aux_scale = view(buf, torch.float32, layout.scales_off, (T, layout.layers))

    def rows(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's aux rows [n_b, D] and last-hidden rows [n_b, H]."""
        o, n = self.starts[b], self.lengths[b]
        return self.aux[o : o + n], self.last[o : o + n]

    def offsets(self, b: int) -> tuple[int, int]:
        """Byte offsets in the slot of sequence b's first aux row and first last row."""
        lay, o = self.layout, self.starts[b]
        return (
            lay.aux_off + o * lay.aux_width * self.aux.element_size(),
            lay.last_off + o * lay.hidden * self.last.element_size(),
        )

    def put_ids(self, input_ids_BS: torch.Tensor) -> None:
        """Write right-padded input ids [B, S] as the request's ragged ids."""
        for b, (o, n) in enumerate(zip(self.starts, self.lengths, strict=True)):
            self.input_ids[o : o + n] = input_ids_BS[b, :n]

    def padded(self, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """aux [B, S, D] and last [B, S, H] as the slot holds them (fp8 aux rows stay
        fp8: `padded_scale`), right-padded with zeros (`pad_rows`: page-locked copies
        where CUDA is present, views of the slot when every length is S)."""
        pin = torch.cuda.is_available()
        return pad_rows(self.aux, self.lengths, S, pin), pad_rows(self.last, self.lengths, S, pin)

    def padded_scale(self, S: int) -> torch.Tensor | None:
        """The aux rows' scales [B, S, m] (zeros on padding) in an fp8 slot, else None."""
        if self.aux_scale is None:
            return None
        return pad_rows(self.aux_scale, self.lengths, S, torch.cuda.is_available())


@dataclass(frozen=True)
class SlotBudget:
    """The most one request of a run can hold (slot_budget.request_budget)."""

    tokens: int
    seqs: int
    keys: str  # the recipe keys that set it, for the refusal

    def refusal(self, lengths: Sequence[int]) -> str:
        """Why a request of `lengths` does not fit; "" when it does."""
        T, B = sum(int(n) for n in lengths), len(lengths)
        if T <= self.tokens and B <= self.seqs:
            return ""
        return (
            f"a target request of {B} sequence(s) / {T} tokens (longest {max(lengths)}) is "
            f"over the feature slot budget of {self.tokens} tokens / {self.seqs} sequences "
            f"({self.keys}); nothing was written: keep rows within data.max_length or raise "
            "the keys that set the budget"
        )


def _grow(need: int, have: int, most: int) -> int:
    """Doubling growth to fit `need`, never past `most` (0: no bound)."""
    size = max(need, 2 * have)
    return min(size, most) if most else size


class ShmSlot:
    """A trainer-owned slot file, named `<FILE_PREFIX><job>-<pid>-<tag>-<random>`, that
    grows (never shrinks) to fit each request, by doubling up to its `budget` (None: no
    bound). Requests name it by `location`: its path, or where `exposer` (mooncake.Exposer,
    target.transport mooncake) registered its mapping for writers on other hosts."""

    def __init__(
        self,
        tag: str,
        aux_width: int,
        hidden: int,
        dtype: torch.dtype,
        budget: SlotBudget | None = None,
        job: str = "0",
        exposer=None,
    ):
        self.tag, self.budget, self.job, self.exposer = tag, budget, job, exposer
        self.aux_width, self.hidden, self.dtype = aux_width, hidden, dtype
        self.path: Path | None = None
        self.location = ""
        self.layout: SlotLayout | None = None
        self.buf: mmap.mmap | None = None
        self.pinned = 0  # address of the page-locked mapping (0: not pinned)
        self.issued: dict[int, int] = {}  # ticket index -> nonce of the ticket written there
        self._lock_fd = -1  # holds the live file's shared flock (-1: none)
        self.retired: list[mmap.mmap] = []  # withdrawn Mooncake mappings, unmapped at close

    def prepare(self, lengths: Sequence[int], fresh: bool = False) -> SlotViews:
        """Views for a request of sequences `lengths`, reallocating first when it does not
        fit, or when `fresh` (a writer of the request the trainer gave up on here may still
        come: it reaches only the old file or registration); ValueError, before anything
        is written, when it is over the budget. Call it before the slot is written: it
        waits for asynchronous copies still reading it."""
        problem = self.budget.refusal(lengths) if self.budget else ""
        if problem:
            raise ValueError(problem)
        wait_reads(self.pinned)
        T, B, lay = sum(int(n) for n in lengths), len(lengths), self.layout
        if lay is None or T > lay.capacity or B > lay.max_seqs:
            most = self.budget or SlotBudget(0, 0, "")
            cap = _grow(T, lay.capacity if lay else 0, most.tokens)
            seqs = _grow(B, lay.max_seqs if lay else 0, most.seqs)
            self._allocate(SlotLayout.plan(cap, seqs, self.aux_width, self.hidden, self.dtype))
        elif fresh:
            self._allocate(lay)
        return self.views(lengths)

    def views(self, lengths: Sequence[int]) -> SlotViews:
        """Views of the request `prepare` fitted the slot to."""
        assert self.layout is not None, "prepare the slot first"
        return SlotViews(self.buf, self.layout, lengths)

    def _allocate(self, layout: SlotLayout) -> None:
        self._retire()
        name = f"{FILE_PREFIX}{self.job}-{os.getpid()}-{self.tag}-{uuid.uuid4().hex[:12]}"
        path = SHM_DIR / name
        buf = map_path(path, layout.nbytes)[0]
        self._lock_fd = os.open(path, os.O_RDONLY)
        fcntl.flock(self._lock_fd, fcntl.LOCK_SH)  # live: the sweep leaves it alone
        buf[: _HEADER.size] = layout.pack()
        self.path, self.layout, self.buf = path, layout, buf
        self.location = self.exposer.expose(buf) if self.exposer else str(path)
        self.pinned = pin(buf)
        self.issued = {}

    def ticket_offset(self, index: int) -> int:
        assert self.layout is not None and index < self.layout.max_seqs
        return self.layout.tickets_off + index * TICKET_SIZE

    def write_ticket(self, index: int, ticket: Ticket) -> None:
        off = self.ticket_offset(index)
        self.buf[off : off + TICKET_SIZE] = ticket.pack()
        self.issued[index] = ticket.nonce

    def read_ticket(self, index: int) -> Ticket | None:
        return Ticket.unpack(self.buf, self.ticket_offset(index))

    def _retire(self) -> None:
        """Let the live file go: unlinked, its lock dropped, its registration withdrawn.
        The shm mapping goes once no yielded tensor uses it (a writer's own mapping of the
        file stays its own); a Mooncake one stays mapped until `close`, its pages freed,
        so its addresses are not handed out again while a late transfer may come."""
        if self.buf is None:
            return
        wait_reads(self.pinned)
        self.path.unlink(missing_ok=True)
        os.close(self._lock_fd)
        unpin(self.pinned)
        if self.exposer and self.location:
            self.exposer.withdraw(self.location)
            self.buf.madvise(mmap.MADV_REMOVE)
            self.retired.append(self.buf)
        else:
            release(self.buf)
        self.path, self.layout, self.buf, self.pinned, self.location = None, None, None, 0, ""
        self._lock_fd = -1

    def close(self) -> None:
        """Unlink the file; the mappings go once no yielded tensor uses them."""
        self._retire()
        for buf in self.retired:
            release(buf)
        self.retired = []
