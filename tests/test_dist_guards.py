"""Guards of a multi-node start: ZeRO-3 refused at load, the process-group timeout from the
recipe, and the barrier after every node's server answered (distributed.py).

The barrier test runs two real gloo ranks through `init_distributed`: rank 1's "server"
answers later than dist.timeout_s. With `wait_for_every_rank` first, the next collective
succeeds; without it (the control, so that the test can fail), rank 0's collective times
out after dist.timeout_s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.live_sglang import free_port

REPO = Path(__file__).resolve().parents[1]

RANK = r"""
import sys, time, torch, torch.distributed as dist
from specforge_dspark.config.recipe import load_recipe
from specforge_dspark.training import distributed as d

recipe = load_recipe("recipes/tiny_cpu.yaml", [
    "dist.timeout_s=3", "target.backend=sglang", "target.sglang.startup_timeout_s=60",
    "target.max_restarts=0"])  # mid-run restarts would have to fit in dist.timeout_s
rank, world, _ = d.init_distributed(recipe)
mode = sys.argv[1]
if rank == 1:
    time.sleep(6)  # this node's server answers 6 s after the other's: > dist.timeout_s
if mode == "barrier":
    d.wait_for_every_rank()
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
    print(f"rank {rank}: collective ok")
except Exception as e:
    print(f"rank {rank}: collective failed after {time.monotonic() - t0:.1f}s: {type(e).__name__}")
"""


def _two_ranks(mode: str) -> list[str]:
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env["MASTER_PORT"] = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, mode],
            cwd=REPO,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    return [next((ln for ln in o.splitlines() if ln.startswith("rank ")), o[-800:]) for o in outs]


def test_a_slow_server_on_one_node_passes_the_startup_barrier_not_the_pg_timeout():
    assert _two_ranks("barrier") == ["rank 0: collective ok", "rank 1: collective ok"]
    control = _two_ranks("none")[0]
    assert control.startswith("rank 0: collective failed after"), control
    assert 2.0 < float(control.split("after ")[1].split("s:")[0]) < 6.0, control


def test_zero_stage_3_is_refused_at_load_naming_the_key():
    p = subprocess.run(
        [sys.executable, "train.py", "--recipe", "recipes/tiny_cpu.yaml", "--dry-run"]
        + ["dist.zero_stage=3"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert "dist.zero_stage must be 0, 1 or 2, got 3: ZeRO-3 partitions" in p.stderr


def test_the_process_group_timeout_comes_from_the_recipe(monkeypatch):
    import deepspeed

    from specforge_dspark.config.recipe import load_recipe
    from specforge_dspark.training import distributed

    seen = {}
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.update(kw))
    monkeypatch.setattr("torch.distributed.get_world_size", lambda *a: 1)
    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(var, value)  # undone after the test (init sets them by default)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    recipe = load_recipe(REPO / "recipes" / "tiny_cpu.yaml", ["dist.timeout_s=1234"])
    distributed.init_distributed(recipe)
    assert seen["timeout"].total_seconds() == 1234
    assert not torch.are_deterministic_algorithms_enabled()
    recipe = load_recipe(REPO / "recipes" / "tiny_cpu.yaml", ["dist.deterministic=true"])
    try:
        distributed.init_distributed(recipe)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
    assert distributed.startup_timeout_s(recipe) == 0.0  # hf: no server to wait for
