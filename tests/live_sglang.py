"""A real SGLang server on this CPU for tests: the tiny Qwen3 target, started through
the sglang backend's own launcher (engines/sglang.py), so the flags, import shims and
environment under test are the ones training uses."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.engines.sglang import ServerProcess, launch_args
from specforge_dspark.training.stream import FeatureStream
from tests.live_keys import API_KEY_ENV

LAYERS = [0, 1, 2]
START_TIMEOUT_S = 300.0
_PORT_DRAWS = random.Random()  # its own generator: a test that seeds `random` changes nothing
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now that nothing but an explicit bind can take before its server binds
    it: drawn below the kernel's ephemeral range. A port from bind(0) is an ephemeral one,
    which every listener bound to port 0 (gloo's pairs at TP 2, Mooncake's handshake) may
    take in the tens of seconds a CPU SGLang server loads before uvicorn binds its port;
    uvicorn then exits with status 3 (its start-up failure). Each pytest-xdist worker draws
    from its own half of 10000-21999 (SGLang draws its nccl_port from 22000-29999; our
    in-process rendezvous ports are 29511 + 100 x worker)."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    low = 10000 + 6000 * (worker % 2)
    for port in _PORT_DRAWS.sample(range(low, low + 6000), 200):
        if port in _HANDED_OUT:  # its server may still be loading, not yet bound
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{low + 5999}")


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


def kill_server_mid_run(
    job: subprocess.Popen, out: Path, engine: str, at_step: int, steps: int, recipe: str
) -> float:
    """SIGKILL the process group of the `engine` server `job` (torchrun, started without
    waiting, on 2 ranks of one node) started, once it has logged step `at_step` in
    <out>/metrics.jsonl. The server is the one its pid file names (<out>/<engine>_server_
    rank0.pid; the session leader of its group), not the lowest pid whose command line
    matches (after a wrap of the pid space that can be one of its children; CI once saw a
    drill's run finish with status 0). The ranks are frozen (SIGSTOP) while the kill
    lands, so none finishes the run on features it fetched before. The drill fails
    when it would not land: the job ended, or fewer than target.prefetch + 2 steps were
    left (the prefetched batches, and a rank a step ahead; target.prefetch read from
    `recipe`, the run's own). Returns the time of the kill."""
    from specforge_dspark.config.recipe import load_recipe

    target = load_recipe(recipe).target
    prefetch = target.prefetch
    # the recipe's own bounds: the server's start, then each step's request deadline
    limit = getattr(target, engine).startup_timeout_s + at_step * target.timeout_s
    deadline = time.monotonic() + limit
    while last_step(out) < at_step:
        assert job.poll() is None, (out / "job.log").read_text()[-3000:]
        assert time.monotonic() < deadline, f"no step {at_step} within {limit:g}s ({recipe})"
        time.sleep(0.1)
    ranks = [int(p) for p in subprocess.check_output(["pgrep", "-P", str(job.pid)]).split()]
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        reached = last_step(out)
        assert reached <= steps - prefetch - 2, (
            f"the fault would not land: the run was at step {reached} of {steps} when its "
            f"ranks were frozen, with target.prefetch={prefetch} in {recipe}"
        )
        server = int((out / f"{engine}_server_rank0.pid").read_text())
        assert os.getpgid(server) == server, f"server pid {server} leads no process group"
        os.killpg(server, signal.SIGKILL)  # the server and every process it started
        return time.monotonic()
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)


def last_step(out: Path) -> int:
    """The last step <out>/metrics.jsonl logged a loss for (0: none yet)."""
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return max((m["step"] for m in map(json.loads, lines) if "loss" in m), default=0)


def assert_failed_on_the_death(log_text: str, server: str, took: float, recipe: str) -> str:
    """A job whose server was killed must fail because it saw the death, not because a
    request ran out of time: the line naming `server` says it died or failed, not that it
    did not answer within target.timeout_s, and the job ended before that deadline (read
    from `recipe`, the run's own; no fixed number of seconds, which load can break).
    Returns the line."""
    from specforge_dspark.config.recipe import load_recipe

    deadline = load_recipe(recipe).target.timeout_s
    named = [line for line in log_text.splitlines() if server in line]
    assert named, log_text[-3000:]
    assert not any("within target.timeout_s" in line for line in named), named
    assert took < deadline, (
        f"the job took {took:.1f}s to fail after the server died: as long as the request "
        f"deadline (target.timeout_s={deadline:g}s in {recipe}), so it did not see the death"
    )
    return named[0]


def collect_features(
    recipe, batches, window=None
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(rows, aux, last) of each batch; with `window` (S -> (lo, W), FeatureStream.window)
    the rows of positions [lo, lo + W) only, rows then each sequence's count of them."""
    with FeatureStream(recipe) as stream:
        stream.window = window
        out = []
        for f in stream.iterate(batches):
            f = f.to("cpu")  # where the trainer's features land: fp8 aux rows dequantized
            rows = f.lengths - (f.row0 or 0)
            rows = rows.clamp(0, f.aux_hidden.shape[1])
            out.append((rows, f.aux_hidden.clone(), f.last_hidden.clone()))
        return out


def windowed(whole, window):
    """What `collect_features(..., window)` should give, cut from every position's features."""
    out = []
    for lengths, aux, last in whole:
        lo, W = window(aux.shape[1])
        pad = [
            torch.cat((t[:, lo : lo + W], t.new_zeros(t.shape[0], W, t.shape[2])), 1)
            for t in (aux, last)
        ]
        out.append(((lengths - lo).clamp(0, W), pad[0][:, :W], pad[1][:, :W]))
    return out
