"""Shared fixtures: hermetic environment and the cached tiny Inkling target."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HOME", str(REPO / ".cache" / "hf"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))


SERVER_FIXTURES = {"sglang_server", "chunked_server"}


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
    from specforge_dspark.tiny_target import build

    return build(REPO / ".cache" / "tiny_target", log=lambda *a: None)


@pytest.fixture(scope="session")
def tiny_qwen3_dir() -> Path:
    """The tiny Qwen3 target at .cache/tiny_qwen3 (what SGLang's CPU engine serves)."""
    from specforge_dspark.tiny_target import build

    return build(REPO / ".cache" / "tiny_qwen3", arch="qwen3", log=lambda *a: None)


@pytest.fixture(scope="session")
def sglang_server(tiny_qwen3_dir, tmp_path_factory):
    """One live CPU SGLang server for the tiny Qwen3 target, shared by the session's
    tests (aux layers 0, 1, 2; fp32; whole prefills). Yields its base URL."""
    from tests.live_sglang import LiveServer

    with LiveServer(tiny_qwen3_dir, tmp_path_factory.mktemp("sglang")) as server:
        yield server
