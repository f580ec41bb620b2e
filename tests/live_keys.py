"""The live test servers' API key (tests/live_sglang.py, tests/live_vllm.py start them with
it) and the checks of it that the live tests share."""

from __future__ import annotations

import json
import os
import secrets
import stat
from concurrent.futures import Future
from pathlib import Path

import pytest

from specforge_dspark.engines.server import post_json

API_KEY_ENV = "SFDSPARK_TEST_API_KEY"
"""The live test servers listen with the key in this variable of the test process (set
here, inherited by the trainers the tests start); recipes attach with
target.<engine>.api_key_env naming it (`attach_key`)."""
os.environ.setdefault(API_KEY_ENV, secrets.token_urlsafe(24))


def refused_without_key(url: str, body: dict) -> None:
    """A POST of `body` to `url` without the API key is refused (401)."""
    fut: Future = Future()
    post_json(url, json.dumps(body).encode(), 60.0, fut)
    with pytest.raises(RuntimeError, match="HTTP 401"):
        fut.result()


def key_kept_private(out: Path) -> None:
    """The key a run generated for the server it started is in a file only the job's user
    reads, and in neither the job's log nor the server's (whose arguments are logged)."""
    key_file = out / "sglang_server_rank0.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    server_log = (out / "sglang_server_rank0.log").read_text()
    assert key_file.read_text() not in (out / "job.log").read_text() + server_log
    assert "<api-key>" in server_log, server_log[-3000:]


def attach_key(extra: tuple[str, ...] | list[str], engine: str = "sglang") -> list[str]:
    """The override that gives a trainer the live servers' key, when `extra` attaches it
    to one (target.<engine>.url or urls); a server it starts makes its own key."""
    attached = any(e.startswith(f"target.{engine}.url") for e in extra)
    return [f"target.{engine}.api_key_env={API_KEY_ENV}"] if attached else []
