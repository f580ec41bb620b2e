"""The closed loop against a live SGLang CPU server (DSPARK, the tiny Qwen3 target): a round
killed in the middle of serving resumes with every request recorded and trained on once;
records carry the engine's own acceptance figures; the mix follows the recipe's shares; the
candidate is judged by the engine (paired, lossless); and a regressing candidate, injected
from the test side, is not promoted while the serving drafter keeps serving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specforge_dspark.loop.mine import held_out

REPO = Path(__file__).resolve().parents[1]
REQUESTS, HOLDOUT, ROWS, REPLAY = 8, 0.34, 8, 0.25


def _cmd(loop_dir: Path, export: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "specforge_dspark.cli.loop", "--recipe",
        "recipes/tiny_cpu_sglang.yaml", *extra, "target.backend=hf", f"train.output_dir={out}",
        f"loop.dir={loop_dir}", f"loop.serve_from={export}", "loop.traffic=[mt_bench]",
        f"loop.requests_per_round={REQUESTS}", "loop.max_new_tokens=24",
        "loop.steps_per_round=10", f"loop.rows_per_round={ROWS}", f"loop.replay_share={REPLAY}",
        f"loop.holdout_share={HOLDOUT}", "loop.guard_workloads=[gsm8k]", "loop.guard_prompts=2",
        "train.preflight_samples=0", "tracking.enabled=false", "checkpoint.save_interval=10",
    ]  # fmt: skip


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.fixture(scope="module")
def loop_round(trained_export, tmp_path_factory):
    """Round 0, killed (SIGKILL) once two requests are journaled, then run again up to its
    training; its candidate's weights are then replaced by noise (from the test side) and
    the loop goes on: round 0's gate and swap, and round 1's serving and recording."""
    import torch
    from safetensors.torch import load_file, save_file

    base = tmp_path_factory.mktemp("loop")
    loop_dir = base / "loop"
    cmd = _cmd(loop_dir, trained_export, base / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    journal = loop_dir / "records.jsonl"
    while proc.poll() is None and _lines(journal) < 2:  # the fault lands on progress
        time.sleep(0.2)
    alive = proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    first_out = proc.communicate()[0].decode(errors="replace")
    assert alive, f"the round ended before the kill landed:\n{first_out[-3000:]}"
    before = _lines(journal)
    assert 2 <= before < REQUESTS, "the kill did not land in the middle of serving"
    resumed = _run([*cmd[:5], "--stop-after", "train", *cmd[5:]])
    weights = loop_dir / "rounds" / "0" / "train" / "export" / "sglang" / "model.safetensors"
    gen = torch.Generator().manual_seed(0)
    noisy = {k: torch.randn(v.shape, generator=gen) * v.float().std(correction=0).clamp_min(1e-3)
             for k, v in load_file(weights).items()}  # fmt: skip
    save_file(noisy, weights, metadata={"format": "pt"})
    on = _run([*cmd[:5], "--rounds", "2", "--stop-after", "record", *cmd[5:]])
    return loop_dir, before, resumed.stdout + resumed.stderr, on.stdout + on.stderr


def _round_0(loop_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (loop_dir / "records.jsonl").read_text().splitlines()]
    return [r for r in rows if int(r["id"].split(":")[1]) < REQUESTS]


@pytest.mark.slow
def test_a_killed_round_resumes_and_every_request_is_recorded_and_trained_once(loop_round):
    loop_dir, before, said, _ = loop_round
    assert f"{REQUESTS - before} requests recorded, {before} already journaled" in said, said
    rows = _round_0(loop_dir)
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(f"mt_bench:{i}" for i in range(REQUESTS))  # each once
    for r in rows:  # the engine's own figures, per request
        s = r["served"]
        assert s["verify_ct"] >= 1 and s["completion_tokens"] > s["verify_ct"] - 1
        assert sum(s["accepted_hist"]) == s["verify_ct"], s
        assert r["drafter"] == "v0" and r["engine"] == "sglang"
        assert r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"]

    rd = loop_dir / "rounds" / "0"
    mix = [json.loads(line) for line in (rd / "mix.jsonl").read_text().splitlines()]
    mined = [m for m in mix if not m["id"].startswith("replay:")]
    trainable = [r for r in rows if not held_out(r["id"], HOLDOUT)]
    want = min(len(trainable), round(ROWS * (1 - REPLAY)))
    assert len(mined) == want and len(mix) - len(mined) == ROWS - round(ROWS * (1 - REPLAY))
    assert not any(held_out(m["id"], HOLDOUT) for m in mined)
    accept = {r["id"]: (r["served"]["completion_tokens"] - 1) / r["served"]["verify_ct"]
              for r in trainable}  # fmt: skip
    lowest = sorted(trainable, key=lambda r: (accept[r["id"]], r["id"]))[:want]
    assert [m["id"] for m in mined] == [r["id"] for r in lowest]  # lowest served first
    state = json.loads((loop_dir / "state.json").read_text())
    assert state["round"] == 1 and sorted(state["used"]) == sorted(m["id"] for m in mined)
    trained = json.loads((rd / "train" / "export" / "sglang" / "config.json").read_text())
    assert trained["architectures"], "round 0 trained and exported its candidate"

    g = json.loads((rd / "gate.json").read_text())
    held = [r["id"] for r in rows if held_out(r["id"], HOLDOUT)]
    assert set(g["serving_figures"]) == {*held, "guard:gsm8k:0", "guard:gsm8k:1"}
    assert g["answers_differ"] == 0  # both drafters: the target's own greedy answers
    assert g["overall"]["units"] == len(held) + 2 and len(g["overall"]["ci"]) == 2
    p = g["positions"]  # per draft position, from the engine's histograms
    assert len(p["serving"]) == len(p["candidate"]) >= 1 and 0 < p["serving"][0] <= 1
    summary = json.loads((rd / "round.json").read_text())
    assert set(summary["seconds"]) == {"record", "mine", "train", "gate", "swap"}


@pytest.mark.slow
def test_a_regressing_candidate_is_not_promoted_and_the_serving_drafter_serves_on(loop_round):
    """Round 0's candidate, its weights replaced by noise after its training (the fixture,
    from the test side), is refused by the engine's gate, kept in the lineage unpromoted,
    and version 0 serves round 1's requests."""
    loop_dir, _, _, said = loop_round
    g = json.loads((loop_dir / "rounds" / "0" / "gate.json").read_text())
    assert not g["promote"] and g["overall"]["difference"] < 0, g["why"]
    assert g["answers_differ"] == 0  # a bad drafter is slower, never wrong
    lineage = json.loads((loop_dir / "lineage.json").read_text())
    assert [v["parent"] for v in lineage] == [None, 0] and lineage[1]["round"] == 0
    assert not lineage[1]["promoted"] and lineage[1]["gate"]["why"] == g["why"]
    assert json.loads((loop_dir / "rounds" / "0" / "round.json").read_text())["serving_after"] == 0
    assert "version 0 serves" in said, said[-2000:]
    records = [json.loads(line) for line in (loop_dir / "records.jsonl").read_text().splitlines()]
    round_1 = [r for r in records if int(r["id"].split(":")[1]) >= REQUESTS]
    assert len(round_1) == REQUESTS and {r["drafter"] for r in round_1} == {"v0"}


@pytest.mark.slow
def test_vllm_serves_the_loops_traffic_with_its_own_figures_and_sglangs_answers(
    loop_round, trained_export, tmp_path
):
    """loop.engine: vllm: vLLM serves the same export (its speculators layout) and records
    the first requests of the same traffic with vLLM's own per-request figures; every
    answer equals the one SGLang served for that request (both the target's greedy)."""
    from tests.live_vllm import VLLM_PYTHON

    sglang_dir = loop_round[0]
    cmd = _cmd(tmp_path / "loop", trained_export, tmp_path / "run", "--stop-after", "record")
    n = 4
    _run([*cmd, "loop.engine=vllm", f"loop.requests_per_round={n}",
          f"target.vllm.python={VLLM_PYTHON}"])  # fmt: skip
    rows = [
        json.loads(line) for line in (tmp_path / "loop" / "records.jsonl").read_text().splitlines()
    ]
    served = {r["id"]: r for r in _round_0(sglang_dir)}
    assert sorted(r["id"] for r in rows) == sorted(f"mt_bench:{i}" for i in range(n))
    for r in rows:
        s = r["served"]
        assert r["engine"] == "vllm" and r["drafter"] == "v0"
        assert s["verify_ct"] >= 1 and sum(s["accepted_hist"]) == s["verify_ct"], s
        assert r["messages"] == served[r["id"]]["messages"], r["id"]  # the same answer
