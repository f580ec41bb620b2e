"""Regeneration on an SGLang server's /generate (token ids in, token ids out), against a
fake server; and the refusal of input ids that `<id>#k` sample ids could collide with."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from data_pipelines.regen_jobs import check_ids
from data_pipelines.regenerate import main

OPENING_ID, GREEDY_BASE = 300, 400


class FakeGenerate(ThreadingHTTPServer):
    """/generate: a sampled request (temperature > 0) answers OPENING_ID + i; a greedy one
    answers ids that depend on every input id (so a continuation shows what it was fed);
    a prompt containing `stop_at` answers that id first and finishes with "stop"."""

    daemon_threads = True

    def __init__(self, stop_at: int | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.stop_at = stop_at

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def greedy_ids(ids: list[int], n: int) -> list[int]:
    return [GREEDY_BASE + (sum(ids) + k) % 50 for k in range(n)]


class _Handler(BaseHTTPRequestHandler):
    server: FakeGenerate

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.bodies.append(body)
        p, ids = body["sampling_params"], body["input_ids"]
        n = p["max_new_tokens"]
        if self.path != "/generate":
            return self._reply(404, {"error": "not found"})
        finish = {"type": "length", "length": n}
        if p["temperature"] > 0:
            out = [OPENING_ID + i for i in range(n)]
        else:
            out = greedy_ids(ids, n)
        if self.server.stop_at is not None:
            out, finish = [self.server.stop_at], {"type": "stop", "matched": self.server.stop_at}
        self._reply(200, {"text": "", "output_ids": out, "meta_info": {"finish_reason": finish}})

    def _reply(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake():
    servers: list[FakeGenerate] = []

    def start(**kw) -> FakeGenerate:
        srv = FakeGenerate(**kw)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _argv(tmp_path, target, url: str, rows: list[dict], *flags: str) -> list[str]:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target:\n  path: {target}\n")
    out = tmp_path / "o.jsonl"
    argv = ["--recipe", str(recipe), "--input", str(src), "--out", str(out), "--quiet"]
    return [*argv, "--backend", "sglang", "--url", url, "--retries", "0", *flags]


def test_sglang_backend_continues_the_opening_from_its_very_ids(tmp_path, tiny_target_dir, fake):
    from data_pipelines.backends import ChatTokens

    srv = fake()
    rows = [{"id": "a", "question": "Who are you?"}]
    argv = _argv(tmp_path, tiny_target_dir, srv.url, rows)
    argv += ["--answers-per-prompt", "2", "--opening-tokens", "3", "--max-new-tokens", "8"]
    argv += ["--opening-temperature", "0.7", "--chat-template-kwargs", '{"enable_thinking": false}']
    assert main(argv) == 0
    chat = ChatTokens(str(tiny_target_dir), {"enable_thinking": False})
    prompt = chat.prompt_ids([{"role": "user", "content": "Who are you?"}])
    by_len = sorted(srv.bodies, key=lambda b: len(b["input_ids"]))
    plain = [
        b for b in by_len if b["input_ids"] == prompt and b["sampling_params"]["temperature"] == 0
    ]
    opening = [b for b in by_len if b["sampling_params"]["temperature"] > 0]
    cont = [b for b in by_len if len(b["input_ids"]) > len(prompt)]
    assert len(srv.bodies) == 3 and len(plain) == len(opening) == len(cont) == 1
    assert plain[0]["sampling_params"]["max_new_tokens"] == 8
    p = opening[0]["sampling_params"]
    assert opening[0]["input_ids"] == prompt
    assert (p["max_new_tokens"], p["temperature"], p["top_p"], p["top_k"]) == (3, 0.7, 1.0, -1)
    assert set(p["stop_token_ids"]) == chat.eos_ids
    sampled = [OPENING_ID, OPENING_ID + 1, OPENING_ID + 2]
    assert cont[0]["input_ids"] == prompt + sampled  # token-exact: no detokenize / retokenize
    assert cont[0]["sampling_params"]["max_new_tokens"] == 5
    assert cont[0]["sampling_params"]["temperature"] == 0.0
    got = {r["id"]: r for r in map(json.loads, (tmp_path / "o.jsonl").open())}
    assert sorted(got) == ["a", "a#1"]
    want = chat.parse(sampled + greedy_ids(prompt + sampled, 5)).content
    assert got["a#1"]["messages"][-1]["content"] == want
    assert got["a"]["messages"][-1]["content"] == chat.parse(greedy_ids(prompt, 8)).content
    assert got["a#1"]["finish_reasons"] == ["length"]


def test_sglang_backend_stops_where_the_server_stopped(tmp_path, tiny_target_dir, fake):
    from data_pipelines.backends import ChatTokens

    chat = ChatTokens(str(tiny_target_dir), {})
    srv = fake(stop_at=next(iter(chat.eos_ids)))
    argv = _argv(tmp_path, tiny_target_dir, srv.url, [{"id": "a", "question": "q"}])
    assert main([*argv, "--answers-per-prompt", "2", "--opening-tokens", "3"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").open()]
    errors = [json.loads(line) for line in (tmp_path / "o.errors.jsonl").open()]
    # an opening that ends the turn is not continued; an empty answer is an error row
    assert len(srv.bodies) == 2 and rows == []
    assert {e["reason"] for e in errors} == {"empty_response"}


def test_sample_ids_that_could_collide_are_refused_before_generating(tmp_path, capsys, fake):
    srv = fake()
    rows = [{"id": "a", "question": "q"}, {"id": "a#1", "question": "q2"}]
    argv = _argv(
        tmp_path, "/nowhere", srv.url, rows, "--answers-per-prompt", "2", "--opening-tokens", "2"
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"row {tmp_path / 'in.jsonl'}:1: id 'a#1' contains '#'" in err
    assert srv.bodies == [] and not (tmp_path / "o.jsonl").exists()
    files = [str(tmp_path / "in.jsonl")]
    assert check_ids(files, 0, 1) is None  # one answer per row: no "<id>#k" ids are made
    assert check_ids(files, 1, 2) is None  # only the rows regenerated count (data.max_rows)
