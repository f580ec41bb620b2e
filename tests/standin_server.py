"""A stand-in engine server for lifecycle drills (stdlib only, starts in ~50 ms):
`python -m tests.standin_server --port N [--children K]` answers 200 on every GET at
127.0.0.1:N, with K `sleep` children in its process group standing in for SGLang's
scheduler and detokenizer. Launched through `EngineServer`, as a real server is."""

from __future__ import annotations

import argparse
import subprocess
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--children", type=int, default=1)
    args = ap.parse_args()
    for _ in range(args.children):
        subprocess.Popen(["sleep", "600"])
    print(f"stand-in server on port {args.port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", args.port), Ok).serve_forever()


if __name__ == "__main__":
    main()
