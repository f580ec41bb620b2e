"""A host of its own for a test server: a network namespace reached from the test process
only over a veth pair (iproute2, as root), so a server there shares no network stack with
the trainer and its features cross a real link. Where the sandbox refuses namespaces the
server gets its own loopback address instead (127.0.0.2), and `why` says so.

    with ServerHost() as host:   # host.address: where the server listens
        ...LiveServer(..., host=host.address, python=host.python)...
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class ServerHost:
    """A namespace `sfd<n>` with veth `sfd<n>h` (test side, 10.213.x.y+1) and `sfd<n>n`
    (namespace side, +2), and `python`: SGLang's interpreter run inside it."""

    def __init__(self):
        n = os.getpid() % 16384
        base = (n % 64) * 4
        self.name, self.subnet = f"sfd{n}", f"10.213.{n // 64}"
        self.host_side, self.address = f"{self.subnet}.{base + 1}", f"{self.subnet}.{base + 2}"
        self.python, self.why, self.made = str(SGLANG_PYTHON), "", False
        self.wrapper_dir: Path | None = None
        try:
            self._make()
        except (OSError, subprocess.SubprocessError) as e:
            err = getattr(e, "stderr", "") or str(e)
            self.close()
            self.address, self.why = "127.0.0.2", f"no network namespace ({err.strip()[:200]})"

    def _make(self) -> None:
        ns, h, s = self.name, f"{self.name}h", f"{self.name}n"
        _ip("netns", "add", ns)
        self.made = True
        _ip("link", "add", h, "type", "veth", "peer", "name", s)
        _ip("link", "set", s, "netns", ns)
        _ip("addr", "add", f"{self.host_side}/30", "dev", h)
        _ip("link", "set", h, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{self.address}/30", "dev", s)
        _ip("netns", "exec", ns, "ip", "link", "set", s, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        self.wrapper_dir = Path(tempfile.mkdtemp(prefix="sfd-netns-"))
        wrapper = self.wrapper_dir / "python"
        wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {ns} "{SGLANG_PYTHON}" "$@"\n')
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        self.python = str(wrapper)

    def __enter__(self) -> ServerHost:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.made:  # the veth pair goes with the namespace
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", f"{self.name}h"], capture_output=True, timeout=30)
            self.made = False
        if self.wrapper_dir is not None:
            shutil.rmtree(self.wrapper_dir, ignore_errors=True)
            self.wrapper_dir = None
