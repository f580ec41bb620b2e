"""SGLang's own Inkling (`InklingForConditionalGeneration`, SGLang 0.5.23) on this CPU as
the feature source for the tiny Inkling target: the target converted to SGLang's layout
(engines/inkling_layout.py), served with `--attention-backend triton` under Triton's
interpreter and the bridges of engines/cpu/sglang_inkling.py. The shared server runs at
tensor-parallel size 2 (conftest.py `inkling_server`: 4 heads over 2 KV heads, 4 experts
and 1088 LM-head rows sharded over two ranks, all-reduced over gloo). Its aux states
equal the hf backend's (transformers' Inkling, the pre-short-conv tap); a sequence sent
twice is prefilled twice although Inkling keeps the radix cache on; 12 training steps
against it give the hf backend's losses. SGLang's Inkling + DSPARK at TP 1 is the judge
of a DSpark drafter trained against the tiny Inkling."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from specforge_dspark.engines.api_key import auth_headers
from specforge_dspark.engines.inkling_layout import convert_state, interleave, sglang_layout
from tests.live_keys import API_KEY_ENV, attach_key
from tests.live_sglang import collect_features, free_port, tiny_sglang_recipe
from tests.test_sglang_live import _batches, _hf_recipe, _max_diff

REPO = Path(__file__).resolve().parents[1]
# each live step prefills under Triton's interpreter (~10 s at TP 2); six losses, each after
# an optimizer update, are equal to the hf backend's only if every feature is
STEPS = 6


def _live_recipe(target: Path, url: str):
    recipe = tiny_sglang_recipe(target, url=url)
    recipe.target.timeout_s = 300  # Triton's interpreter: ~10-20 prefill tokens/s
    return recipe


def test_interleaved_rows_are_what_the_original_layout_means():
    """transformers reads the original checkpoints' w13 with `Interleave` (its
    conversion_mapping.py, "inkling_mm_model"); ours must come back as [gate; up]."""
    from transformers.core_model_loading import Interleave

    gate, up = torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    w13 = interleave(gate, up, dim=1)
    assert torch.equal(w13[:, 0], gate[:, 0]) and torch.equal(w13[:, 1], up[:, 0])
    (back,) = Interleave(dim=1).convert({"w13": w13}, ["w13"], ["gate_up"]).values()
    assert torch.equal(back, torch.cat([gate, up], dim=1))


def test_the_sglang_layout_holds_every_weight_once(tiny_target_dir):
    from safetensors.torch import load_file

    out = sglang_layout(tiny_target_dir, log=lambda *a: None)
    assert out == tiny_target_dir.with_name(tiny_target_dir.name + "_sglang")
    assert (out / ".source_key").read_text() == (tiny_target_dir / ".build_key").read_text()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["InklingForConditionalGeneration"]
    text = cfg["text_config"]
    assert (text["vocab_size"], text["padded_vocab_size"], text["dense_mlp_idx"]) == (1024, 1088, 1)
    src, got = (
        load_file(tiny_target_dir / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert sum(t.numel() for t in src.values()) == sum(t.numel() for t in got.values())
    assert all(name.startswith("model.llm.") for name in got)
    assert torch.equal(got["model.llm.unembed.weight"], src["lm_head.weight"])
    gate_up = src["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2F, H], [gate; up]
    w13 = got["model.llm.layers.1.mlp.experts.w13_weight"]
    assert torch.equal(w13[:, 0::2], gate_up[:, :64]) and torch.equal(w13[:, 1::2], gate_up[:, 64:])
    with pytest.raises(ValueError, match="without their pair"):
        convert_state({"model.layers.0.mlp.gate_proj.weight": torch.zeros(2, 2)})


def test_live_inkling_at_tp2_features_equal_the_hf_backend(inkling_server, tiny_target_dir):
    batches = _batches([[37, 5], [61, 32], [20, 9, 14]])  # short: ~15 prefill tokens/s here
    live = collect_features(_live_recipe(tiny_target_dir, inkling_server.url), batches)
    log = inkling_server.log_path.read_text()
    assert "TP1]" in log, "the server did not run two TP ranks"
    # Pools sized by CPU_ENGINE_ARGS on every run, not by the host's free memory (which
    # another process can take between SGLang's two readings of it).
    assert re.findall(r"max_mamba_cache_size: (\d+)", log) == ["256", "256"], log[-3000:]
    assert "max_total_num_tokens=8192," in log
    ref = collect_features(_hf_recipe(tiny_target_dir), batches)
    diff = _max_diff(live, ref)
    peak = max(aux.abs().max().item() for _, aux, _ in ref)
    print(f"SGLang Inkling at TP 2 vs hf: max abs diff {diff:.3g} (values up to {peak:.3g})")
    assert diff <= 1e-5  # fp32; another attention kernel, MoE order and the TP all-reduce


def _generate(url: str, ids: list[int]) -> None:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    headers = {"Content-Type": "application/json", **auth_headers(os.environ[API_KEY_ENV])}
    req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def _cached(log: str, new_tokens: int) -> list[int]:
    pattern = r"#new-token: (\d+), #cached-token: (\d+)"
    return [int(c) for n, c in re.findall(pattern, log) if int(n) + int(c) == new_tokens]


def _logged_prefills(server, tokens: int, count: int) -> list[int]:
    """The cached-token counts of the prefills of `tokens` tokens in `server`'s log, once it
    holds `count` of them: the scheduler's line reaches the log (through the key redactor)
    after the reply may have."""
    deadline = time.monotonic() + 30
    while len(seen := _cached(server.log_path.read_text(), tokens)) < count:
        assert time.monotonic() < deadline, f"{len(seen)} of {count} prefills logged: {seen}"
        time.sleep(0.5)
    return seen


def test_a_repeated_sequence_is_prefilled_again(inkling_server, tiny_target_dir):
    """Inkling keeps the radix cache on: a plain request sent twice reuses its prefix (the
    control), while our feature requests (the plugin caps their prefix at 0) never do."""
    (batch,) = _batches([[56]], seed=11)
    recipe = _live_recipe(tiny_target_dir, inkling_server.url)
    before = len(_cached(inkling_server.log_path.read_text(), 56))
    first, second = collect_features(recipe, [batch]), collect_features(recipe, [batch])
    assert _max_diff(first, second) == 0.0
    prefills = _logged_prefills(inkling_server, 56, before + 2)
    assert prefills[-2:] == [0, 0], "a feature request reused a cached prefix"

    # 80 tokens: a 48-token control found no cached prefix (Inkling caches whole pages)
    control = torch.randint(10, 1000, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    _generate(inkling_server.url, control)
    _generate(inkling_server.url, control)
    reused = _logged_prefills(inkling_server, 80, 2)
    assert reused[0] == 0 and reused[-1] > 0, f"the radix cache is off? {reused}"


def _train(out: Path, backend: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
        "--master_port", str(free_port()), "train.py",
        "--recipe", "recipes/tiny_cpu_inkling_sglang.yaml", "--resume", "none",
        f"train.output_dir={out}", f"train.max_steps={STEPS}", "train.log_interval=1",
        "train.eval_interval=0", f"checkpoint.save_interval={STEPS}", "data.max_rows=48",
        "data.max_length=48", "objective.num_anchors=16", "objective.chunk_size=8",
        "tracking.enabled=false", "export.formats=[sglang]", "train.preflight_samples=0",
        f"target.backend={backend}", *extra, *attach_key(extra),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _losses(out: Path) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines) if "loss" in m}


@pytest.mark.slow
def test_steps_on_live_inkling_at_tp2_match_the_hf_backend(inkling_server, tmp_path):
    hf = _train(tmp_path / "hf", "hf")
    assert hf.returncode == 0, hf.stderr[-3000:]
    live = _train(tmp_path / "live", "sglang", f"target.sglang.url={inkling_server.url}")
    assert live.returncode == 0, live.stderr[-3000:]
    want, got = _losses(tmp_path / "hf"), _losses(tmp_path / "live")
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"step {step}"


@pytest.mark.slow
def test_sglang_inkling_serves_our_dspark_export_as_our_harness_decodes_it(
    calibrated_inkling_run, tiny_target_dir, tmp_path
):
    """SGLang's Inkling + DSPARK (the seed's engine) is the judge of a DSpark drafter
    trained against the tiny Inkling target: tokens, verify steps and accepted-draft
    histograms equal prompt by prompt, the confidence calibration loaded with it."""
    from evaluation.serve_check import explain, serve_check

    report = serve_check(
        tiny_target_dir, calibrated_inkling_run / "export" / "sglang", ["gsm8k"],
        num_prompts=2, max_new_tokens=16, out_dir=tmp_path, port=free_port(),
        log=lambda *a: None,
    )  # fmt: skip
    assert report["agree"] is True, [explain(r) for r in report["prompts"] if not r["agree"]]
    assert report["num_prompts"] == 2 and report["sts_path"]
    assert report["sglang_accept_length"] == pytest.approx(report["harness_accept_length"])
    accepted = sum(k * n for r in report["prompts"] for k, n in enumerate(r["sglang_hist"]))
    assert accepted >= 5, f"too few accepted drafts to judge: {report['prompts']}"
    print(
        f"SGLang Inkling DSPARK: 2/2 prompts agree, accept length "
        f"{report['sglang_accept_length']:.3f}, {accepted} accepted drafts, server ready in "
        f"{report['server_start_seconds']:.0f}s"
    )
