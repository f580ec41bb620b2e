"""The import shims of CPU-engine SGLang servers (engines/cpu_shims/).

The sgl_kernel op is checked against SGLang's own Triton kernel, run by Triton's
interpreter on this CPU (TRITON_INTERPRET=1, in a subprocess: the variable must be set
before triton is imported). The shims reach only the servers that need them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specforge_dspark.engines.sglang import CPU_SHIMS, server_env

REPO = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from tests.sglang_shim import import_sglang
    alloc = import_sglang("sglang.srt.mem_cache.allocation")  # the GPU (Triton) path
    sys.path.insert(0, sys.argv[1])
    import sgl_kernel
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        B = int(torch.randint(1, 6, (1,), generator=g))
        rows = torch.randperm(8, generator=g)[:B]
        start = torch.randint(0, 40, (B,), generator=g)
        end = start + torch.randint(0, 90, (B,), generator=g)  # runs longer than a block
        locs = torch.randint(0, 10**6, (int((end - start).sum()),), generator=g)
        want = torch.randint(-9, 0, (8, 160), generator=g, dtype=torch.int32)
        got = want.clone()
        alloc.assign_req_to_token_pool[(B,)](rows, want, start, end, locs, 160, 8)
        sgl_kernel.assign_req_to_token_pool_cpu(rows, got, start, end, locs, 160)
        assert torch.equal(got, want), (trial, (got != want).nonzero()[:5])
    try:
        from sgl_kernel import fused_add_rmsnorm  # noqa: F401
    except ImportError as e:
        print("unknown name refused:", e)
    else:
        raise AssertionError("the shim must refuse names it does not provide")
    print("ok")
    """
)


def test_sgl_kernel_shim_equals_sglang_triton_kernel():
    pytest.importorskip("triton")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    r = subprocess.run(
        [sys.executable, "-c", CHECK, str(CPU_SHIMS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    assert "unknown name refused" in r.stdout


def test_shims_reach_cpu_engine_servers_only():
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/elsewhere", "RANK": "1", "MASTER_PORT": "29500"}
    gpu = server_env(cpu_engine=False, base=base)
    assert gpu["PYTHONPATH"] == "/elsewhere" and "SGLANG_USE_CPU_ENGINE" not in gpu
    cpu = server_env(cpu_engine=True, base=base)
    assert cpu["PYTHONPATH"].split(os.pathsep) == [str(CPU_SHIMS), "/elsewhere"]
    assert cpu["SGLANG_USE_CPU_ENGINE"] == "1"
    for env in (gpu, cpu):  # torchrun's rendezvous must not reach SGLang's own init
        assert "RANK" not in env and "MASTER_PORT" not in env
