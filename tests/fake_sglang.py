"""A fake SGLang server on 127.0.0.1 for the sglang backend's failure tests
(test_engine_sglang.py).

It injects what a real server does rarely (stalls, HTTP errors, a missing plugin, rows
out of order, a failing writer): it speaks SGLang's `/health_generate` and `/generate` and
hands the request through our plugin hook (`append_prefill_hidden_states`) with stand-in
scheduler objects laid out as SGLang 0.5.23's: a batch's rows in one flat tensor with
offsets, a split prefill as one call per chunk (middle chunks with store=False).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import torch

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.engines.sglang_plugin import append_prefill_hidden_states

H, LAYERS = 128, [0, 1, 2]  # the tiny target's hidden size
WRITE_DELAY_S = 0.5


def fake_features(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic bf16 'server' features: aux [n, 3H], last [n, H]."""
    x = torch.tensor(ids, dtype=torch.float32)[:, None]
    aux = x * 0.5 + torch.arange(3 * H, dtype=torch.float32)[None, :] * 1e-2
    last = -x + torch.arange(H, dtype=torch.float32)[None, :] * 1e-3
    return aux.bfloat16(), last.bfloat16()


class Mode:
    full = SimpleNamespace(is_full=lambda: True, is_last=lambda: False)


class FakeServer:
    """behaviour: ok | stall | down (stalls, health 503) | http500 | noplugin | chunked | gap
    | late (replies first, writes WRITE_DELAY_S later: a TP rank that does not reply)
    | broken (hands the writer rows it cannot copy: an error inside the writer).
    With `key` set, a POST or a GET of /server_info without `Authorization: Bearer <key>`
    is refused (401) as SGLang refuses it; `auths` records each POST's Authorization."""

    def __init__(self):
        self.behaviour = "ok"
        self.key = ""
        self.auths: list[str | None] = []
        self.release = threading.Event()
        self.bodies: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, payload=None):
                body = json.dumps(payload).encode() if payload is not None else b""
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _refused(self) -> bool:
                if fake.key and self.headers.get("Authorization") != f"Bearer {fake.key}":
                    self._reply(401, {"error": "Unauthorized"})
                    return True
                return False

            def do_GET(self):
                if self.path == "/server_info" and self._refused():
                    return None
                if self.path == "/server_info" and fake.behaviour != "down":
                    info = {"model_path": "tiny", "dtype": "float32", "quantization": None}
                    return self._reply(200, info)  # what a pool compares (pool.py)
                healthy = self.path == "/health_generate" and fake.behaviour != "down"
                self._reply(200 if healthy else 503 if fake.behaviour == "down" else 404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.auths.append(self.headers.get("Authorization"))
                if self._refused():
                    return None
                fake.bodies.append(body)
                if fake.behaviour in ("stall", "down"):
                    fake.release.wait(30)
                if fake.behaviour == "http500":
                    return self._reply(500, {"error": {"message": "boom"}})
                if fake.behaviour == "late":  # the reply leaves before the write lands
                    threading.Timer(WRITE_DELAY_S, fake.schedule, (body,)).start()
                elif fake.behaviour != "noplugin":
                    fake.schedule(body)
                out = [
                    {"text": "", "meta_info": {"id": r, "finish_reason": {"type": "length"}}}
                    for r in body["rid"]
                ]
                self._reply(200, out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def schedule(self, body: dict) -> None:
        """Extend batches as SGLang runs them: flat rows, then the per-request handler.

        chunked: every sequence is prefilled in two chunks, two batches (the first
        with the middle chunks); gap: the second chunk claims to start one row late."""
        seqs = body["input_ids"]
        if self.behaviour not in ("chunked", "gap"):
            self._extend(body["rid"], seqs, [(0, len(ids)) for ids in seqs], middle=False)
            return
        cut = [max(1, len(ids) // 2) for ids in seqs]
        self._extend(body["rid"], seqs, [(0, c) for c in cut], middle=True)
        late = 1 if self.behaviour == "gap" else 0
        rest = [(c + late, len(ids)) for c, ids in zip(cut, seqs, strict=True)]
        self._extend(body["rid"], seqs, rest, middle=False)

    def _extend(self, rids, seqs, spans, middle: bool) -> None:
        feats = [fake_features(ids[lo:hi]) for ids, (lo, hi) in zip(seqs, spans, strict=True)]
        device = "meta" if self.behaviour == "broken" else "cpu"  # meta: no bytes to copy
        out = SimpleNamespace(
            hidden_states=torch.cat([a for a, _ in feats]).to(device),
            last_hidden_states=torch.cat([h for _, h in feats]).to(device),
        )
        offset = 0
        for rid, (lo, hi) in zip(rids, spans, strict=True):
            req = SimpleNamespace(rid=rid, inflight_middle_chunks=int(middle), extend_end=hi)
            offset = append_prefill_hidden_states(
                None,
                None,
                req=req,
                logits_output=out,
                hidden_state_offset=offset,
                capture_hidden_mode=Mode.full,
                extend_input_len=hi - lo,
                store=not middle,
            )
        assert offset == out.hidden_states.shape[0]

    def recover(self):
        self.behaviour = "ok"
        self.release.set()

    def close(self):
        self.release.set()
        self.httpd.shutdown()


def sglang_recipe(target_dir, url: str, **target):
    return recipe_from_dict(
        {
            "target": {
                "path": str(target_dir),
                "backend": "sglang",
                "prefetch": 2,
                "timeout_s": 20,
                "sglang": {"url": url, "startup_timeout_s": 5},
            }
            | target,
            "draft": {"target_layer_ids": LAYERS, "num_target_layers": 4, "vocab_size": 1088},
        }
    )


class S:
    def __init__(self, sid, n):
        self.sample_id, self.input_ids, self.loss_mask = sid, list(range(3, 3 + n)), [1] * n
