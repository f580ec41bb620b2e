"""Page-locked slot mappings: where CUDA is present both sides of a slot (shm.py) pin their
mappings (cudaHostRegister), so a GPU copies into or out of a slot by direct DMA at pinned
bandwidth and the trainer's copy to its GPU may be asynchronous; a slot waits for such
copies before it is rewritten or unmapped (`note_read`, `wait_reads`). Standard library
and torch only: the slot writer uses it inside every engine's server."""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading

import torch

logger = logging.getLogger(__name__)


def buffer_address(buf: mmap.mmap) -> int:
    """Address of a mapping; no export outlives the call (the mapping stays closable)."""
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    addr = whole.data_ptr()
    del whole
    return addr


_PINNED: dict[int, tuple[int, list]] = {}  # address -> (bytes, events of copies reading it)
_PIN_LOCK = threading.Lock()


def pin(buf: mmap.mmap) -> int:
    """Page-lock a mapping (cudaHostRegister) where CUDA is present: copies between it and
    a GPU are then direct DMA at pinned bandwidth, and may be asynchronous. Returns its
    address; 0 when not pinned (no CUDA, or the driver refused: copies still work, at
    pageable bandwidth)."""
    if not torch.cuda.is_available():
        return 0
    addr, nbytes = buffer_address(buf), len(buf)
    err = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, 1))  # 1: Portable
    if err != 0:
        cleared = clear_cuda_error()
        logger.warning(
            "cudaHostRegister of a %d-byte slot failed (error %d; last error %s): copies "
            "use pageable memory",
            nbytes,
            err,
            "cleared" if cleared >= 0 else "not found to clear",
        )
        return 0
    with _PIN_LOCK:
        _PINNED[addr] = (nbytes, [])
    return addr


def clear_cuda_error() -> int:
    """Reset this thread's CUDA "last error" (cudaGetLastError) and return it; -1 when no
    CUDA runtime is loaded here. A failed cudaHostRegister leaves its error there, and the
    process's next launch check (c10's, an engine's) would report it as its own."""
    runtime = _cuda_runtime()
    return -1 if runtime is None else int(runtime.cudaGetLastError())


def _cuda_runtime():
    """The CUDA runtime library this process loaded (torch's, in /proc/self/maps; a second
    copy keeps its own last error), or None (torch.cuda.cudart() lacks cudaGetLastError)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


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
