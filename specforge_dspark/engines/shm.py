"""Shared-memory slots: where a target engine writes features for the trainer to read.

A slot is one file under /dev/shm (tmpfs: pages exist only once touched), mapped by
the trainer and by the producer (the hf worker, or an engine's scheduler or worker
through slot_writer.py). Tensors are views of the mapping, so nothing is pickled or
copied on the way. Layout, all offsets 64-byte aligned:

    header   magic, capacity (tokens), max_seqs, aux width D, hidden H, dtype, offsets
    tickets  max_seqs x 256 bytes: per-sequence request/answer records (tickets.py)
    ids      int64 [capacity]          input ids, [B, S] row-major
    aux      dtype [capacity, D]       aux hidden states, [B, S, D]
    last     dtype [capacity, H]       post-norm last hidden states, [B, S, H]

The trainer owns the files (creates, grows, unlinks); producers only open and write,
keeping their mappings open (SlotMaps). Where CUDA is present both sides page-lock their
mappings (`pin`): a GPU copies into or out of a slot by direct DMA at pinned bandwidth, and
the trainer's host-to-GPU copy can be asynchronous (features.TargetFeatures.to; a slot
waits for such copies before it is rewritten or unmapped: `note_read`, `wait_reads`).
This module imports only the standard library, torch and tickets.py, so the slot writer
can use it inside every engine's server.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import struct
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from specforge_dspark.engines.tickets import TICKET_SIZE, Ticket

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
FILE_PREFIX = "sfdspark-"

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

_HEADER = struct.Struct("<8s9q")  # magic, capacity, max_seqs, D, H, dtype, 4 offsets
_MAGIC = b"SFDSPK01"


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
    nbytes: int

    @staticmethod
    def plan(capacity: int, max_seqs: int, aux_width: int, hidden: int, dtype) -> SlotLayout:
        item = torch.empty((), dtype=dtype).element_size()
        tickets = _align(_HEADER.size)
        ids = _align(tickets + max_seqs * TICKET_SIZE)
        aux = _align(ids + capacity * 8)
        last = _align(aux + capacity * aux_width * item)
        end = _align(last + capacity * hidden * item)
        return SlotLayout(
            capacity, max_seqs, aux_width, hidden, dtype, tickets, ids, aux, last, end
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
        )

    @staticmethod
    def unpack(buf, where: str) -> SlotLayout:
        magic, cap, seqs, aux_w, hidden, code, t_off, i_off, a_off, l_off = _HEADER.unpack_from(
            buf, 0
        )
        if magic != _MAGIC or code not in CODE_DTYPES:
            raise RuntimeError(f"{where}: not a specforge_dspark feature slot (bad header)")
        plan = SlotLayout.plan(cap, seqs, aux_w, hidden, CODE_DTYPES[code])
        if (plan.tickets_off, plan.ids_off, plan.aux_off, plan.last_off) != (
            t_off,
            i_off,
            a_off,
            l_off,
        ):
            raise RuntimeError(f"{where}: slot header offsets disagree with its sizes")
        return plan


def map_file(path: str | Path, size: int | None = None) -> mmap.mmap:
    """Map `path` read-write; create it with `size` bytes when size is given."""
    return _map(path, size)[0]


def _map(path: str | Path, size: int | None = None) -> tuple[mmap.mmap, tuple[int, int, int]]:
    """map_file, with the identity of the file mapped: (device, inode, size)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if size is not None:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, 0), _identity(os.fstat(fd))
    finally:
        os.close(fd)


def _identity(st: os.stat_result) -> tuple[int, int, int]:
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


_PINNED: dict[int, tuple[int, list]] = {}  # address -> (bytes, events of copies reading it)
_PIN_LOCK = threading.Lock()


def pin(buf: mmap.mmap) -> int:
    """Page-lock a mapping (cudaHostRegister) where CUDA is present: copies between it and
    a GPU are then direct DMA at pinned bandwidth, and may be asynchronous. Returns its
    address; 0 when not pinned (no CUDA, or the driver refused: copies still work, at
    pageable bandwidth)."""
    if not torch.cuda.is_available():
        return 0
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    addr, nbytes = whole.data_ptr(), whole.numel()
    del whole  # no export may outlive this call: the mapping must stay closable
    err = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, 1))  # 1: Portable
    if err != 0:
        logger.warning("cudaHostRegister of a %d-byte slot failed (error %d)", nbytes, err)
        return 0
    with _PIN_LOCK:
        _PINNED[addr] = (nbytes, [])
    return addr


def unpin(addr: int) -> None:
    """Undo `pin` (0: nothing to undo), once the copies still reading the mapping are done."""
    if not addr:
        return
    wait_reads(addr)
    with _PIN_LOCK:
        _PINNED.pop(addr, None)
    torch.cuda.cudart().cudaHostUnregister(addr)


def note_read(tensors: list[torch.Tensor], event) -> None:
    """An asynchronous copy, done once `event` (a torch.cuda.Event) completes, reads
    `tensors`: the pinned mapping holding any of them waits for it before it is rewritten
    or unmapped (`wait_reads`)."""
    with _PIN_LOCK:
        for t in tensors:
            ptr = t.data_ptr()
            for addr, (nbytes, events) in _PINNED.items():
                if addr <= ptr < addr + nbytes:
                    events.append(event)


def wait_reads(addr: int) -> None:
    """Block until the asynchronous copies out of the mapping at `addr` are done."""
    if not addr:
        return
    with _PIN_LOCK:
        events = _PINNED.get(addr, (0, []))[1]
        pending, events[:] = list(events), []
    for event in pending:
        event.synchronize()


class SlotViews:
    """Tensors over one mapped slot for a [B, S] request (producer or consumer side)."""

    def __init__(self, buf: mmap.mmap, layout: SlotLayout, B: int, S: int):
        if B * S > layout.capacity or B > layout.max_seqs:
            raise RuntimeError(
                f"slot holds {layout.capacity} tokens / {layout.max_seqs} sequences, "
                f"request needs [{B}, {S}]"
            )
        self.layout = layout
        self.input_ids = view(buf, torch.long, layout.ids_off, (B, S))
        self.aux_hidden = view(buf, layout.dtype, layout.aux_off, (B, S, layout.aux_width))
        self.last_hidden = view(buf, layout.dtype, layout.last_off, (B, S, layout.hidden))


class ShmSlot:
    """A trainer-owned slot file that grows (never shrinks) to fit each request, by
    doubling up to `max_tokens` (0: no bound)."""

    def __init__(
        self, tag: str, aux_width: int, hidden: int, dtype: torch.dtype, max_tokens: int = 0
    ):
        self.tag, self.max_tokens = tag, max_tokens
        self.aux_width, self.hidden, self.dtype = aux_width, hidden, dtype
        self.path: Path | None = None
        self.layout: SlotLayout | None = None
        self.buf: mmap.mmap | None = None
        self.pinned = 0  # address of the page-locked mapping (0: not pinned)

    def prepare(self, B: int, S: int) -> SlotViews:
        """Views for a [B, S] request, reallocating first when it does not fit. Call it
        before the slot is written: it waits for asynchronous copies still reading it."""
        wait_reads(self.pinned)
        lay = self.layout
        if lay is None or B * S > lay.capacity or B > lay.max_seqs:
            cap = max(B * S, 2 * lay.capacity if lay else 0)
            if self.max_tokens >= B * S:
                cap = min(cap, self.max_tokens)
            seqs = max(B, lay.max_seqs if lay else 0)
            self._allocate(SlotLayout.plan(cap, seqs, self.aux_width, self.hidden, self.dtype))
        return SlotViews(self.buf, self.layout, B, S)

    def _allocate(self, layout: SlotLayout) -> None:
        self.close()
        path = SHM_DIR / f"{FILE_PREFIX}{os.getpid()}-{self.tag}-{uuid.uuid4().hex[:12]}"
        buf = map_file(path, layout.nbytes)
        buf[: _HEADER.size] = layout.pack()
        self.path, self.layout, self.buf = path, layout, buf
        self.pinned = pin(buf)

    def ticket_offset(self, index: int) -> int:
        assert self.layout is not None and index < self.layout.max_seqs
        return self.layout.tickets_off + index * TICKET_SIZE

    def write_ticket(self, index: int, ticket: Ticket) -> None:
        off = self.ticket_offset(index)
        self.buf[off : off + TICKET_SIZE] = ticket.pack()

    def read_ticket(self, index: int) -> Ticket | None:
        return Ticket.unpack(self.buf, self.ticket_offset(index))

    def close(self) -> None:
        """Unlink the file; the mapping goes once no yielded tensor uses it."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        unpin(self.pinned)
        release(self.buf)
        self.path, self.layout, self.buf, self.pinned = None, None, None, 0


SHM_HINT = (
    "raise it (docker run --shm-size=<N>g, Kubernetes: an emptyDir with medium: Memory "
    "mounted at /dev/shm) or lower train.micro_batch_size, data.max_length or target.prefetch"
)


def make_slots(
    rank: int, num_slots: int, aux_width: int, hidden: int, dtype: torch.dtype, recipe
) -> list[ShmSlot]:
    """The `num_slots` slots of one trainer rank, after checking that those of every
    rank on this node fit in SHM_DIR at their largest (B = train.micro_batch_size
    sequences of data.max_length tokens), so a small /dev/shm fails at start-up with
    the size it needs instead of with SIGBUS mid-run."""
    seqs = recipe.train.micro_batch_size
    tokens = seqs * recipe.data.max_length
    per_slot = SlotLayout.plan(tokens, seqs, aux_width, hidden, dtype).nbytes
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    need = per_slot * num_slots * local
    free = shutil.disk_usage(SHM_DIR).free + _ours_bytes()
    if need > free:
        raise RuntimeError(
            f"shared memory: feature slots need {need / 2**30:.2f} GiB in {SHM_DIR} "
            f"({local} rank(s) x {num_slots} slots x {per_slot / 2**20:.1f} MiB for "
            f"{seqs} x {recipe.data.max_length} tokens of aux width {aux_width} + hidden "
            f"{hidden}), {free / 2**30:.2f} GiB free: {SHM_HINT}"
        )
    return [
        ShmSlot(f"r{rank}s{i}", aux_width, hidden, dtype, max_tokens=tokens)
        for i in range(num_slots)
    ]


def _ours_bytes() -> int:
    """Bytes already held by slots of this process (they are replaced, not added)."""
    total = 0
    for path in SHM_DIR.glob(f"{FILE_PREFIX}{os.getpid()}-*"):
        try:
            total += path.stat().st_size
        except OSError:
            continue
    return total


def sweep_stale_slots() -> list[Path]:
    """Unlink slot files of ours (same uid) whose creating process is gone, e.g. after a
    SIGKILL, so a crashed run does not keep holding shared memory; returns them."""
    swept = []
    for path in SHM_DIR.glob(f"{FILE_PREFIX}*"):
        try:
            pid = int(path.name[len(FILE_PREFIX) :].split("-", 1)[0])
            if path.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            swept.append(path)
        except (ValueError, OSError):
            continue  # not ours to judge: malformed name, vanished, or another user's pid
    return swept


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
                now = _identity(os.stat(path))
            except FileNotFoundError:
                self._drop(path)
                raise
            if cached is not None and cached[0] == now:
                return cached[1], cached[2]
            self._drop_stale()
            buf, now = _map(path)
            try:
                layout = SlotLayout.unpack(buf, path)
            except Exception:
                release(buf)
                raise
            self._maps[path] = (now, buf, layout, pin(buf))
            self.mapped += 1
            return buf, layout

    def views(self, path: str, B: int, S: int) -> SlotViews:
        return SlotViews(*self.get(path), B, S)

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
                current = _identity(os.stat(path)) == cached[0]
            except FileNotFoundError:
                current = False
            if not current:
                self._drop(path)
