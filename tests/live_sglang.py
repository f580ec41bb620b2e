"""A real SGLang server on this CPU for tests: the tiny Qwen3 target, started through
the sglang backend's own launcher (engines/sglang.py), so the flags, import shims and
environment under test are the ones training uses."""

from __future__ import annotations

import os
import socket
import time
import urllib.request
from pathlib import Path

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.engines.sglang import ServerProcess, launch_args
from tests.live_keys import API_KEY_ENV

LAYERS = [0, 1, 2]
START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_sglang_recipe(
    target_dir: Path,
    url: str | None = None,
    port: int = 0,
    host: str = "127.0.0.1",
    python: str = ".venv-sglang/bin/python",
    **server_args,
):
    """A recipe whose target is the tiny Qwen3 behind a CPU SGLang server."""
    return recipe_from_dict(
        {
            "target": {
                "path": str(target_dir),
                "backend": "sglang",
                "device": "cpu",
                "prefetch": 3,
                "timeout_s": 60,
                "sglang": {
                    "url": url,
                    "api_key_env": API_KEY_ENV if url else "",
                    "host": host,
                    "port": port,
                    "python": python,
                    "server_args": server_args,
                },
            },
            "draft": {"target_layer_ids": LAYERS, "num_target_layers": 4, "vocab_size": 1088},
            "data": {"max_length": 384},
        }
    )


class LiveServer:
    """`with LiveServer(target, log_dir, **server_args) as s:` s.url, s.log_path, s.pid;
    on `host` (another address: a server the trainer reaches only by network), run by
    `python` (SGLang's interpreter, or a wrapper that runs it elsewhere: tests/netns.py)."""

    def __init__(
        self,
        target_dir: Path,
        log_dir: Path,
        host: str = "127.0.0.1",
        python: str = ".venv-sglang/bin/python",
        **server_args,
    ):
        self.port, self.host = free_port(), host
        self.url = f"http://{host}:{self.port}"
        recipe = tiny_sglang_recipe(
            target_dir, port=self.port, host=host, python=python, **server_args
        )
        self.log_path = Path(log_dir) / f"sglang-{self.port}.log"
        t0 = time.monotonic()
        python = recipe.target.sglang.python  # SGLang's own venv, as the trainer starts it
        self.api_key = os.environ[API_KEY_ENV]
        self.proc = ServerProcess(
            python, launch_args(recipe), self.log_path, cpu_engine=True, api_key=self.api_key
        )
        self.pid = self.proc.proc.pid
        try:
            self._wait_healthy()
        except BaseException:
            self.proc.stop()
            raise
        self.start_seconds = time.monotonic() - t0

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            code = self.proc.exit_code()
            if code is not None:
                raise RuntimeError(f"SGLang test server exited ({code}):\n{self.proc.tail(40)}")
            try:
                with urllib.request.urlopen(f"{self.url}/health_generate", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"SGLang test server not healthy in {START_TIMEOUT_S:g}s")

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stop()
