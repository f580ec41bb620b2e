"""The loop's front (loop/front.py) and its pool of replicas: requests streaming through
the front while its members are replaced one at a time (a rolling restart; one member:
blue/green) are all answered, each old member has nothing in flight when it stops, and
the loop replaces its replicas in that order without ever serving from fewer."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from specforge_dspark.config.recipe import load_recipe
from specforge_dspark.engines.launch import free_port
from specforge_dspark.loop.front import Front
from tests.test_loop_core import _fake_generate

REPO = Path(__file__).resolve().parents[1]


def _backend(name: str, seen: dict) -> tuple:
    """(server, url): answers each POST after 50 ms (so some are in flight at a swap) with
    its name; `seen[name]` gets each request's (start, end), the end recorded before the
    answer leaves (the front sees the request end after it)."""
    seen[name] = []

    def reply(path: str, headers, body: dict) -> dict:
        t0 = time.monotonic()
        time.sleep(0.05)
        seen[name].append((t0, time.monotonic()))
        return {"by": name, "echo": body}

    return _fake_generate(reply)


class _Stream:
    """Four clients sending requests through the front until stopped."""

    def __init__(self, url: str) -> None:
        self.answers: list[tuple[int, int, dict]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(url, k)) for k in range(4)]
        for t in self.threads:
            t.start()

    def _client(self, url: str, k: int) -> None:
        i = 0
        while not self.stop.is_set():
            req = urllib.request.Request(f"{url}/generate", json.dumps({"c": k, "i": i}).encode())
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    self.answers.append((k, i, json.loads(r.read())))
            except OSError as e:
                self.errors.append(repr(e))
            i += 1

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def _wait(seen: dict, names: list[str], n: int = 6) -> None:
    while any(len(seen[m]) < n for m in names):
        time.sleep(0.01)


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_rolling_swap_under_a_steady_stream_drops_no_request(replicas):
    """Old members A0..An are replaced by B0..Bn one at a time while requests stream; each
    A is shut down as soon as its replace returns. Every request is answered, each A had
    nothing in flight then, nothing reached it after, and the pool kept its size."""
    seen: dict[str, list] = {}
    olds = [_backend(f"A{i}", seen) for i in range(replicas)]
    news = [_backend(f"B{i}", seen) for i in range(replicas)]
    front = Front()
    for _, url in olds:
        front.add(url)
    stream = _Stream(front.url)
    _wait(seen, [f"A{i}" for i in range(replicas)])  # every member serves: least busy first
    swapped, sizes = {}, []
    for i, ((a, a_url), (_, b_url)) in enumerate(zip(olds, news, strict=True)):
        front.replace(a_url, b_url)
        swapped[f"A{i}"] = time.monotonic()
        sizes.append(len(front.backends))
        a.shutdown()
        a.server_close()  # the old server stops: nothing may still need it
        _wait(seen, [f"B{i}"])
    stream.join()
    front.close()
    for b, _ in news:
        b.shutdown()
    assert stream.errors == [] and front.counts["failed"] == 0
    assert sizes == [replicas] * replicas
    for name, at in swapped.items():
        assert seen[name] and all(end <= at for _, end in seen[name]), name  # drained first
    by = [ans["by"] for _, _, ans in stream.answers]
    assert all(by.count(name) == len(times) for name, times in seen.items())
    assert all(ans["echo"] == {"c": k, "i": i} for k, i, ans in stream.answers)
    with pytest.raises(ValueError, match="is not in the pool"):
        front.replace(olds[0][1], news[0][1])


def test_the_loop_replaces_its_replicas_one_at_a_time(tiny_qwen3_dir, tmp_path, monkeypatch):
    """loop.replicas: 2. Version 0's two servers start behind the front; serving version 1
    puts its first server in place of 0's first (which stops), then starts its second and
    puts it in place of 0's second: never fewer than two servers serve."""
    from specforge_dspark.loop.round import Loop, Served

    events, live, seen = [], set(), {}

    def start(loop, version: int, export=None) -> Served:
        name = f"v{version}.{sum(e[1] == version for e in events if e[0] == 'start')}"
        server, url = _backend(name, seen)
        events.append(("start", version, name, len(live)))
        live.add(name)

        def stop() -> None:
            live.discard(name)
            events.append(("stop", version, name, len(live)))
            server.shutdown()
            server.server_close()

        return Served(version, SimpleNamespace(stop=stop), url)

    monkeypatch.setattr(Loop, "start", start)
    base = tmp_path / "export"
    base.mkdir()
    recipe = load_recipe(REPO / "recipes/tiny_cpu_sglang.yaml", [
        f"target.path={tiny_qwen3_dir}", f"loop.dir={tmp_path / 'loop'}", f"loop.serve_from={base}",
        "loop.replicas=2", f"loop.listen=127.0.0.1:{free_port()}",
    ])  # fmt: skip
    loop = Loop(recipe, log=lambda s: None)
    assert loop.front.url == f"http://{recipe.loop.listen}"  # the address users were told
    assert json.loads((tmp_path / "loop" / "front.json").read_text())["url"] == loop.front.url
    try:
        assert loop.ensure_serving().version == 0
        stream = _Stream(loop.front.url)
        _wait(seen, ["v0.0", "v0.1"], n=3)
        loop.lineage.add(str(base), 0, None, round=0)
        loop.serve(loop.start(1))
        _wait(seen, ["v1.0", "v1.1"], n=3)
        stream.join()
        assert stream.errors == [] and loop.front.counts["failed"] == 0
        assert [p.version for p in loop.pool] == [1, 1]
    finally:
        loop.close()
    assert [(e[0], e[2]) for e in events] == [
        ("start", "v0.0"), ("start", "v0.1"), ("start", "v1.0"), ("stop", "v0.0"),
        ("start", "v1.1"), ("stop", "v0.1"), ("stop", "v1.0"), ("stop", "v1.1"),
    ]  # fmt: skip
    assert min(e[3] for e in events[2:6] if e[0] == "stop") >= 2  # two serve at every stop


def test_closing_the_front_answers_the_requests_in_flight_first():
    """close() stops taking requests (a new one is refused) and returns only once the one
    in flight has its answer: the loop stops its servers after that."""
    got, release, events = threading.Event(), threading.Event(), []

    def reply(path: str, headers, body: dict) -> dict:
        got.set()
        release.wait(30)
        events.append("replied")
        return {"echo": body}

    backend, url = _fake_generate(reply)
    front = Front()
    front.add(url)
    answers = []

    def client() -> None:
        req = urllib.request.Request(f"{front.url}/generate", json.dumps({"i": 1}).encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            answers.append(json.loads(r.read()))

    asking = threading.Thread(target=client, daemon=True)
    asking.start()
    assert got.wait(30)
    closer = threading.Thread(target=lambda: (front.close(), events.append("closed")), daemon=True)
    closer.start()
    refused = None
    while refused is None:  # the listening socket closes first
        try:
            urllib.request.urlopen(f"{front.url}/generate", b"{}", timeout=5).close()
        except (urllib.error.URLError, ConnectionResetError) as e:
            # reset: queued as the socket closed, never taken; then refused
            refused = e if isinstance(getattr(e, "reason", None), ConnectionRefusedError) else None
    assert closer.is_alive()  # still waiting for the request in flight
    release.set()
    closer.join(30)
    asking.join(30)
    backend.shutdown()
    assert events == ["replied", "closed"] and answers == [{"echo": {"i": 1}}]
