"""Shared fixtures: hermetic environment and the cached tiny Inkling target."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HOME", str(REPO / ".cache" / "hf"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
os.environ.setdefault("VLLM_CACHE_ROOT", str(REPO / ".cache" / "vllm"))
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
# The venvs install without bytecode (pip --no-compile); a sandbox that forbids writing it
# makes every launched process compile torch and the engines from source again.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


SERVER_FIXTURES = {
    "sglang_server",
    "chunked_server",
    "vllm_server",
    "inkling_server",
    "tp2_server",
}


def pytest_collection_modifyitems(config, items):
    """Mark every test that needs a live server `server` (`make test-quick` leaves them out)."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny ops: on two shared cores a second OpenMP
    thread only adds stalls. Modules opt in with `pytestmark = usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    """The tiny target at .cache/tiny_target, built once (cached by its build key)."""
    from specforge_dspark.tiny.target import build

    return build(REPO / ".cache" / "tiny_target", log=lambda *a: None)


@pytest.fixture(scope="session")
def tiny_qwen3_dir() -> Path:
    """The tiny Qwen3 target at .cache/tiny_qwen3 (what SGLang's CPU engine serves)."""
    from specforge_dspark.tiny.target import build

    return build(REPO / ".cache" / "tiny_qwen3", arch="qwen3", log=lambda *a: None)


@pytest.fixture(scope="session")
def sglang_server(tiny_qwen3_dir, tmp_path_factory):
    """One live CPU SGLang server for the tiny Qwen3 target, shared by the session's
    tests (aux layers 0, 1, 2; fp32; whole prefills). Yields its base URL."""
    from tests.live_sglang import LiveServer

    with LiveServer(tiny_qwen3_dir, tmp_path_factory.mktemp("sglang")) as server:
        yield server


@pytest.fixture(scope="session")
def calibrated_inkling_run(tmp_path_factory, tiny_target_dir) -> Path:
    """A DSpark drafter trained 150 steps against the tiny Inkling target (hf backend, GSM8K
    reference answers), its SGLang export calibrated by export.calibrate_prompts. Shared
    by the calibration tests and SGLang Inkling's DSPARK judge."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("calibrate_tiny") / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", "29741", "train.py", "--recipe", "recipes/tiny_cpu.yaml",
        "--resume", "none", f"train.output_dir={out}", "train.max_steps=150",
        "train.eval_interval=0", "checkpoint.save_interval=150",
        "tracking.enabled=false", "export.formats=[sglang]", "train.preflight_samples=0",
        "export.calibrate_prompts=12", "export.calibrate_workloads=[gsm8k,math500]",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "STS temperatures" in r.stdout + r.stderr
    return out


@pytest.fixture(scope="session")
def inkling_server(tiny_target_dir, tmp_path_factory):
    """One live CPU SGLang server running SGLang's own Inkling for the tiny Inkling
    target (its SGLang layout, Triton's interpreter) at tensor-parallel size 2, the
    production topology's TP > 1, shared by the session's tests. Inkling at TP 1 is what
    the DSPARK and DFLASH judges serve (test_sglang_inkling.py, test_serve_dflash.py)."""
    from tests.live_sglang import LiveServer

    with LiveServer(tiny_target_dir, tmp_path_factory.mktemp("inkling"), tp_size=2) as server:
        yield server


@pytest.fixture(scope="session")
def vllm_server(tiny_qwen3_dir, tmp_path_factory):
    """One live CPU vLLM feature server (extract_hidden_states + our connector) for the
    tiny Qwen3 target, shared by the session's tests (aux layers 0, 1, 2; fp32)."""
    from tests.live_vllm import LiveVLLM

    with LiveVLLM(tiny_qwen3_dir, tmp_path_factory.mktemp("vllm")) as server:
        yield server


@pytest.fixture(scope="session")
def trained_export(tiny_qwen3_dir, tmp_path_factory) -> Path:
    """A tiny drafter trained 200 steps against the tiny Qwen3 target (hf backend),
    exported in both layouts: returns the SGLang one, `../speculators` beside it holds the
    same weights for vLLM (one training run feeds both judges)."""
    import subprocess
    import sys

    from tests.live_sglang import free_port

    out = tmp_path_factory.mktemp("served_draft")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), "train.py", "--recipe", "recipes/tiny_cpu_sglang.yaml",
        "--resume", "none", "target.backend=hf", f"train.output_dir={out}",
        "train.max_steps=200", "train.eval_interval=0", "checkpoint.save_interval=200",
        "data.max_rows=600", "tracking.enabled=false", "export.formats=[sglang,speculators]",
        "train.preflight_samples=0",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "export" / "sglang"
