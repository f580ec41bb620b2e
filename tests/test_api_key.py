"""Nobody talks to our target servers without the key (engines/api_key.py): a server the
run starts listens with one that is on no command line and in no log, the node's ranks
share it through a file only the job's user reads, every request carries it, and an
attached server off the loopback without a key is refused at load."""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest

from specforge_dspark.config.recipe import RecipeError, recipe_from_dict
from specforge_dspark.engines.api_key import (
    KEY_ENV,
    from_env,
    read_key_file,
    section_key,
    started_key,
    write_key_file,
)
from specforge_dspark.engines.server import EngineServer, cmdline, http_ok
from specforge_dspark.engines.sglang import KEYED_LAUNCH
from specforge_dspark.training.stream import FeatureStream
from tests.live_sglang import free_port
from tests.test_engine_sglang import S, server, sglang_recipe  # noqa: F401 (fixture)

VAR = "SFDSPARK_TEST_KEY"


def test_requests_carry_the_key_and_a_server_refuses_those_without(
    server,  # noqa: F811
    tiny_target_dir,
    monkeypatch,
):
    server.key = "k3y-of-this-job"
    monkeypatch.setenv(VAR, server.key)
    recipe = sglang_recipe(tiny_target_dir, server.url)
    recipe.target.sglang.api_key_env = VAR
    with FeatureStream(recipe) as stream:
        got = [f.sample_ids for f in stream.iterate([[S(1, 5)], [S(2, 3)]])]
    assert got == [[1], [2]]
    assert server.auths and set(server.auths) == {f"Bearer {server.key}"}  # probe included

    keyless = sglang_recipe(tiny_target_dir, server.url, max_restarts=0)
    with pytest.raises(RuntimeError, match="start-up probe: HTTP 401"):
        with FeatureStream(keyless) as stream:
            list(stream.iterate([[S(1, 5)]]))
    assert server.auths[-1] is None


def test_a_started_server_gets_the_key_on_no_command_line_and_in_no_log(tmp_path):
    """Launched as the sglang backend launches SGLang (keyed_launch, the key in the
    environment): the stand-in logs its arguments as SGLang does, the key among them."""
    section = recipe_from_dict({}).target.sglang
    key, port = started_key(section, "sglang"), free_port()
    log = tmp_path / "server.log"
    env = {**os.environ, KEY_ENV: key}
    args = ["tests.standin_server", "--port", str(port), "--children", "0"]
    srv = EngineServer(sys.executable, KEYED_LAUNCH, args, log, env, api_key=key)
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()  # up, or exited, or past the recipe's own start-up bound
        while not http_ok(f"{url}/health") and srv.exit_code() is None:
            assert time.monotonic() - t0 < section.startup_timeout_s, "stand-in never came up"
            time.sleep(0.05)
        assert srv.exit_code() is None, log.read_text()[-2000:]
        assert http_ok(f"{url}/server_info", key)
        assert not http_ok(f"{url}/server_info") and not http_ok(f"{url}/server_info", "x")
        assert http_ok(f"{url}/health")  # health paths answer without it, as SGLang's do
        assert f"--port {port}" in cmdline(srv.proc.pid) and key not in cmdline(srv.proc.pid)
    finally:
        srv.stop()
    text = log.read_text()
    assert "'api_key': '<api-key>'" in text and key not in text, text


def test_the_key_file_is_the_job_users_only(tmp_path):
    old = os.umask(0)
    try:
        write_key_file(tmp_path / "sglang_server_rank0.key", "first")
        write_key_file(tmp_path / "sglang_server_rank0.key", "second")  # an earlier job's
    finally:
        os.umask(old)
    path = tmp_path / "sglang_server_rank0.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_key_file(path) == "second"
    assert read_key_file(tmp_path / "absent.key") is None
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_the_key_file_goes_into_an_output_dir_not_made_yet(tmp_path):
    """A fresh recipe's preflight starts the server before anything made train.output_dir
    (issue 57: `No such file or directory: 'runs/smol/.sglang_server_rank0.key.N'`)."""
    path = tmp_path / "runs" / "smol" / "sglang_server_rank0.key"
    write_key_file(path, "key")
    assert read_key_file(path) == "key" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_key_comes_from_the_named_variable_or_is_generated(monkeypatch):
    section = recipe_from_dict({}).target.sglang
    a, b = started_key(section, "sglang"), started_key(section, "sglang")
    assert a != b and len(a) >= 32  # per job
    assert section_key(section, "sglang") is None
    section.api_key_env = VAR
    monkeypatch.delenv(VAR, raising=False)
    with pytest.raises(ValueError, match=f"target.sglang.api_key_env={VAR}: .* not set"):
        started_key(section, "sglang")
    monkeypatch.setenv(VAR, "given")
    assert started_key(section, "sglang") == "given" == section_key(section, "sglang")
    with pytest.raises(ValueError, match="data.regenerate.api_key_env=NOPE: the environment"):
        from_env("NOPE", "data.regenerate.api_key_env")


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_an_attached_server_off_the_loopback_needs_a_key(backend):
    def load(**section):
        return recipe_from_dict({"target": {"backend": backend, backend: section}})

    with pytest.raises(RecipeError, match=rf"target.{backend}.api_key_env: the attached server "
                       r"http://10.0.0.5:30000 is not on this host's loopback"):  # fmt: skip
        load(url="http://10.0.0.5:30000")
    load(url="http://10.0.0.5:30000", api_key_env=VAR)
    for url in ("http://127.0.0.2:30000", "http://localhost:1", "http://[::1]:2"):
        load(url=url)  # a key is optional on the loopback
    load(host="0.0.0.0")  # a started server always listens with a key
    if backend == "sglang":
        with pytest.raises(RecipeError, match="http://cap1:30000 is not on"):
            load(urls=["http://127.0.0.1:30000", "http://cap1:30000"])


def test_keyed_launch_hands_the_key_to_the_module_and_not_to_its_children(tmp_path):
    """keyed_launch runs the module as `-m` would, --api-key appended, the variable gone."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os, sys\nprint(sys.argv[1:], os.environ.get('SFDSPARK_API_KEY'))\n")
    import subprocess

    env = {**os.environ, KEY_ENV: "s3cret", "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", KEYED_LAUNCH, "probe", "--port", "1"],
        env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert out.stdout.strip() == "['--port', '1', '--api-key', 's3cret'] None", out.stderr
