"""The sglang backend's failure handling, against a fake server on 127.0.0.1
(tests/fake_sglang.py: stalls, HTTP errors, a missing plugin, rows out of order, a failing
writer). The real server's features are checked in tests/test_sglang_live.py.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specforge_dspark.config.recipe import load_recipe
from specforge_dspark.engines.launch import launch_env
from specforge_dspark.engines.served import ServedEngine
from specforge_dspark.engines.server import EngineServer
from specforge_dspark.engines.sglang import launch_args, request_body
from specforge_dspark.engines.sglang_plugin import append_prefill_hidden_states
from specforge_dspark.training.stream import FeatureStream
from specforge_dspark.transport.features import TargetGone, TargetLost, TargetRefused
from specforge_dspark.transport.shm import SHM_DIR
from tests.fake_sglang import FakeServer, Mode, S, fake_features, sglang_recipe


@pytest.fixture()
def server():
    s = FakeServer()
    yield s
    s.close()


@pytest.mark.parametrize("behaviour", ["ok", "chunked", "late"])
def test_features_arrive_through_shared_memory(server, tiny_target_dir, behaviour):
    """chunked: each sequence arrives in two prefill chunks; late: the reply comes before
    the features are written (issue 34: at TP > 1 the writer of a request need not be
    the attention-TP rank 0 that replies), and the trainer waits on the ticket."""
    server.behaviour = behaviour
    batches = [[S(1, 5), S(2, 9)], [S(3, 4)], [S(4, 12), S(5, 2)]]
    with FeatureStream(sglang_recipe(tiny_target_dir, server.url)) as stream:
        got = [
            (f.sample_ids, f.aux_hidden.clone(), f.last_hidden.clone())
            for f in stream.iterate(batches)
        ]
    assert [g[0] for g in got] == [[1, 2], [3], [4, 5]]
    for (_, aux, last), batch in zip(got, batches, strict=True):
        for b, s in enumerate(batch):
            want_aux, want_last = fake_features(s.input_ids)
            n = len(s.input_ids)
            assert torch.equal(aux[b, :n], want_aux.float()), "fp32 copy of the bf16 rows"
            assert torch.equal(last[b, :n], want_last.float())
            assert aux[b, n:].abs().sum() == 0 and last[b, n:].abs().sum() == 0
    # request shape: token ids only, prefill, hidden states on (the prefetched requests
    # reach the server in any order)
    assert [list(range(3, 15)), [3, 4]] in [b["input_ids"] for b in server.bodies]
    for body in server.bodies:
        assert body["return_hidden_states"] and body["sampling_params"]["max_new_tokens"] == 1


def test_stalled_server_hits_the_request_timeout(server, tiny_target_dir):
    recipe = sglang_recipe(tiny_target_dir, server.url, timeout_s=1.0, max_restarts=0)
    with FeatureStream(recipe) as stream:
        server.behaviour = "stall"
        with pytest.raises(TimeoutError, match=rf"sglang server {server.url} did not answer"):
            list(stream.iterate([[S(1, 5)]]))


def test_attached_server_that_answers_again_gets_the_requests_again(server, tiny_target_dir):
    recipe = sglang_recipe(tiny_target_dir, server.url, timeout_s=1.0, restart_backoff_s=0.5)
    batches = [[S(1, 5)], [S(2, 7)], [S(3, 4)]]
    with FeatureStream(recipe) as stream:
        server.behaviour = "stall"  # released 1.2 s later: after the timeout, before the probe
        threading.Timer(1.2, server.recover).start()
        got = [(f.sample_ids, f.last_hidden.clone()) for f in stream.iterate(batches)]
        restarts = stream.restarts
    assert [ids for ids, _ in got] == [[1], [2], [3]]
    for (_, last), [s] in zip(got, batches, strict=True):
        assert torch.equal(last[0, : len(s.input_ids)], fake_features(s.input_ids)[1].float())
    assert len(restarts) == 1 and "did not answer batch 0" in restarts[0]["error"]


def test_attached_server_that_stays_down_stops_the_run_naming_it(server, tiny_target_dir, capsys):
    recipe = sglang_recipe(
        tiny_target_dir, server.url, timeout_s=1.0, restart_backoff_s=0.1, max_restarts=3
    )
    recipe.target.sglang.startup_timeout_s = 1.0
    with FeatureStream(recipe) as stream:
        server.behaviour = "down"
        with pytest.raises(TargetGone) as e:
            list(stream.iterate([[S(1, 5)]]))
    assert str(e.value).startswith(f"sglang server {server.url} did not answer batch 0")
    assert "target.sglang.startup_timeout_s=1s" in str(e.value)
    tries = re.findall(r"restart (\d+) of at most 3", capsys.readouterr().err)
    assert tries == ["1"], f"one wait of startup_timeout_s, not one per restart: {tries}"


@pytest.mark.parametrize(
    "behaviour, message",
    [
        ("http500", r"failed on batch \d+ .*HTTP 500"),
        (
            "noplugin",
            r"answered batch \d+ .* but wrote no features into slot .* within "
            r"target.timeout_s=2s: it wrote features before",
        ),
        ("gap", r"could not capture batch \d+ .*rows \[3, 5\) of 5 after only 2 were written"),
    ],
)
def test_server_failures_name_the_server_and_the_cause(server, tiny_target_dir, behaviour, message):
    recipe = sglang_recipe(tiny_target_dir, server.url, timeout_s=2, max_restarts=0)
    with FeatureStream(recipe) as stream:
        server.behaviour = behaviour
        with pytest.raises(RuntimeError, match=rf"sglang server {server.url} {message}"):
            list(stream.iterate([[S(1, 5)]]))


def test_a_writer_error_is_a_lost_server_named_from_its_ticket(server, tiny_target_dir):
    """The writer fails inside the server (here it cannot copy the rows): the ticket says
    so, and the trainer raises TargetLost naming the server, the slot and the reason, not
    the "wrote no features" of a deadline ten minutes away."""
    recipe = sglang_recipe(tiny_target_dir, server.url, timeout_s=600, max_restarts=0)
    with FeatureStream(recipe) as stream:
        server.behaviour = "broken"
        with pytest.raises(TargetLost) as e:
            list(stream.iterate([[S(1, 5)]]))
    assert re.match(
        rf"sglang server {server.url} could not write batch 0 \(sample ids \[1\]\), sequence 0 "
        rf"into slot {SHM_DIR}/\S+: writer failed: NotImplementedError: .*meta",
        str(e.value),
    )


def test_a_pool_fails_over_from_a_server_whose_writer_fails(tiny_target_dir):
    """Two attached servers, one whose writer fails: its requests go to the other, each
    in a fresh slot file, and every batch arrives once, in order, with its features."""
    good, bad = FakeServer(), FakeServer()
    try:
        urls = [bad.url, good.url]
        sglang = {"urls": urls, "startup_timeout_s": 5}
        recipe = sglang_recipe(tiny_target_dir, "", sglang=sglang, restart_backoff_s=0.1)
        recipe.target.timeout_s = 600
        batches = [[S(i, 3 + i)] for i in range(1, 6)]
        with FeatureStream(recipe) as stream:
            bad.behaviour = "broken"
            got = [(f.sample_ids, f.last_hidden.clone()) for f in stream.iterate(batches)]
            restarts = stream.restarts
        assert [ids for ids, _ in got] == [[s.sample_id] for [s] in batches]
        for (_, last), [s] in zip(got, batches, strict=True):
            assert torch.equal(last[0, : len(s.input_ids)], fake_features(s.input_ids)[1].float())
        assert len(restarts) == 1 and "writer failed: NotImplementedError" in restarts[0]["error"]
        assert len(bad.bodies) >= 2  # the probe, then the request it failed
    finally:
        good.close()
        bad.close()


class _Standin(ServedEngine):
    """A started server (tests/standin_server.py) launched with an argument it refuses."""

    engine, health_path = "sglang", "/health_generate"

    def launch(self, log_path):
        args = ["--port", str(self.recipe.target.sglang.port), "--bogus-flag"]
        return EngineServer(sys.executable, "tests.standin_server", args, log_path, launch_env())


def test_a_started_server_that_exits_before_its_first_answer_is_a_refusal(
    tiny_target_dir, tmp_path, monkeypatch
):
    """Bad arguments (or an out-of-memory while loading): the server never answers once,
    so the run is refused (TargetRefused, not the resumable TargetLost), with its log."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sglang = {"host": "127.0.0.1", "port": port, "startup_timeout_s": 60}
    recipe = sglang_recipe(tiny_target_dir, "", sglang=sglang)
    recipe.train.output_dir = str(tmp_path)
    engine = _Standin(recipe, 0, 2, restarts=True)
    try:
        with pytest.raises(TargetRefused) as e:
            engine.wait_ready()
    finally:
        engine.close()
    message = str(e.value)
    assert message.startswith(
        f"sglang server http://127.0.0.1:{port} never answered once, so a retry would fail "
        "the same way (check target.sglang.server_args, its memory, its install): sglang "
        f"server http://127.0.0.1:{port} (pid "
    )
    assert f"died (exit code 2) during start-up; last log lines ({tmp_path}/sglang_" in message
    assert "unrecognized arguments: --bogus-flag" in message


def test_unreachable_server_fails_at_start_up(tiny_target_dir):
    recipe = sglang_recipe(tiny_target_dir, "http://127.0.0.1:9", timeout_s=1.0)
    recipe.target.sglang.startup_timeout_s = 1.0
    with pytest.raises(TimeoutError, match=r"127\.0\.0\.1:9 not healthy within"):
        with FeatureStream(recipe):
            pass


def test_a_server_interpreter_without_sglang_or_our_plugin_is_named(tmp_path):
    """The server's environment is checked before it starts (target.sglang.python)."""
    from specforge_dspark.engines.launch import engine_python
    from specforge_dspark.engines.sglang import ServerProcess

    key = "target.sglang.python"
    with pytest.raises(ValueError, match=rf"{key}: no Python interpreter at nowhere/python"):
        ServerProcess("nowhere/python", [], tmp_path / "log")
    # the base interpreter under our venv: none of the venv's packages (sglang among them)
    bare = str(Path(sys.base_prefix) / "bin" / "python3")
    with pytest.raises(ValueError, match=rf"{key}: .* cannot import sglang \(run `make sglang"):
        ServerProcess(bare, [], tmp_path / "log")
    with pytest.raises(ValueError, match=r"our plugin is not registered in .* --no-deps -e \."):
        engine_python(bare, key, "json", "sglang.srt.plugins")  # importable, no plugin
    assert not (tmp_path / "log").exists(), "no server was started"


def test_plugin_passes_other_requests_to_sglang(tiny_target_dir):
    seen = {}

    def original(self, **kw):
        seen.update(kw)
        return kw["hidden_state_offset"] + kw["extend_input_len"]

    req = SimpleNamespace(rid="user-request-1")
    end = append_prefill_hidden_states(
        original,
        None,
        req=req,
        logits_output=None,
        hidden_state_offset=3,
        capture_hidden_mode=Mode.full,
        extend_input_len=4,
        store=True,
    )
    assert end == 7 and seen["req"] is req


def test_launch_args_for_the_production_recipe(repo):
    args = launch_args(load_recipe(repo / "recipes" / "inkling_nvfp4.yaml"))
    i = args.index("--return-aux-hidden-state-layer-ids")
    assert args[i + 1 : i + 6] == ["5", "17", "35", "47", "59"]
    assert args[args.index("--speculative-algorithm") + 1] == "DSPARK"
    for flag in ("--enable-return-aux-hidden-states", "--trust-remote-code"):
        assert flag in args
    # SGLang's Inkling asserts the radix cache on; our plugin keeps feature requests off it
    assert "--disable-radix-cache" not in args
    assert args[args.index("--tp-size") + 1] == "8"
    assert args[args.index("--mem-fraction-static") + 1] == "0.55"


def test_radix_cache_is_off_only_where_the_target_allows_it(tiny_qwen3_dir, tiny_target_dir):
    from tests.live_sglang import tiny_sglang_recipe

    qwen3 = launch_args(tiny_sglang_recipe(tiny_qwen3_dir))
    inkling = launch_args(tiny_sglang_recipe(tiny_target_dir))
    assert "--disable-radix-cache" in qwen3 and "--disable-radix-cache" not in inkling
    served = Path(inkling[inkling.index("--model-path") + 1])
    assert served.name == "tiny_target_sglang"  # SGLang's layout, converted once
    assert inkling[inkling.index("--attention-backend") + 1] == "triton"
    assert qwen3[qwen3.index("--attention-backend") + 1] == "torch_native"


def test_launch_args_refuse_reserved_keys_and_unsorted_layers(repo):
    recipe = load_recipe(repo / "recipes" / "inkling_nvfp4.yaml")
    recipe.target.sglang.server_args["port"] = 1234
    with pytest.raises(ValueError, match=r"target\.sglang\.server_args\.port is set by"):
        launch_args(recipe)
    recipe = load_recipe(repo / "recipes" / "inkling_nvfp4.yaml")
    recipe.draft.target_layer_ids = [17, 5]
    with pytest.raises(ValueError, match="strictly ascending"):
        launch_args(recipe)


def test_request_body_shape():
    body = request_body(["a", "b"], [[1, 2], [3]])
    assert body["rid"] == ["a", "b"] and body["input_ids"] == [[1, 2], [3]]
    assert body["return_hidden_states"] is True and body["stream"] is False


def test_cpu_engine_launch_args_take_server_args_overrides(tiny_target_dir):
    recipe = sglang_recipe(tiny_target_dir, None, device="cpu")
    recipe.target.sglang.server_args = {"max_total_tokens": 2048, "chunked_prefill_size": 64}
    args = launch_args(recipe)
    assert args.count("--max-total-tokens") == 1
    assert args[args.index("--max-total-tokens") + 1] == "2048"
    assert args[args.index("--chunked-prefill-size") + 1] == "64"
    assert args[args.index("--device") + 1] == "cpu" and "--sleep-on-idle" in args
    assert "--disable-overlap-schedule" in args and args[args.index("--dtype") + 1] == "float32"
    recipe.target.device = "cuda"  # a GPU server gets none of the CPU-engine defaults
    assert "--device" not in launch_args(recipe) and "--sleep-on-idle" not in launch_args(recipe)


def test_cpu_engine_ranks_get_their_own_cores():
    """SGLANG_CPU_OMP_THREADS_BIND for a CPU-engine server of tp x dp x pp ranks: the
    cores split into contiguous groups, each capped at OMP_NUM_THREADS where that is set
    (vLLM's CPU worker the same); fewer cores than ranks is refused naming why."""
    from specforge_dspark.engines.launch import cpu_thread_binding
    from specforge_dspark.engines.sglang import server_env, server_ranks
    from specforge_dspark.engines.vllm import server_env as vllm_env

    bind = "SGLANG_CPU_OMP_THREADS_BIND"
    assert cpu_thread_binding(2, bind, {}, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, bind, {}, [0, 1, 2, 3, 4]) == "0-2|3-4"
    assert cpu_thread_binding(1, bind, {}, [4, 5]) == "4-5"
    assert cpu_thread_binding(1, bind, {"OMP_NUM_THREADS": "1"}, [4, 5]) == "4"
    assert cpu_thread_binding(2, bind, {"OMP_NUM_THREADS": "2"}, [0, 1, 2, 3, 4, 5]) == "0-1|3-4"
    with pytest.raises(ValueError, match=f"2 CPU-engine ranks .* this host gives 1; set {bind}"):
        cpu_thread_binding(2, bind, {}, [0])
    assert server_ranks(["--tp-size", "2", "--dp-size", "2"]) == 4
    assert server_ranks(["--model-path", "x"]) == 1
    env = server_env(True, base={}, ranks=2)
    assert env[bind].count("|") == 1
    assert bind not in server_env(True, base={}, ranks=1)  # SGLang's own default: its node
    one = str(min(os.sched_getaffinity(0)))
    assert server_env(True, base={"OMP_NUM_THREADS": "1"}, ranks=1)[bind] == one
    assert vllm_env(True, base={"OMP_NUM_THREADS": "1"})["VLLM_CPU_OMP_THREADS_BIND"] == one
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env(True, base={})
    assert server_env(True, base={bind: "0|0"}, ranks=2)[bind] == "0|0"  # a user's own is kept
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in server_env(False, base={}, ranks=8)  # GPU
