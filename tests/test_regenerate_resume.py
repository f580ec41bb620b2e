"""Regeneration against a fake OpenAI-compatible server: SIGKILL mid-run, resume, and
every input id is in the output exactly once with the server's answers."""

from __future__ import annotations

import hashlib
import json
import random
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


def answer_for(messages: list[dict]) -> str:
    """The fake server's deterministic answer to a conversation so far."""
    key = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class FakeServer(ThreadingHTTPServer):
    """/v1/chat/completions with random latency; after `quota` requests every further
    request waits at `gate` (so a test can kill the client with requests in flight)."""

    daemon_threads = True

    def __init__(self, quota: int) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.quota = quota
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = self.waiting = 0
        self.flaky_seen: set[str] = set()

    def handle_error(self, request, client_address) -> None:
        pass  # clients killed mid-request: expected here

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with s.lock:
            s.requests.append(body)
            s.in_flight += 1
            s.max_in_flight = max(s.max_in_flight, s.in_flight)
            held = len(s.requests) > s.quota
            s.waiting += held
        try:
            if held:
                s.gate.wait()
            time.sleep(random.uniform(0.0, 0.03))
            self._answer(body)
        finally:
            with s.lock:
                s.in_flight -= 1
                s.waiting -= held

    def _answer(self, body: dict) -> None:
        last = body["messages"][-1]["content"]
        status, payload = 200, None
        if self.path != "/v1/chat/completions":
            status, payload = 404, {"error": "not found"}
        elif "FAIL400" in last:
            status, payload = 400, {"error": "context too long"}
        elif "FLAKY" in last and last not in self.server.flaky_seen:
            self.server.flaky_seen.add(last)
            status, payload = 503, {"error": "busy"}
        if payload is None:
            ans = answer_for(body["messages"])
            msg = {"role": "assistant", "content": "A-" + ans, "reasoning_content": "R-" + ans}
            payload = {"choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]}
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    srv = FakeServer(quota=14)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.gate.set()
    srv.shutdown()
    srv.server_close()


def make_input(path: Path) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Input rows; returns {id: prompts (system/user turns)} and {id: error reason}."""
    good: dict[str, list[dict]] = {}
    bad: dict[str, str] = {}
    lines: list[str] = []

    def add(row, rid=None, prompts=None, reason=None) -> None:
        lines.append(row if isinstance(row, str) else json.dumps(row, ensure_ascii=False))
        rid = rid or f"{path}:{len(lines) - 1}"
        if reason:
            bad[rid] = reason
        else:
            good[rid] = prompts

    for i in range(10):
        sys_msg = {"role": "system", "content": f"system {i}"}
        turns = [{"role": "user", "content": f"q{i}a"}, {"role": "user", "content": f"q{i}b ☃"}]
        msgs = [sys_msg, turns[0], {"role": "assistant", "content": "old"}, turns[1]]
        add({"id": f"m{i}", "messages": msgs}, f"m{i}", [sys_msg, *turns])
        conv = [{"from": "human", "value": f"s{i}"}, {"from": "gpt", "value": "old"}]
        add({"id": i, "conversations": conv}, str(i), [{"role": "user", "content": f"s{i}"}])
        add({"question": f"p{i}", "answer": "old"}, prompts=[{"role": "user", "content": f"p{i}"}])
    add({"turns": ["t1", "t2"]}, prompts=[{"role": "user", "content": t} for t in ("t1", "t2")])
    add('{"id": "broken", ', reason="bad_json")
    add({"id": "m3", "messages": []}, f"m3@{path}:{len(lines)}", reason="duplicate_id")
    add({"id": "f", "question": "FAIL400 please"}, "f", reason="http_400")
    flaky = [{"role": "user", "content": "FLAKY once"}]
    add({"id": "flaky", "question": "FLAKY once"}, "flaky", flaky)
    add(
        {"id": "t", "messages": [{"role": "tool", "content": "x"}]},
        "t",
        reason="tool_turns_unsupported",
    )
    add({"id": "s", "messages": [{"role": "system", "content": "x"}]}, "s", reason="no_user_turn")
    path.write_text("\n".join(lines) + "\n")
    return good, bad


def expected_messages(prompts: list[dict]) -> list[dict]:
    out, history = [], []
    for m in prompts:
        out.append(m)
        history.append(m)
        if m["role"] == "user":
            ans = answer_for(history)
            history.append({"role": "assistant", "content": "A-" + ans})
            out.append(
                {"role": "assistant", "content": "A-" + ans, "reasoning_content": "R-" + ans}
            )
    return out


def test_sigkill_and_resume_is_exactly_once(tmp_path, server, repo):
    src = tmp_path / "prompts.jsonl"
    good, bad = make_input(src)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "data:\n  regenerate:\n    backend: openai\n"
        f"    url: {server.url}\n    model: tiny\n    concurrency: 4\n    max_new_tokens: 32\n"
        "    temperature: 0.7\n    top_p: 0.9\n    chat_template_kwargs: {enable_thinking: true}\n"
    )
    out = tmp_path / "regen.jsonl"
    cmd = [sys.executable, "-m", "data_pipelines.regenerate", "--recipe", str(recipe)]
    cmd += ["--input", str(src), "--out", str(out), "--retries", "2", "--quiet"]

    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while server.waiting < 4:  # all four concurrent requests held at the gate
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "regenerate never filled its 4 request slots"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    first = out.read_text().splitlines()
    assert 0 < len(first) < len(good)
    with out.open("a") as f:
        f.write('{"id": "m9", "messages": [{"ro')  # a line torn by the kill

    server.gate.set()
    done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(good) and len(ids) == len(set(ids))
    for r in rows:
        assert r["messages"] == expected_messages(good[r["id"]]), r["id"]
        assert r["finish_reasons"] == ["stop"] * sum(m["role"] == "user" for m in good[r["id"]])
    errors = [
        json.loads(line) for line in (tmp_path / "regen.errors.jsonl").read_text().splitlines()
    ]
    assert {e["id"]: e["reason"] for e in errors} == bad and len(errors) == len(bad)

    assert server.max_in_flight >= 2  # concurrency > 1 really happened
    order = {rid: k for k, rid in enumerate(good)}
    assert [order[i] for i in ids] != sorted(order[i] for i in ids)  # finished out of order
    for body in server.requests:
        assert body["model"] == "tiny" and body["max_tokens"] == 32
        assert body["temperature"] == 0.7 and body["top_p"] == 0.9
        assert body["chat_template_kwargs"] == {"enable_thinking": True}
        assert all(set(m) == {"role", "content"} for m in body["messages"])
    assert "written this run" in done.stdout
