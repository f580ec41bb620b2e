"""SGLang at tensor-parallel size 2 on this CPU: the production topology's TP > 1 (issue 34).

Under TP only the process of attention-TP rank 0 replies (SGLang managers/scheduler.py),
while each request's features are written by rank `writer_rank(rid, 2)`
(engines/sglang_plugin.py): half the requests are written by a rank that never replies,
and the trainer waits on each ticket, not on the reply. SGLang's CPU engine all-reduces
over gloo here (no shared-memory kernel on this host), with the CPU bridge of
engines/cpu/sglang_tp.py and per-rank cores from SGLANG_CPU_OMP_THREADS_BIND.

One TP=2 server of the tiny Qwen3 target: its features equal the hf backend's with
requests of two and three sequences, both ranks writing; 20 training steps at micro-batch
2 attached to it give the hf backend's losses. Elsewhere at TP 2: SGLang's own Inkling
(the session's `inkling_server`, test_sglang_inkling.py: features and training steps) and
SGLang's DSPARK speculative decoding serving a trained export exactly as our harness
decodes it (test_serve_check.py).
"""

from __future__ import annotations

import pytest

from specforge_dspark.engines import sglang as sglang_engine
from specforge_dspark.engines.sglang_plugin import writer_rank
from tests.live_sglang import LiveServer, collect_features, tiny_sglang_recipe
from tests.test_sglang_live import _batches, _hf_recipe, _losses, _max_diff, _train

STEPS = 10  # ten optimizer updates, each loss equal to the hf backend's


@pytest.fixture(scope="module")
def tp2_server(tiny_qwen3_dir, tmp_path_factory):
    with LiveServer(tiny_qwen3_dir, tmp_path_factory.mktemp("tp2"), tp_size=2) as server:
        yield server


def test_tp2_features_equal_the_hf_backend_and_both_ranks_write(
    tp2_server, tiny_qwen3_dir, monkeypatch
):
    rids: list[str] = []
    make_rid = sglang_engine.make_rid

    def recording(*args):
        rids.append(make_rid(*args))
        return rids[-1]

    monkeypatch.setattr(sglang_engine, "make_rid", recording)  # the trainer side's names
    batches = _batches([[37, 5], [120, 64, 9], [200, 1], [48, 90], [16, 33, 7], [75, 11]])
    recipe = tiny_sglang_recipe(tiny_qwen3_dir, url=tp2_server.url)
    live = collect_features(recipe, batches)
    ref = collect_features(_hf_recipe(tiny_qwen3_dir), batches)
    diff = _max_diff(live, ref)
    writers = [writer_rank(r, 2) for r in rids]
    print(f"TP 2 vs hf features: max abs diff {diff:.3g}; writers {writers}")
    assert diff <= 1e-5
    assert len(rids) >= 14 and set(writers) == {0, 1}, "both TP ranks must have written"
    log = tp2_server.log_path.read_text()
    assert "TP1]" in log and "TP0]" in log, "the server did not run two TP ranks"


@pytest.mark.slow
def test_ten_steps_at_tp2_match_the_hf_backend(tp2_server, tmp_path):
    extra = (f"train.max_steps={STEPS}", "train.micro_batch_size=2", "target.prefetch=3")
    hf = _train(tmp_path / "hf", "hf", "--resume", "none", *extra)
    assert hf.returncode == 0, (tmp_path / "hf" / "job.log").read_text()[-3000:]
    url = f"target.sglang.url={tp2_server.url}"
    live = _train(tmp_path / "tp2", "sglang", "--resume", "none", url, *extra)
    assert live.returncode == 0, (tmp_path / "tp2" / "job.log").read_text()[-3000:]
    a, b = _losses(tmp_path / "hf"), _losses(tmp_path / "tp2")
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), f"step {step}"
