"""One engine core, CPU bridges apart (issue 33), checked on the source and in a subprocess.

- Engines share one core (engines/server.py, engines/served.py, transport/): no module
  named after one engine imports a module named after another, and the core imports no
  engine module; the transport package, whose slot writer runs inside every engine's venv
  (installed there with --no-deps), imports only the standard library, torch and itself.
- The CPU bridges (engines/cpu/) never reach a GPU server: its launch environment has no
  engines/cpu path and no TRITON_INTERPRET, the SGLang plugin's `register()` imports
  engines.cpu only in a CPU-engine process, and nothing else in the product imports it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from specforge_dspark.engines import server, sglang, vllm

REPO = Path(__file__).resolve().parents[1]
ROOT = "specforge_dspark"
ENGINES = REPO / ROOT / "engines"
TRANSPORT = REPO / ROOT / "transport"
PACKAGE = f"{ROOT}.engines"
SEAM = ("engines", "transport", "serving")  # the packages an engine's modules live in
WRITER_SIDE = {p.stem for p in TRANSPORT.glob("*.py") if p.stem != "__init__"}
CORE = ("engines.server", "engines.served", *(f"transport.{m}" for m in sorted(WRITER_SIDE)))
OPTIONAL = {"mooncake": "mooncake"}  # module -> the package it imports on first use only
CPU_PATH = str(ENGINES / "cpu")


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, function-local ones included, by absolute name."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _engine_modules() -> dict[str, set[str]]:
    """module of engines/, transport/ or serving/ (name under specforge_dspark, e.g.
    engines.sglang) -> the modules of those packages it imports."""
    out = {}
    for package in SEAM:
        for path in sorted((REPO / ROOT / package).rglob("*.py")):
            if "shims" in path.parts:
                continue
            out[_module(path).removeprefix(ROOT + ".")] = {
                m.removeprefix(ROOT + ".")
                for m in _imports(path)
                if m.split(".")[:2] in ([ROOT, p] for p in SEAM)
            }
    return out


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def test_no_engine_module_imports_another_engines_module():
    bad = []
    for name, imported in _engine_modules().items():
        for engine, other in (("vllm", "sglang"), ("sglang", "vllm")):
            if engine in _leaf(name):
                bad += [f"{name} -> {m}" for m in imported if other in _leaf(m)]
    assert not bad, f"an engine module imports another engine's: {bad}"


def test_the_core_imports_no_engine_module():
    modules = _engine_modules()
    bad = [
        f"{core} -> {m}"
        for core in CORE
        for m in modules[core]
        if "sglang" in _leaf(m) or "vllm" in _leaf(m) or m.startswith("engines.cpu")
    ]
    assert not bad, bad


def test_the_slot_writer_imports_only_what_every_engine_venv_has():
    """The writer side, transport/: stdlib, torch, each other (installed with --no-deps);
    mooncake.py also Mooncake, imported when a request names a Mooncake slot."""
    transport = f"{ROOT}.transport"
    bad = []
    for name in WRITER_SIDE:
        for m in _imports(TRANSPORT / f"{name}.py"):
            top = m.split(".")[0]
            ours = m == transport or m.removeprefix(transport + ".").split(".")[0] in WRITER_SIDE
            if top == "specforge_dspark" and not ours:
                bad.append(f"{name} -> {m}")
            elif top not in ("specforge_dspark", "torch", "__future__", OPTIONAL.get(name)):
                if top not in sys.stdlib_module_names:
                    bad.append(f"{name} -> {m}")
    assert not bad, bad


def test_only_the_cpu_package_and_the_plugin_import_the_cpu_bridges():
    sources = [REPO / "train.py"]
    for pkg in ("specforge_dspark", "evaluation", "data_pipelines", "scripts"):
        sources += sorted((REPO / pkg).rglob("*.py"))
    allowed = {ENGINES / "sglang_plugin.py"}
    bad = [
        str(path.relative_to(REPO))
        for path in sources
        if path not in allowed
        and ENGINES / "cpu" not in path.parents
        and any(m == f"{PACKAGE}.cpu" or m.startswith(f"{PACKAGE}.cpu.") for m in _imports(path))
    ]
    assert not bad, f"engines.cpu imported outside engines/cpu and the plugin: {bad}"


def _no_cpu_bridge(env: dict[str, str]) -> None:
    assert "TRITON_INTERPRET" not in env and "SGLANG_USE_CPU_ENGINE" not in env
    assert not any(p.startswith(CPU_PATH) for p in env.get("PYTHONPATH", "").split(os.pathsep))


def test_a_gpu_servers_environment_has_no_cpu_bridge(monkeypatch, tmp_path):
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/elsewhere", "RANK": "3"}
    _no_cpu_bridge(sglang.server_env(cpu_engine=False, base=base, interpret_triton=True))
    _no_cpu_bridge(vllm.server_env(cpu=False, triton_interpreter=True, base=base))
    inherited = {  # a trainer started from a shell (or a job) that set up a CPU server
        **base,
        "SGLANG_USE_CPU_ENGINE": "1",
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(sglang.CPU_SHIMS), "/elsewhere", str(vllm.CPU_SHIMS)]),
    }
    for gpu in (sglang.server_env(False, base=inherited), vllm.server_env(False, base=inherited)):
        _no_cpu_bridge(gpu)
        assert gpu["PYTHONPATH"] == "/elsewhere"  # the user's own paths stay
    cpu = sglang.server_env(cpu_engine=True, base=base)  # the contrast: a CPU-engine server
    assert cpu["PYTHONPATH"].split(os.pathsep)[0].startswith(CPU_PATH)
    for shims in (sglang.CPU_SHIMS, vllm.CPU_SHIMS):  # the paths the CPU servers get exist
        assert shims.is_dir() and Path(CPU_PATH) in shims.parents
    assert (sglang.CPU_SHIMS / "sgl_kernel" / "__init__.py").is_file()
    assert (vllm.CPU_SHIMS / "sitecustomize.py").is_file()

    launched: list[tuple[list[str], dict[str, str]]] = []

    class Popen:  # what the launcher would start, and with which environment
        pid = 12345

        def __init__(self, command, env=None, **kwargs):
            if server.REAPER not in command:  # the server's, not its reaper's (reaper.py)
                launched.append((command, env))

    monkeypatch.setattr(server.subprocess, "Popen", Popen)
    monkeypatch.setattr(sglang, "engine_python", lambda *a: "/engine/python")
    monkeypatch.setattr(vllm, "engine_python", lambda *a: "/engine/python")
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = ["--attention-backend", "triton"]
    sglang.ServerProcess("python", args, tmp_path / "sglang.log", cpu_engine=False)
    vllm.VLLMServerProcess("python", [], tmp_path / "vllm.log", False, "k", True)
    assert [c[:3] for c, _ in launched] == [
        ["/engine/python", "-m", "sglang.launch_server"],
        ["/engine/python", "-m", "vllm.entrypoints.openai.api_server"],
    ]
    for _, env in launched:
        _no_cpu_bridge(env)


REGISTER = textwrap.dedent(
    """
    import os, sys
    from tests.sglang_shim import import_sglang
    registry = import_sglang("sglang.srt.plugins.hook_registry")
    from specforge_dspark.engines import sglang_plugin
    sglang_plugin.register()  # a GPU server's plugin: SGLANG_USE_CPU_ENGINE unset
    loaded = sorted(m for m in sys.modules if m.startswith("specforge_dspark.engines.cpu"))
    print("gpu:", loaded)
    registry.HookRegistry.reset()
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # the contrast: a CPU-engine server
    sglang_plugin.register()
    print("cpu:", "specforge_dspark.engines.cpu.sglang" in sys.modules)
    """
)


def test_the_plugin_of_a_gpu_server_never_imports_the_cpu_bridges():
    assert importlib.util.find_spec("sglang"), "make setup installs sglang (--no-deps) in .venv"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    r = subprocess.run(
        [sys.executable, "-c", REGISTER],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "gpu: []" in r.stdout and "cpu: True" in r.stdout, r.stdout + r.stderr[-2000:]


def test_each_cpu_vllm_server_gets_the_cores_its_live_siblings_use_least(monkeypatch, tmp_path):
    """Two vLLM CPU workers pinned to one core: the second never came up while the first
    answered requests (the loop's gate starting a candidate beside the serving server).
    Each server this process starts takes the least bound cores, and gives them back when
    it stops; a binding the user set is left alone."""
    from collections import Counter

    launched: list[dict[str, str]] = []

    class Popen:
        pid = 12345

        def __init__(self, command, env=None, **kwargs):
            if server.REAPER not in command:
                launched.append(env)

    monkeypatch.setattr(server.subprocess, "Popen", Popen)
    monkeypatch.setattr(server.EngineServer, "stop", lambda self: None)
    monkeypatch.setattr(vllm, "engine_python", lambda *a: "/engine/python")
    monkeypatch.setattr(vllm.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(vllm.VLLMServerProcess, "bound", Counter())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv(vllm.THREADS_BIND, raising=False)

    def start(**kw) -> vllm.VLLMServerProcess:
        return vllm.VLLMServerProcess("python", [], tmp_path / "v.log", True, "k", **kw)

    a, b = start(), start(extra_env={"VLLM_SERVER_DEV_MODE": "1"})
    c = start()
    assert [e[vllm.THREADS_BIND] for e in launched] == ["0", "1", "0"]
    b.stop()
    start()
    assert launched[-1][vllm.THREADS_BIND] == "1"  # b's core, free again
    a.stop()
    c.stop()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    start()
    assert launched[-1][vllm.THREADS_BIND] == "0-1"
    start(extra_env={vllm.THREADS_BIND: "1"})
    monkeypatch.setenv(vllm.THREADS_BIND, "0")
    start()
    assert [e[vllm.THREADS_BIND] for e in launched[-2:]] == ["1", "0"]  # the user's binding
