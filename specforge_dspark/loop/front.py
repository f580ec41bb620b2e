"""One stable address in front of the serving drafter's servers (a pool of one or more
replicas), so that a swap drops no request: every request is forwarded to the member with
the fewest in flight; `replace(old, new)` puts `new` in `old`'s place and returns once
`old` has none in flight, and only then is the old server stopped (loop/round.py: one
member at a time, a rolling restart). `close()` takes no new request and returns once
every request taken is answered. Requests and their answers pass through unchanged (the
API key header included)."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}


class Front:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 600.0):
        self.backends: list[str] = []
        self.timeout_s = timeout_s
        self.inflight: Counter[str] = Counter()
        self.counts = {"forwarded": 0, "failed": 0}
        self.open = 0  # requests taken and not yet answered to their clients
        self.cond = threading.Condition()
        self.server = ThreadingHTTPServer((host, port), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def switch(self, backend: str, drain_timeout_s: float = 600.0) -> None:
        """New requests go to `backend` alone; returns when the others have none in flight."""
        with self.cond:
            old, self.backends = self.backends, [backend]
            self._drain([b for b in old if b != backend], drain_timeout_s)

    def add(self, backend: str) -> None:
        """`backend` joins the pool."""
        with self.cond:
            if backend not in self.backends:
                self.backends.append(backend)

    def replace(self, old: str, new: str, drain_timeout_s: float = 600.0) -> None:
        """`new` takes `old`'s place in the pool; returns when `old` has none in flight."""
        with self.cond:
            if old not in self.backends:
                raise ValueError(f"front: {old} is not in the pool {self.backends}")
            self.backends = [new if b == old else b for b in self.backends]
            self._drain([old], drain_timeout_s)

    def _drain(self, olds: list[str], timeout_s: float) -> None:
        """Wait (holding self.cond) until none of `olds` has a request in flight."""
        if not self.cond.wait_for(lambda: all(self.inflight[o] == 0 for o in olds), timeout_s):
            busy = {o: self.inflight[o] for o in olds if self.inflight[o]}
            raise TimeoutError(f"front: requests still in flight at {busy} after {timeout_s:g}s")

    def close(self, drain_timeout_s: float = 600.0) -> None:
        """No new request is taken; returns once those in flight are answered."""
        self.server.shutdown()
        self.server.server_close()
        with self.cond:
            self.cond.wait_for(lambda: self.open == 0, drain_timeout_s)

    def _forward(self, method: str, path: str, headers: dict, body: bytes | None):
        with self.cond:
            if not self.backends:
                return 503, {}, b"front: no serving backend yet"
            backend = min(self.backends, key=lambda b: self.inflight[b])  # the least busy
            self.inflight[backend] += 1
        try:
            req = urllib.request.Request(backend + path, body, headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    status, out_headers, data = r.status, dict(r.headers), r.read()
            except urllib.error.HTTPError as e:  # the backend's own answer: passed on
                status, out_headers, data = e.code, dict(e.headers), e.read()
            with self.cond:
                self.counts["forwarded"] += 1
            return status, out_headers, data
        except OSError as e:
            with self.cond:
                self.counts["failed"] += 1
            return 502, {}, f"front: {backend} failed: {e}".encode()
        finally:
            with self.cond:
                self.inflight[backend] -= 1
                self.cond.notify_all()

    def _handler(self):
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self, method: str) -> None:
                with front.cond:
                    front.open += 1
                try:
                    self._answer(method)
                finally:
                    with front.cond:
                        front.open -= 1
                        front.cond.notify_all()

            def _answer(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                status, out_headers, data = front._forward(method, self.path, headers, body)
                self.send_response(status)
                for k, v in out_headers.items():
                    if k.lower() not in HOP_HEADERS:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()

            def do_GET(self):  # noqa: N802
                self._relay("GET")

            def do_POST(self):  # noqa: N802
                self._relay("POST")

            def log_message(self, *args):
                pass

        return Handler
