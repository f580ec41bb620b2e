"""What a server we start is launched with, whatever the engine: its interpreter (the
engine's own environment, checked: `engine_python`), its environment (`launch_env`:
torchrun's variables dropped, since the server is one process group of its own, not a
peer of the trainer, and no CPU-engine setting inherited; `cpu_thread_binding`,
`prepend_path` for what a CPU server adds) and its flags (`cli_flag`)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

CPU_SHIMS_ROOT = Path(__file__).resolve().parent / "cpu" / "shims"
CPU_ENGINE_VARS = {"SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET"}
"""Set only for the CPU-engine servers we start (engines/cpu/README.md), never inherited."""
LAUNCHER_VARS = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
}  # fmt: skip

# Run by an engine's own interpreter: is `module` importable, and is our plugin registered
# under entry-point group `group` there? (exit 3: no module, 4: no plugin)
_PROBE = """import importlib.metadata as m, importlib.util as u, sys
if u.find_spec(sys.argv[1]) is None: sys.exit(3)
names = {e.name for e in m.entry_points(group=sys.argv[2])} if sys.argv[2] else {""}
sys.exit(0 if not sys.argv[2] or "specforge_dspark" in names else 4)"""


def engine_python(python: str, key: str, module: str, group: str | None = None) -> str:
    """The interpreter of the engine's own environment (recipe key `key`): a path, relative
    to the working directory, or a name on PATH. Checked before a server starts: `module`
    must import there and, with `group`, our package's plugin must be registered there
    (`pip install --no-deps -e .` in that environment). Returns the executable's path."""
    exe = python if os.sep in python else shutil.which(python)
    make = f"make {module}-venv"
    if exe is None or not Path(exe).is_file():
        raise ValueError(
            f"{key}: no Python interpreter at {python} (the {module} server's environment: "
            f"run `{make}`, or point {key} at an environment with {module} installed)"
        )
    # -I: not the working directory (an in-tree egg-info would answer for the environment)
    probe = subprocess.run([exe, "-I", "-c", _PROBE, module, group or ""], capture_output=True)
    if probe.returncode == 3:
        raise ValueError(f"{key}: {exe} cannot import {module} (run `{make}`)")
    if probe.returncode == 4:
        raise ValueError(
            f"{key}: our plugin is not registered in {exe}'s environment (entry point "
            f"group {group}): run `{exe} -m pip install --no-deps -e .` in this repository"
        )
    if probe.returncode != 0:
        raise ValueError(f"{key}: {exe} failed: {probe.stderr.decode()[-500:]}")
    return exe


def launch_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) without torchrun's variables (their
    rendezvous would make the engine's own distributed init wait for peers) and without
    the CPU engine's settings (CPU_ENGINE_VARS, the shims of cpu/shims/ on PYTHONPATH): a
    trainer started from a shell or a job that ran a CPU server must not turn a GPU server
    into one. The engines' `server_env` adds them back for the CPU servers we start."""
    env = dict(os.environ if base is None else base)
    for key in list(env):
        if key in LAUNCHER_VARS or key in CPU_ENGINE_VARS or key.startswith("TORCHELASTIC_"):
            del env[key]
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not _is_shim(p)]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        env.pop("PYTHONPATH", None)
    return env


def _is_shim(path: str) -> bool:
    try:
        return Path(path).resolve().is_relative_to(CPU_SHIMS_ROOT)
    except (OSError, ValueError):
        return False


def cpu_thread_binding(
    ranks: int, setting: str, env: dict[str, str], cores: list[int] | None = None
) -> str:
    """The CPU engine's per-rank cores (`setting`, e.g. SGLANG_CPU_OMP_THREADS_BIND), `a-b|c-d`:
    this process's cores split into `ranks` contiguous groups, each at most OMP_NUM_THREADS
    of `env` cores where that is set (an engine rank otherwise runs one OpenMP thread per
    core it is given, and two spinning OpenMP teams on shared cores slow each other 10-30x).
    ValueError when there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if len(cores) < ranks:
        raise ValueError(
            f"target server_args: {ranks} CPU-engine ranks (tensor x data x pipeline parallel) "
            f"need as many cores, this host gives {len(cores)}; set {setting}"
        )
    size, extra = divmod(len(cores), ranks)
    cap = int(env["OMP_NUM_THREADS"]) if env.get("OMP_NUM_THREADS", "").isdigit() else None
    groups, start = [], 0
    for r in range(ranks):
        group = cores[start : start + size + (r < extra)]
        start += len(group)
        group = group[:cap] if cap else group
        groups.append(f"{group[0]}-{group[-1]}" if len(group) > 1 else str(group[0]))
    return "|".join(groups)


def prepend_path(env: dict[str, str], path: Path) -> None:
    """Put `path` first on env's PYTHONPATH (inherited by the processes the server spawns)."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)


def cli_flag(key: str, value: Any) -> list[str]:
    """A server argument by field name: `tp_size: 8` -> ["--tp-size", "8"]."""
    flag = "--" + key.replace("_", "-")
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, list | tuple):
        return [flag, *map(str, value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
