"""Features over the network: Mooncake's Transfer Engine in place of a shared mapping.

With `target.transport: mooncake` a trainer rank registers each of its feature slots
(shm.ShmSlot, the same layout and tickets) with this process's Transfer Engine and names
the slot in its requests by a `Remote` location, `mooncake://<protocol>@<host>:<rpc
port>/<address hex>/<bytes>`, where the shm transport names a /dev/shm path. The writer in
the server process (slot_writer.py, called by the SGLang plugin) opens a `RemoteSlot` for
that location: it reads the slot's header and the request's ticket from the trainer's
memory, writes the rows at the ticket's offsets, then writes the ticket back, all through
its own Transfer Engine. The ticket protocol and its checks are the shm path's, so the
server may be on another host.

Handshake: P2PHANDSHAKE (no metadata server): a writer connects to the trainer's RPC port
named in the location. Protocol `tcp` runs anywhere (CI: loopback); `rdma` takes the
devices of `target.mooncake.device` on the trainer's side and of the server's environment
variable `SFDSPARK_MOONCAKE_DEVICE` on the writer's. Each side's address is the local one
that routes to the other (`local_address`) unless given (`target.mooncake.host`,
`SFDSPARK_MOONCAKE_HOST`).

Imports only the standard library, torch and pinning.py (mooncake when first used): the
writer runs in the engine's own environment, installed there with `--no-deps`.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch

from specforge_dspark.transport.pinning import buffer_address

SCHEME = "mooncake://"
_LOCATION = re.compile(r"^mooncake://(tcp|rdma)@([^/@]+:\d+)/([0-9a-f]+)/(\d+)$")
INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 in this environment (make "
    "setup and make sglang-venv do), and the Debian packages libibverbs1 and librdmacm1 "
    "(apt-get install -y libibverbs1 librdmacm1)"
)
HOST_ENV, DEVICE_ENV = "SFDSPARK_MOONCAKE_HOST", "SFDSPARK_MOONCAKE_DEVICE"
TCP_MIN_VERSION = (0, 3, 12)
"""The oldest Mooncake whose TCP transport a writer uses (the version tested is pinned in
pyproject.toml); an older one in the server's environment fails each ticket, naming it."""


def version_problem(protocol: str) -> str:
    """Why this environment's Mooncake may not write over `protocol` ("" when it may):
    over tcp it must be at least TCP_MIN_VERSION (by its installed distribution's version)."""
    if protocol != "tcp":
        return ""
    want = ".".join(map(str, TCP_MIN_VERSION))
    found = [
        (name, importlib.metadata.version(name))
        for name in importlib.metadata.packages_distributions().get("mooncake", [])
    ]
    for _, version in found:
        if tuple(int(n) for n in re.findall(r"\d+", version)[:3]) >= TCP_MIN_VERSION:
            return ""
    have = ", ".join(f"{name} {version}" for name, version in found) or "no version found"
    return (
        f"the server's Mooncake ({have}) is older than {want}, the oldest whose tcp transport "
        f"writes features: {INSTALL_HINT}"
    )


Region = tuple[int, torch.dtype, tuple[int, ...]]
"""Bytes of a slot as a tensor: (byte offset, dtype, shape)."""


@dataclass(frozen=True)
class Remote:
    """Where a trainer's slot lies: its rank's Transfer Engine (protocol, host:rpc_port)
    and the registered mapping's address and size."""

    protocol: str
    peer: str  # host:rpc_port
    addr: int
    nbytes: int

    def __str__(self) -> str:
        return f"{SCHEME}{self.protocol}@{self.peer}/{self.addr:x}/{self.nbytes}"

    @staticmethod
    def parse(text: str) -> Remote | None:
        """The location `text` names; None for anything else (a /dev/shm path)."""
        m = _LOCATION.match(text)
        if m is None:
            return None
        return Remote(m.group(1), m.group(2), int(m.group(3), 16), int(m.group(4)))


def local_address(peer_host: str) -> str:
    """This host's address on the route to `peer_host` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(peer_host), 9))
        return s.getsockname()[0]


_ENGINE: tuple[object, str, str] | None = None  # (TransferEngine, host, protocol)
_ENGINE_LOCK = threading.Lock()


def transfer_engine(host: str, protocol: str, device: str):
    """This process's Transfer Engine (one per process, made on first use); RuntimeError
    naming the install when mooncake cannot be imported, or the address when it cannot
    start. A later call asking another protocol is refused."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is not None:
            engine, at, proto = _ENGINE
            if proto != protocol:
                raise RuntimeError(
                    f"this process's Mooncake Transfer Engine runs {proto}, a slot asks {protocol}"
                )
            return engine
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError(
                f"Mooncake Transfer Engine cannot be imported ({e}): {INSTALL_HINT}"
            ) from None
        engine = TransferEngine()
        if engine.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            raise RuntimeError(
                f"Mooncake Transfer Engine could not start on {host} (protocol {protocol}, "
                f"device {device or 'none'}): see the log lines above"
            )
        _ENGINE = (engine, host, protocol)
        return engine


class Exposer:
    """Trainer side: registers slot mappings with this process's Transfer Engine and names
    them (`expose` -> location string); `withdraw` before a mapping goes."""

    def __init__(self, server_url: str, protocol: str = "tcp", device: str = "", host: str = ""):
        peer = urlsplit(server_url).hostname or "127.0.0.1"
        self.host = host or local_address(peer)
        self.protocol, self.device = protocol, device
        self.engine = transfer_engine(self.host, protocol, device)
        self.peer = f"{self.host}:{self.engine.get_rpc_port()}"

    @staticmethod
    def for_recipe(recipe, server_url: str) -> Exposer | None:
        """The recipe's exposer; None for the shm transport."""
        t = recipe.target
        if t.transport != "mooncake":
            return None
        m = t.mooncake
        return Exposer(server_url, m.protocol, m.device, m.host)

    def expose(self, buf) -> str:
        addr, nbytes = buffer_address(buf), len(buf)
        if self.engine.register_memory(addr, nbytes) != 0:
            raise RuntimeError(f"Mooncake could not register a {nbytes}-byte feature slot")
        return str(Remote(self.protocol, self.peer, addr, nbytes))

    def withdraw(self, location: str) -> None:
        remote = Remote.parse(location)
        if remote is not None:
            self.engine.unregister_memory(remote.addr)


class _Staging:
    """The writer's registered bytes for what it sends and reads (grown by doubling),
    page-locked where CUDA is available, so rows on a GPU reach it by DMA (and quantized
    fp8 rows block by block: slot_writer.py); on a host without CUDA, pageable memory."""

    def __init__(self):
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.lock = threading.Lock()

    def fit(self, engine, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            if self.buf.numel():
                engine.unregister_memory(self.buf.data_ptr())
            size = max(nbytes, 2 * self.buf.numel(), 1 << 16)
            self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            if engine.register_memory(self.buf.data_ptr(), self.buf.numel()) != 0:
                raise RuntimeError("Mooncake could not register the writer's staging buffer")
        return self.buf


_STAGING = _Staging()


class RemoteSlot:
    """Writer side: a trainer's slot reached through Mooncake (`location` from a request).
    `read` and `write` move bytes at offsets of the slot; RuntimeError on a failed
    transfer or an offset outside it. `refusal`: why this environment's Mooncake must not
    write rows here ("" when it may; the ticket may still be failed with it)."""

    def __init__(self, remote: Remote):
        self.remote = remote
        self.refusal = version_problem(remote.protocol)
        peer_host = remote.peer.rpartition(":")[0]
        host = os.environ.get(HOST_ENV) or local_address(peer_host)
        self.engine = transfer_engine(host, remote.protocol, os.environ.get(DEVICE_ENV, ""))

    def _check(self, off: int, n: int) -> None:
        if off < 0 or off + n > self.remote.nbytes:
            raise RuntimeError(f"bytes [{off}, {off + n}) lie outside the slot {self.remote}")

    def read(self, off: int, n: int) -> bytes:
        self._check(off, n)
        with _STAGING.lock:
            stage = _STAGING.fit(self.engine, n)
            self._done(
                self.engine.transfer_sync_read(
                    self.remote.peer, stage.data_ptr(), self.remote.addr + off, n
                ),
                "read",
                off,
                n,
            )
            return stage[:n].numpy().tobytes()

    def write(self, off: int, data: bytes) -> None:
        """Write `data` at `off` (through `staged`)."""
        with self.staged([(off, torch.uint8, (len(data),))]) as (stage,):
            stage.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    @contextmanager
    def staged(self, regions: list[Region]) -> Iterator[list[torch.Tensor]]:
        """A tensor in the registered staging bytes for each (offset, dtype, shape) region
        of the slot, each at a 64-byte boundary there, for the caller to fill (rows are
        copied once, wherever they live: a GPU in production); written to the slot in one
        batch when the `with` ends without an error. RuntimeError, before anything is
        staged, for a region outside the slot."""
        sizes = []
        for off, dtype, shape in regions:
            n = dtype.itemsize
            for d in shape:
                n *= d
            self._check(off, n)
            sizes.append(n)
        starts = [0]
        for n in sizes[:-1]:
            starts.append(starts[-1] + (n + 63) // 64 * 64)
        with _STAGING.lock:
            stage = _STAGING.fit(self.engine, starts[-1] + sizes[-1])
            yield [
                stage[at : at + n].view(dtype).view(shape)
                for (_, dtype, shape), at, n in zip(regions, starts, sizes, strict=True)
            ]
            srcs = [stage.data_ptr() + at for at in starts]
            dsts = [self.remote.addr + off for off, _, _ in regions]
            status = self.engine.batch_transfer_sync_write(self.remote.peer, srcs, dsts, sizes)
            self._done(status, "write", regions[0][0], sum(sizes))

    def _done(self, status: int, what: str, off: int, n: int) -> None:
        if status != 0:
            raise RuntimeError(
                f"Mooncake {what} of {n} bytes at offset {off} of {self.remote} failed "
                f"(status {status}: is the trainer at {self.remote.peer} still running?)"
            )
