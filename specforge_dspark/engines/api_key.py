"""The API key of a target server: who talks to it must hold it.

A server the run starts listens with a key (SGLang `--api-key`, vLLM `VLLM_API_KEY`):
`target.<engine>.api_key_env` names an environment variable holding one, else a key is
generated per job. The node's local rank 0 starts the server and writes the key to
`<output_dir>/<engine>_server_rank<node>.key`, created with mode 0600 (only the job's
user reads it), before the server starts and before its pid file is written; the node's
other ranks read it once that pid file is current (served.py), the same file-beside-the-
pid-file discovery by which they already find the server. A file, not a key derived from
a job secret: torchrun gives the ranks no secret in common, and everything it does give
(rendezvous address, run id) is visible to anyone on the hosts.

The key travels to the server in its environment (readable by the job's user only), never
on its command line (`ps` shows that to every user): SGLang reads no variable, so it runs
under `keyed_launch`, which hands the key to SGLang's own argument parser in-process.
Servers log their arguments (SGLang its `api_key` among them), so a keyed server's output
goes through `redact.py`, which writes `<api-key>` in its place to the log file.

Every request of ours carries `Authorization: Bearer <key>` (`auth_headers`); SGLang and
vLLM answer their health paths (/health, /health_generate) without it and refuse
/generate, /server_info and the OpenAI endpoints (/v1/...) without it (401).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

KEY_ENV = "SFDSPARK_API_KEY"
"""The variable through which `keyed_launch` and `redact.py` receive the key."""
REDACTOR = str(Path(__file__).resolve().with_name("redact.py"))


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def from_env(name: str, recipe_key: str) -> str | None:
    """The key in environment variable `name` (recipe key `recipe_key` names it; None when
    it names none); ValueError when the variable is unset or empty."""
    if not name:
        return None
    key = os.environ.get(name, "")
    if not key:
        raise ValueError(
            f"{recipe_key}={name}: the environment variable {name} is not set (or empty) "
            "in this process's environment"
        )
    return key


def write_key_file(path: Path, key: str) -> None:
    """`key` to `path`, created 0600 whatever the umask (a new file, then renamed over
    an earlier job's), its folder made first: the first thing a run writes into
    train.output_dir may be this key (a preflight on a fresh machine)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    os.replace(tmp, path)


def read_key_file(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def section_key(section, engine: str) -> str | None:
    """The key `target.<engine>.api_key_env` names (from_env)."""
    return from_env(section.api_key_env, f"target.{engine}.api_key_env")


def started_key(section, engine: str) -> str:
    """The key a server the run starts listens with (module docstring)."""
    return section_key(section, engine) or secrets.token_urlsafe(32)


def redacting_log(log_path: Path, key: str) -> subprocess.Popen:
    """A process appending what it reads on its stdin to `log_path`, `key` replaced by
    `<api-key>`: a keyed server's stdout and stderr (it ends when they close)."""
    env = {**os.environ, KEY_ENV: key}
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-I", REDACTOR],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
