"""The import shims of CPU-engine SGLang servers (engines/cpu/shims/).

The sgl_kernel ops are checked against SGLang's own Triton kernels, run by Triton's
interpreter on this CPU (TRITON_INTERPRET=1, in a subprocess: the variable must be set
before triton is imported). The shims reach only the servers that need them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from specforge_dspark.engines.sglang import CPU_SHIMS, server_env

REPO = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from tests.sglang_shim import import_sglang
    alloc = import_sglang("sglang.srt.mem_cache.allocation")  # the GPU (Triton) paths
    locs_ops = import_sglang("sglang.kernels.ops.speculative.cache_locs")
    move_ops = import_sglang("sglang.kernels.ops.kvcache.cache_move")
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
        # the reverse gather: cache slots of each request's run into out_cache_loc
        pool = torch.randint(0, 10**6, (8, 160), generator=g, dtype=torch.int32)
        want = torch.full((int((end - start).sum()),), -1, dtype=torch.int64)
        got = want.clone()
        locs_ops.assign_extend_cache_locs[(B,)](rows, pool, start, end, want, 160, 8)
        sgl_kernel.assign_extend_cache_locs_cpu(rows, pool, start, end, got, 160)
        assert torch.equal(got, want) and bool((got >= 0).all()), trial
        # rows copied inside every layer's K/V buffer, sources read before targets written
        before = [torch.randn(50, 2, 8, generator=g) for _ in range(3)]
        want, got = [b.clone() for b in before], [b.clone() for b in before]
        stride = torch.tensor([b[0].numel() * 4 for b in before])
        tgt = torch.randperm(50, generator=g)[:6]
        src = torch.cat([tgt[3:], torch.randint(0, 50, (3,), generator=g)])  # overlapping
        ptrs = lambda bufs: torch.tensor([b.data_ptr() for b in bufs])
        move_ops.copy_all_layer_kv_cache_tiled[(3, 1)](ptrs(want), stride, tgt, src, 6, 8, 64)
        sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs(got), stride, tgt, src)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), trial
        assert not all(torch.equal(a, b) for a, b in zip(got, before)), "nothing was copied"
    try:
        from sgl_kernel import fused_add_rmsnorm  # noqa: F401
    except ImportError as e:
        print("unknown name refused:", e)
    else:
        raise AssertionError("the shim must refuse names it does not provide")
    print("ok")
    """
)


def test_sgl_kernel_shim_equals_sglang_triton_kernels():
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
