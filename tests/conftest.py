"""Shared fixtures: hermetic environment and the cached tiny Inkling target."""

from __future__ import annotations

import os
import sys
import time
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
os.environ.setdefault("TRITON_CACHE_DIR", str(REPO / ".cache" / "triton"))
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Tests read the logs of the processes they start while those run (a step logged, a
# server's line): unbuffered, as under `make test`, also for a test run on its own.
os.environ.setdefault("PYTHONUNBUFFERED", "1")
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

# `make test` runs two pytest-xdist workers (--dist loadgroup). A session fixture that
# starts a server or trains a reference run is built once per worker, so every module that
# uses one goes to that fixture's group; any other module is a group of its own (its module
# fixtures stay on one worker).
SHARED_GROUPS = {
    "sglang_server": "sglang",
    "chunked_server": "sglang",
    "trained_export": "sglang",
    "inkling_server": "inkling",
    "tp2_server": "inkling",
    "calibrated_inkling_run": "inkling",
    "vllm_server": "vllm",
}
# The longest groups first, so that the two workers end together (a scheduling hint: a
# stale entry costs balance, never correctness). Measured with --durations on 2026-12-03.
LONGEST_FIRST = [
    "sglang", "inkling", "test_faults_lifecycle", "test_serve_dflash", "vllm", "test_faults_worker"
]  # fmt: skip

# In-process runs (world size 1) rendezvous on MASTER_PORT: one per xdist worker.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
os.environ.setdefault("MASTER_PORT", str(29511 + 100 * int(_WORKER.removeprefix("gw") or 0)))


_GROUPS: dict[str, str] = {}  # test module path -> its xdist group
_GROUP_SERVERS: dict[str, list] = {}  # group -> the live servers of its session fixtures


def _serving(fixture: str, server):
    """`server`, stopped as soon as the last test of `fixture`'s group has run (not at the
    end of the session: an idle TP 2 CPU server keeps half a core busy)."""
    _GROUP_SERVERS.setdefault(SHARED_GROUPS[fixture], []).append(server)
    return server


def _group(module_items) -> str:
    for item in module_items:
        for name in getattr(item, "fixturenames", ()):
            if name in SHARED_GROUPS:
                return SHARED_GROUPS[name]
    return module_items[0].module.__name__.rpartition(".")[2]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Mark every test that needs a live server `server` (`make test-quick` leaves them out),
    put each module in its xdist group, and order the groups longest first."""
    modules: dict[str, list] = {}
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
        modules.setdefault(item.nodeid.partition("::")[0], []).append(item)
    groups = {path: _group(module_items) for path, module_items in modules.items()}
    _GROUPS.update(groups)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid.partition("::")[0]]))

    def rank(item) -> int:
        group = groups[item.nodeid.partition("::")[0]]
        return LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a module's tests keep their order


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """A group runs contiguously on one worker: once the next test is another group's,
    stop this group's servers (their fixtures' own teardown then finds them stopped)."""
    group = _GROUPS.get(item.nodeid.partition("::")[0])
    if nextitem is None or _GROUPS.get(nextitem.nodeid.partition("::")[0]) != group:
        for server in _GROUP_SERVERS.pop(group, []):
            server.__exit__(None, None, None)


_STARTED = time.monotonic()
_BUSY: dict[str, list[float]] = {}  # worker -> [seconds in tests, when its last test ended]
_GROUP_SECONDS: dict[tuple[str, str], float] = {}  # (group, worker) -> seconds


def pytest_runtest_logreport(report):
    """The suite's cost, per worker and per xdist group (on the controller)."""
    node = getattr(report, "node", None)
    worker = node.gateway.id if node is not None else "main"
    busy = _BUSY.setdefault(worker, [0.0, 0.0])
    busy[0] += report.duration
    busy[1] = time.monotonic() - _STARTED
    group = report.nodeid.rpartition("@")[2] if "@" in report.nodeid else "-"
    _GROUP_SECONDS[group, worker] = _GROUP_SECONDS.get((group, worker), 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Print where the suite's time went: each worker's busy seconds and when it went idle
    (a worker idle long before the other is time a better group order would save), and the
    costliest groups."""
    if set(_BUSY) <= {"main"}:  # one process: --durations says it all
        return
    write = terminalreporter.write_line
    write("")
    for worker, (busy, last) in sorted(_BUSY.items()):
        write(f"worker {worker}: {busy:.0f} s in tests, last test ended {last:.0f} s in")
    top = sorted(_GROUP_SECONDS.items(), key=lambda kv: -kv[1])[:12]
    write("costliest groups: " + ", ".join(f"{g} on {w} {s:.0f} s" for (g, w), s in top))


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
    from specforge_dspark.targets.target import build

    return build(REPO / ".cache" / "tiny_target", log=lambda *a: None)


@pytest.fixture(scope="session")
def tiny_qwen3_dir() -> Path:
    """The tiny Qwen3 target at .cache/tiny_qwen3 (what SGLang's CPU engine serves)."""
    from specforge_dspark.targets.target import build

    return build(REPO / ".cache" / "tiny_qwen3", arch="qwen3", log=lambda *a: None)


@pytest.fixture(scope="session")
def sglang_server(tiny_qwen3_dir, tmp_path_factory):
    """One live CPU SGLang server for the tiny Qwen3 target, shared by the session's
    tests (aux layers 0, 1, 2; fp32; whole prefills), on a host of its own: a network
    namespace behind a veth pair (tests/netns.py; else the loopback address 127.0.0.2).
    Yields the LiveServer (`url`, `host`, `log_path`, `pid`)."""
    from tests.live_sglang import LiveServer
    from tests.netns import ServerHost

    with ServerHost() as host:
        if host.why:
            print(f"sglang_server: on {host.address}: {host.why}")
        log_dir = tmp_path_factory.mktemp("sglang")
        with LiveServer(tiny_qwen3_dir, log_dir, host.address, host.python) as server:
            yield _serving("sglang_server", server)


@pytest.fixture(scope="session")
def calibrated_inkling_run(tmp_path_factory, tiny_target_dir) -> Path:
    """A DSpark drafter trained 150 steps against the tiny Inkling target (hf backend, GSM8K
    reference answers), its SGLang export calibrated by export.calibrate_prompts. Shared
    by the calibration tests and SGLang Inkling's DSPARK judge."""
    import subprocess
    import sys

    from tests.live_sglang import free_port

    out = tmp_path_factory.mktemp("calibrate_tiny") / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), "train.py", "--recipe", "recipes/tiny_cpu.yaml",
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
        yield _serving("inkling_server", server)


@pytest.fixture(scope="session")
def vllm_server(tiny_qwen3_dir, tmp_path_factory):
    """One live CPU vLLM feature server (extract_hidden_states + our connector) for the
    tiny Qwen3 target, shared by the session's tests (aux layers 0, 1, 2; fp32)."""
    from tests.live_vllm import LiveVLLM

    with LiveVLLM(tiny_qwen3_dir, tmp_path_factory.mktemp("vllm")) as server:
        yield _serving("vllm_server", server)


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


@pytest.fixture
def writer_maps(monkeypatch):
    """A fresh slot_writer.SLOTS for the test (the writer side's mappings, a server's, here
    in this process), closed after it: on CUDA they are pinned, and a pinned mapping must
    not outlive its test."""
    from specforge_dspark.transport.slot_writer import SlotMaps

    maps = SlotMaps()
    monkeypatch.setattr("specforge_dspark.transport.slot_writer.SLOTS", maps)
    yield maps
    maps.close()
