"""The sglang backend against a real SGLang server on this CPU (SGLang's CPU engine).

Features from the live server equal the hf backend's; a prefill that SGLang splits into
chunks still arrives whole, through /dev/shm and through Mooncake; 30 training steps give
the same losses on either backend, and the same losses and weights with the features
written over Mooncake TCP by a server on another loopback address; a pool of two servers
feeding two ranks loses one mid-run and the ranks still train the same samples in order;
a server killed mid-run with target.max_restarts=0 fails the job naming the server, on
seeing the death (before the request deadline target.timeout_s), and `--resume auto` then
finishes with the losses and weights of an uninterrupted run; with restarts, a server
SIGKILLed and later SIGSTOPped mid-run is brought back and the run trains the same
samples with the same losses, under a dist.timeout_s (450 s) no longer than the recipe
rule allows (config/validate.py): no rank's collective times out while the server
restarts.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specforge_dspark.engines.pool import PORT_STRIDE
from specforge_dspark.engines.server import port_taken
from specforge_dspark.transport.features import Sample
from tests import live_train
from tests.faults_helpers import wait_until
from tests.live_keys import API_KEY_ENV, key_kept_private, refused_without_key
from tests.live_sglang import (
    LiveServer,
    assert_failed_on_the_death,
    collect_features,
    free_port,
    kill_server_mid_run,
    tiny_sglang_recipe,
    windowed,
)

REPO = Path(__file__).resolve().parents[1]
STEPS = 30
RECIPE = live_train.RECIPE


def _batches(lengths: list[list[int]], seed: int = 0) -> list[list[Sample]]:
    g = torch.Generator().manual_seed(seed)
    out, sid = [], 0
    for group in lengths:
        batch = []
        for n in group:
            ids = torch.randint(10, 1000, (n,), generator=g)
            batch.append(Sample(sid, ids, torch.ones(n, dtype=torch.long)))
            sid += 1
        out.append(batch)
    return out


def _hf_recipe(target_dir: Path):
    recipe = tiny_sglang_recipe(target_dir)
    recipe.target.backend = "hf"
    return recipe


def _max_diff(got, want) -> float:
    worst = 0.0
    for (lengths, aux, last), (_, aux_ref, last_ref) in zip(got, want, strict=True):
        worst = max(worst, (aux - aux_ref).abs().max().item(), (last - last_ref).abs().max().item())
        for b, n in enumerate(lengths.tolist()):
            assert aux[b, n:].abs().sum() == 0 and last[b, n:].abs().sum() == 0, "padding rows"
    return worst


def test_live_server_features_equal_the_hf_backend(sglang_server, tiny_qwen3_dir):
    batches = _batches([[37, 5, 120], [64], [9, 200, 1]])
    live = collect_features(tiny_sglang_recipe(tiny_qwen3_dir, url=sglang_server.url), batches)
    ref = collect_features(_hf_recipe(tiny_qwen3_dir), batches)
    diff = _max_diff(live, ref)
    start = sglang_server.start_seconds
    print(f"live SGLang vs hf features: max abs diff {diff:.3g} (server start {start:.0f}s)")
    assert diff <= 1e-5  # fp32; values reach ~10, kernels see other batch shapes
    refused_without_key(f"{sglang_server.url}/generate", {"input_ids": [5, 6]})  # keyed


def test_regenerate_on_sglang_continues_an_opening_like_the_hf_backend(
    sglang_server, tiny_qwen3_dir
):
    """`regenerate --backend sglang --opening-tokens K`: the opening sampled by the live
    server, then its greedy continuation of prompt + opening (token ids in, token ids out)
    equals the hf backend's greedy continuation of the same ids, token for token."""
    import asyncio

    from data_pipelines.backends import HFBackend, SGLangBackend
    from specforge_dspark.config.servers import RegenerateRecipe

    rc = RegenerateRecipe("sglang", sglang_server.url, max_new_tokens=24, api_key_env=API_KEY_ENV)
    served = SGLangBackend(rc, 0, str(tiny_qwen3_dir))
    hf = HFBackend(str(tiny_qwen3_dir), rc)
    for question in ("Natalia sold clips to 48 of her friends.", "What is 2 + 3?"):
        prompt = hf.chat.prompt_ids([{"role": "user", "content": question}])

        async def ask(prompt=prompt):
            async with served:
                for _ in range(8):  # a sampled opening may end the turn: draw another
                    opening, _ = await served.generate(prompt, 4, 1.0, 1.0)
                    if len(opening) == 4 and not set(opening) & hf.chat.eos_ids:
                        break
                rest, _ = await served.generate(prompt + opening, 20, 0.0, 1.0)
                return opening, rest

        opening, rest = asyncio.run(ask())
        assert len(opening) == 4 and not set(opening) & hf.chat.eos_ids, opening
        hf.rc = RegenerateRecipe(max_new_tokens=20)
        head = torch.tensor([prompt + opening])
        want = hf.generate_ids(head, torch.ones_like(head))[0]
        for ids in (rest, want):  # each up to its end of turn (SGLang may leave it out)
            del ids[next((k for k, t in enumerate(ids) if t in hf.chat.eos_ids), len(ids)) :]
        print(f"opening {opening}: sglang {rest}, hf {want}")
        assert rest == want and rest


PLUGIN_LOADED = r"specforge_dspark plugin loaded in (\S+) \(torch (\S+), sglang (\S+)\)"


def test_the_server_runs_in_sglangs_own_venv_beside_the_trainers(sglang_server):
    """Two environments, as users deploy: the server in SGLang's (`.venv-sglang`: `pip
    install sglang==0.5.23` with the torch it pins, our plugin --no-deps), the trainer in
    ours. This module's features, 30-step and fault tests run against such servers."""
    found = re.search(PLUGIN_LOADED, sglang_server.log_path.read_text())
    assert found, "our plugin did not log where it loaded"
    prefix, server_torch, server_sglang = found.groups()
    assert Path(prefix).resolve() == (REPO / ".venv-sglang").resolve() != Path(sys.prefix)
    assert (server_torch.split("+")[0], server_sglang) == ("2.14.1", "0.5.23")
    assert torch.__version__.split("+")[0] == "2.13.0", "the trainer's own torch"


@pytest.fixture(scope="module")
def chunked_server(tiny_qwen3_dir, tmp_path_factory):
    """A server whose prefill budget is 32 tokens a batch: most sequences are split."""
    with LiveServer(
        tiny_qwen3_dir, tmp_path_factory.mktemp("chunked"), "127.0.0.3", chunked_prefill_size=32
    ) as s:
        yield s


def test_split_prefills_arrive_whole(chunked_server, tiny_qwen3_dir):
    batches = _batches([[70, 33], [150], [8, 95, 41], [260]], seed=1)
    recipe = tiny_sglang_recipe(tiny_qwen3_dir, url=chunked_server.url)
    live = collect_features(recipe, batches)  # prefetch 3: requests of several batches in flight
    ref = collect_features(_hf_recipe(tiny_qwen3_dir), batches)
    assert _max_diff(live, ref) <= 1e-5  # a chunk attends to its prefix through the KV cache
    # a rank's slice only (dist.sequence_parallel): positions [S/3, S/3 + 40) of each
    # sequence, cut from the chunks as they come (a slot sized for those rows alone)
    third = lambda S: (S // 3, 40)  # noqa: E731
    sliced = collect_features(recipe, batches, third)
    assert [a.shape[1] for _, a, _ in sliced] == [40] * len(batches)
    assert _max_diff(sliced, windowed(ref, third)) <= 1e-5
    log = chunked_server.log_path.read_text()
    chunks = [int(n) for n in re.findall(r"Prefill batch, #new-seq: \d+, #new-token: (\d+)", log)]
    sequences = sum(len(b) for b in batches) + 1  # + the start-up probe
    assert len(chunks) > sequences and max(chunks) <= 32, "the server did not split prefills"
    # the same chunks written through Mooncake (server on 127.0.0.3, trainer on 127.0.0.1)
    recipe.target.transport = "mooncake"
    over_mooncake = collect_features(recipe, batches)
    assert _max_diff(over_mooncake, ref) <= 1e-5
    assert "listening on 127.0.0.3" in chunked_server.log_path.read_text()
    # and as fp8 aux rows with a scale per (row, aux layer): each element within 1/16 of
    # its layer's largest in the row; the last hidden rows in bf16 (its rounding alone)
    recipe.target.transport_dtype = "fp8_e4m3"
    fp8 = collect_features(recipe, batches)
    for (_, aux, last), (_, want_aux, want_last) in zip(fp8, ref, strict=True):
        assert aux.dtype == last.dtype == torch.float32
        H = last.shape[-1]
        per_layer = [
            (aux[..., i : i + H], want_aux[..., i : i + H]) for i in range(0, aux.shape[-1], H)
        ]
        for (got, want), bound in [*((p, 1 / 16) for p in per_layer), ((last, want_last), 2**-8)]:
            amax = want.abs().amax(-1, keepdim=True).clamp_min(1e-30)
            assert 0 < float(((got - want).abs() / amax).max()) <= bound + 1e-5


# --------------------------------------------------------------------------- training


_train = functools.partial(live_train.train, steps=STEPS)
_end, _losses, _ids = live_train.end, live_train.losses, live_train.trained_ids


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return live_train.weights(out, STEPS)


@pytest.fixture(scope="module")
def runs(sglang_server, tmp_path_factory):
    base = tmp_path_factory.mktemp("live_train")
    hf = _train(base / "hf", "hf", "--resume", "none")
    assert hf.returncode == 0, (base / "hf" / "job.log").read_text()[-3000:]
    attached = _train(
        base / "sglang", "sglang", "--resume", "none", f"target.sglang.url={sglang_server.url}"
    )
    assert attached.returncode == 0, (base / "sglang" / "job.log").read_text()[-3000:]
    mooncake = _train(
        base / "mooncake", "sglang", "--resume", "none", f"target.sglang.url={sglang_server.url}",
        "target.transport=mooncake",
    )  # fmt: skip
    assert mooncake.returncode == 0, (base / "mooncake" / "job.log").read_text()[-3000:]
    return base


@pytest.mark.slow
def test_thirty_steps_on_the_live_server_match_the_hf_backend(runs):
    hf, live = _losses(runs / "hf"), _losses(runs / "sglang")
    assert sorted(hf) == sorted(live) == list(range(1, STEPS + 1))
    for step in hf:
        assert live[step] == pytest.approx(hf[step], rel=1e-5), f"step {step}"


@pytest.mark.slow
def test_features_over_mooncake_train_exactly_as_over_shared_memory(runs, sglang_server):
    """The server on a host of its own (a network namespace behind a veth pair, else the
    loopback address 127.0.0.2: tests/netns.py) writes every row through Mooncake's
    Transfer Engine (TCP) into the trainer's registered slots: no slot path reaches it,
    and the 30 steps' losses and weights equal the /dev/shm run's."""
    shm, mc = _losses(runs / "sglang"), _losses(runs / "mooncake")
    assert sorted(mc) == list(range(1, STEPS + 1)) and mc == shm
    a, b = _weights(runs / "sglang"), _weights(runs / "mooncake")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    job = (runs / "mooncake" / "job.log").read_text()
    trainers = re.findall(r"P2P handshake, listening on ([\d.]+):\d+", job)
    assert len(trainers) == 2 and sglang_server.host not in trainers, job[-3000:]  # per rank
    assert f"listening on {sglang_server.host}:" in sglang_server.log_path.read_text()


@pytest.mark.slow
def test_a_pool_loses_a_server_mid_run_and_trains_every_sample_once(
    runs, sglang_server, chunked_server
):
    """Two servers on their own addresses (the shared one's, and 127.0.0.3 splitting prefills)
    feed two trainer ranks over Mooncake; the second is SIGKILLed at step 8: its requests
    go to the first, and every rank trains the uninterrupted run's samples, in order."""
    out = runs / "pool"
    pool = f"target.sglang.urls=[{sglang_server.url},{chunked_server.url}]"
    job = _train(out, "sglang", "--resume", "none", "target.transport=mooncake", pool, wait=False)
    _reach(out, job, 8)
    served = chunked_server.log_path.read_text().count("POST /generate")
    os.killpg(chunked_server.pid, signal.SIGKILL)
    assert _end(job, out) == 0, (out / "job.log").read_text()[-3000:]
    text = (out / "job.log").read_text()
    assert served > 2, "the killed server had served nothing before it died"  # + its probes
    assert f"{chunked_server.url} is lost: dropped from target.sglang.urls" in text, text[-3000:]
    for rank in (0, 1):
        assert _ids(out, rank) == _ids(runs / "sglang", rank)
    want, got = _losses(runs / "sglang"), _losses(out)
    assert sorted(got) == sorted(want)
    for step in want:  # the split prefills' features agree to 1e-5, not bitwise
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"step {step}"


@pytest.mark.slow
def test_killed_server_fails_fast_and_the_run_resumes_exactly(runs, sglang_server):
    out, port = runs / "killed", free_port()
    job = _train(
        out, "sglang", "--resume", "none", f"target.sglang.port={port}", "target.max_restarts=0",
        wait=False,
    )  # fmt: skip
    killed_at = kill_server_mid_run(job, out, "sglang", 12, STEPS, RECIPE)
    _end(job, out)
    took = time.monotonic() - killed_at
    text = (out / "job.log").read_text()
    assert job.returncode != 0
    server = f"sglang server http://127.0.0.1:{port}"
    named = assert_failed_on_the_death(text, server, took, RECIPE)
    key_kept_private(out)
    print(f"killed server: job failed {took:.1f}s later: {named.strip()[:300]}")

    resumed = _train(out, "sglang", "--resume", "auto", f"target.sglang.url={sglang_server.url}")
    assert resumed.returncode == 0, (out / "job.log").read_text()[-3000:]
    assert "resumed from" in (out / "job.log").read_text()
    want, got = _losses(runs / "sglang"), _losses(out)
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"step {step}"
    a, b = _weights(runs / "sglang"), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _reach(out: Path, job: subprocess.Popen, step: int) -> None:
    def reached() -> bool:
        assert job.poll() is None, (out / "job.log").read_text()[-3000:]
        return (out / "metrics.jsonl").is_file() and max(_losses(out), default=0) >= step

    wait_until(out, reached, f"waiting for step {step}", job.overrides, RECIPE)


def _ports_for(servers: int) -> int:
    """A port p with p + PORT_STRIDE i free for each of the node's `servers`."""
    while True:
        port = free_port()
        if port + PORT_STRIDE * servers < 65536 and all(
            not port_taken("127.0.0.1", port + PORT_STRIDE * i) for i in range(1, servers)
        ):
            return port


@pytest.mark.slow
def test_the_nodes_servers_are_killed_and_hung_and_the_run_is_unchanged(runs):
    """The trainer starts two servers (target.sglang.servers_per_node=2). The second is
    SIGKILLed at step 5: its requests go to the first while its keeper starts it again.
    The first hangs at step 10 (SIGSTOP): found silent after target.timeout_s, it is
    killed for its keeper to restart, and the run goes on with the second once that
    answers (the wait a single server's run does). Every rank trains the uninterrupted
    run's samples, in order, with its losses."""
    out, port = runs / "restarted", _ports_for(2)
    urls = [f"http://127.0.0.1:{port + PORT_STRIDE * i}" for i in (0, 1)]
    pid_files = [out / "sglang_server_rank0.pid", out / "sglang_server1_rank0.pid"]
    # a small dist.timeout_s that still holds detection and 2 restarts x (180 s + the probe's
    # 20 s): 420.6 s (config/validate.py)
    job = _train(
        out, "sglang", "--resume", "none", f"target.sglang.port={port}",
        "target.sglang.servers_per_node=2", "target.timeout_s=20",
        "target.restart_backoff_s=0.2", "target.max_restarts=2",
        "target.sglang.startup_timeout_s=180", "dist.timeout_s=450", wait=False,
    )  # fmt: skip
    killed = stopped = 0
    try:
        _reach(out, job, 5)
        killed = int(pid_files[1].read_text())
        os.killpg(killed, signal.SIGKILL)  # the server and its scheduler, detokenizer
        _reach(out, job, 10)
        stopped = int(pid_files[0].read_text())
        os.killpg(stopped, signal.SIGSTOP)  # a hang: alive, silent
        t0 = time.monotonic()
        assert _end(job, out) == 0, (out / "job.log").read_text()[-3000:]
        took = time.monotonic() - t0
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        last = {int(f.read_text()) for f in pid_files if f.is_file()}
        for pid in ({stopped} | last) - {0}:  # nothing left behind (killpg(0): our own group)
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = (out / "job.log").read_text()
    for i in (0, 1):
        served = re.findall(PLUGIN_LOADED, pid_files[i].with_suffix(".log").read_text())
        assert {Path(p).name for p, *_ in served} == {".venv-sglang"}, "started in SGLang's venv"
        assert int(pid_files[i].read_text()) not in (killed, stopped), f"server {i} not replaced"
    for url, pid in ((urls[1], killed), (urls[0], stopped)):  # each keeper on rank 0
        assert (
            f"[rank 0] sglang server {url} (pid {pid}) died (exit code -9); restarting it (1 of "
            "target.max_restarts=2 in a row) in 0.2s, to answer within "
            "target.sglang.startup_timeout_s=180s"
        ) in text, text[-3000:]
    assert f"sglang server {urls[0]} (pid {stopped}) stopped answering" in text, text[-3000:]
    lost = re.findall(
        r"sglang server (\S+) is lost: dropped from target.sglang.servers_per_node", text
    )
    assert set(lost) == set(urls), text[-3000:]  # rank 1's lines: the urls alone
    restarts = re.findall(rf"sglang server {urls[1]} \(pid \d+\) restarted in ([\d.]+)s", text)
    assert len(restarts) == 1, text[-3000:]  # the run waited for it once the first hung
    print(
        f"the killed server came back in {restarts[0]} s; the run took {took:.0f}s after the hang"
    )
    want, got = _losses(runs / "sglang"), _losses(out)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"step {step}"
    for rank in (0, 1):
        ids = _ids(out, rank)
        assert ids == _ids(runs / "sglang", rank)
        flat = [i for batch in ids for i in batch]
        assert len(flat) == len(set(flat)) == STEPS  # each sample once
