"""A stand-in engine server for lifecycle drills (stdlib only, starts in ~50 ms):
`python -m tests.standin_server --port N [--children K] [--api-key KEY]` answers 200 on
every GET at 127.0.0.1:N, with K `sleep` children in its process group standing in for
SGLang's scheduler and detokenizer. Launched through `EngineServer`, as a real server is.
With an API key it refuses (401) a GET without `Authorization: Bearer KEY` outside
/health*, as SGLang does, and logs its arguments, key included, as SGLang does."""

from __future__ import annotations

import argparse
import subprocess
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Ok(BaseHTTPRequestHandler):
    api_key = ""

    def do_GET(self) -> None:
        allowed = not self.api_key or self.path.startswith("/health")
        allowed = allowed or self.headers.get("Authorization") == f"Bearer {self.api_key}"
        self.send_response(200 if allowed else 401)
        self.end_headers()
        self.wfile.write(b"ok" if allowed else b"Unauthorized")

    def log_message(self, *args) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--children", type=int, default=1)
    ap.add_argument("--api-key", default="")
    args = ap.parse_args()
    Ok.api_key = args.api_key
    for _ in range(args.children):
        subprocess.Popen(["sleep", "600"])
    print(f"stand-in server on port {args.port}, server_args={vars(args)}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", args.port), Ok).serve_forever()


if __name__ == "__main__":
    main()
