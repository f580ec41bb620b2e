"""The serving loop's pure parts (specforge_dspark/loop/): records journaled exactly once,
the mined mix following the recipe's shares (lowest served acceptance first, held-out
requests never trained on, each record used once across rounds), the gate promoting only
a paired gain and refusing a regressing candidate, and the lineage of versions."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from specforge_dspark.config.recipe import RecipeError, load_recipe
from specforge_dspark.loop.gate import Lineage, gate
from specforge_dspark.loop.mine import held_out, mine
from specforge_dspark.loop.records import (
    Journal,
    position_score,
    record,
    served_accept_length,
    served_figures,
)

REPO = Path(__file__).resolve().parents[1]


def _row(i: int, completion: int, verify: int, workload: str = "gsm8k") -> dict:
    meta = {"completion_tokens": completion, "spec_verify_ct": verify,
            "spec_correct_drafts_histogram": [1, 2]}  # fmt: skip
    messages = [{"role": "user", "content": f"question {i}"}]
    return record(
        f"req-{i}", messages, f"answer {i}", served_figures(meta), "v0", "sglang", workload
    )


def test_a_request_is_journaled_once_and_a_torn_line_is_dropped(tmp_path):
    path = tmp_path / "records.jsonl"
    journal = Journal(path)
    assert journal.append(_row(1, 11, 5)) and journal.append(_row(2, 21, 5))
    assert not journal.append(_row(1, 99, 9))  # the same request again: not recorded twice
    with path.open("a") as f:
        f.write('{"id": "req-3", "messa')  # a kill mid-write
    again = Journal(path)
    assert [r["id"] for r in again.rows()] == ["req-1", "req-2"]
    assert again.append(_row(3, 9, 4))
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # every line whole
    assert [r["id"] for r in rows] == ["req-1", "req-2", "req-3"]
    first = rows[0]
    assert first["messages"][-1] == {"role": "assistant", "content": "answer 1"}
    assert served_accept_length(first) == pytest.approx((11 - 1) / 5)
    assert (first["drafter"], first["engine"], first["served"]["accepted_hist"]) == (
        "v0", "sglang", [1, 2],
    )  # fmt: skip
    with pytest.raises(ValueError, match="req-9: the prompt must end with a user turn"):
        record("req-9", [], "x", {}, "v0", "sglang")


def test_the_mix_follows_the_shares_lowest_acceptance_first_and_uses_each_record_once():
    rng = random.Random(0)
    traffic = [_row(i, 1 + rng.randint(10, 60), rng.randint(8, 20)) for i in range(300)]
    replay = [{"id": f"old-{i}", "messages": []} for i in range(100)]
    mix, report = mine(traffic, replay, rows=40, replay_share=0.25, holdout_share=0.2,
                       used=set(), seed=1)  # fmt: skip
    mined = [r for r in mix if r["id"].startswith("req-")]
    assert len(mined) == 30 and len(mix) == 40 and report["replayed"] == 10
    assert not any(held_out(r["id"], 0.2) for r in mined)  # the gate's requests stay out
    eligible = sorted(
        served_accept_length(r) for r in traffic if not held_out(r["id"], 0.2)
    )  # fmt: skip
    assert [served_accept_length(r) for r in mined] == eligible[:30]  # the lowest first
    held = sum(held_out(r["id"], 0.2) for r in traffic)
    assert 30 < held < 90  # about a fifth, chosen by id
    assert report["served_accept_length"]["mined"]["p90"] <= eligible[30]
    again, report2 = mine(traffic, replay, 40, 0.25, 0.2, used={r["id"] for r in mined}, seed=2)
    assert not {r["id"] for r in again} & {r["id"] for r in mined}  # each record used once
    assert report2["not_yet_trained"] == report["not_yet_trained"] - 30
    few, report3 = mine(traffic[:10], replay, 40, 0.25, 0.2, used=set(), seed=1)
    assert report3["short_by"] == 30 - report3["mined"] > 0


def _hist_row(i: int, hist: list[int]) -> dict:
    """Request r<i> as SGLang would record it: `hist` verify steps by drafts accepted."""
    committed = sum((j + 1) * n for j, n in enumerate(hist))
    meta = {"completion_tokens": 1 + committed, "spec_verify_ct": sum(hist),
            "spec_correct_drafts_histogram": hist}  # fmt: skip
    return record(f"r{i}", [{"role": "user", "content": "q"}], "a", served_figures(meta), "v0",
                  "sglang")  # fmt: skip


def test_the_report_gives_served_acceptance_per_draft_position_before_and_after_mining():
    traffic = [_hist_row(0, [0, 0, 4]), _hist_row(1, [3, 1, 0]), _hist_row(2, [0, 2, 2])]
    mix, report = mine(traffic, [], rows=1, replay_share=0, holdout_share=0, used=set(), seed=0)
    assert [r["id"] for r in mix] == ["r1"]  # 1 token per step: the worst served
    by = report["served_acceptance_by_position"]  # 12 steps: 3 accepted 0, 3 one, 6 two
    assert by["all_new_traffic"] == pytest.approx([9 / 12, 6 / 12])
    assert by["mined"] == pytest.approx([1 / 4, 0.0])


def test_position_weights_rank_by_the_positions_that_matter():
    """loop.position_weights: a request that often fails the first draft but accepts the
    whole block otherwise serves 2.5 tokens a step, one that always accepts exactly one
    draft 2.0; by accept length the second is mined first, by position 1 alone the first."""
    traffic = [_hist_row(0, [2, 0, 0, 2]), _hist_row(1, [0, 4, 0, 0])]
    assert [served_accept_length(r) for r in traffic] == [2.5, 2.0]
    assert position_score(traffic[0]["served"], [1, 1, 1]) == pytest.approx((2 + 2 + 2) / 12)
    assert position_score(traffic[1]["served"], [1, 0]) == 1.0
    kw = {"rows": 1, "replay_share": 0, "holdout_share": 0, "used": set(), "seed": 0}
    assert [r["id"] for r in mine(traffic, [], **kw)[0]] == ["r1"]
    mix, report = mine(traffic, [], **kw, position_weights=[1.0, 0.0, 0.0])
    assert [r["id"] for r in mix] == ["r0"] and report["rank"].startswith("position_weights")
    assert mine(traffic, [], **kw, position_weights=[0.2, 1.0, 1.0])[0][0]["id"] == "r1"


def _units(rates: dict[str, float], n: int = 30, seed: int = 0) -> tuple[dict, dict]:
    """request -> (committed, verify steps) at a per-workload rate, with per-request noise."""
    rng = random.Random(seed)
    units, workload_of = {}, {}
    for w, rate in rates.items():
        for i in range(n):
            steps = rng.randint(10, 30)
            units[(w, i)] = (steps * (rate + rng.uniform(-0.05, 0.05)), steps)
            workload_of[(w, i)] = w
    return units, workload_of


def test_the_gate_promotes_a_paired_gain_and_refuses_a_regression(tmp_path):
    serving, workload_of = _units({"gsm8k": 3.0, "mt_bench": 2.5})
    better, _ = _units({"gsm8k": 3.4, "mt_bench": 2.6}, seed=1)
    decision = gate(better, serving, workload_of, forget_margin=0.1)
    assert decision.promote and decision.overall["ci"][0] > 0, decision.why
    # injected from the test side: a candidate that gains on gsm8k and forgets mt_bench
    forgets, _ = _units({"gsm8k": 3.8, "mt_bench": 2.2}, seed=2)
    decision = gate(forgets, serving, workload_of, forget_margin=0.1)
    assert not decision.promote and "but mt_bench -0.29" in decision.why, decision.why
    same, _ = _units({"gsm8k": 3.0, "mt_bench": 2.5}, seed=3)
    decision = gate(same, serving, workload_of, forget_margin=0.1)
    assert not decision.promote and "does not lie above 0" in decision.why

    lineage = Lineage(tmp_path / "lineage.json")
    v0 = lineage.add("exports/v0", None, None)
    v1 = lineage.add("exports/v1", v0, gate(same, serving, workload_of, 0.1))
    assert lineage.serving()["version"] == v0  # the refused candidate does not serve
    v2 = lineage.add("exports/v2", v0, gate(better, serving, workload_of, 0.1))
    kept = Lineage(tmp_path / "lineage.json")
    assert kept.serving()["version"] == v2 and kept.versions[v1]["parent"] == v0
    assert kept.versions[v1]["gate"]["why"].startswith("paired gain")


def test_the_loop_section_is_checked_naming_the_key(tmp_path):
    recipe = load_recipe(REPO / "recipes" / "tiny_cpu.yaml")
    assert (recipe.loop.replay_share, recipe.loop.holdout_share) == (0.3, 0.2)
    with pytest.raises(RecipeError, match=r"loop.replay_share must be in \[0, 1\], got 1.5"):
        load_recipe(REPO / "recipes" / "tiny_cpu.yaml", ["loop.replay_share=1.5"])
    with pytest.raises(RecipeError, match="loop.no_such"):
        load_recipe(REPO / "recipes" / "tiny_cpu.yaml", ["loop.no_such=1"])
    with pytest.raises(RecipeError, match="loop.engine"):
        load_recipe(REPO / "recipes" / "tiny_cpu.yaml", ["loop.engine=trt"])
    with pytest.raises(RecipeError, match="loop.listen must be host:port .* got 'localhost'"):
        load_recipe(REPO / "recipes" / "tiny_cpu.yaml", ["loop.listen=localhost"])
    with pytest.raises(RecipeError, match=r"loop.position_weights must be >= 0, not all 0"):
        load_recipe(REPO / "recipes" / "tiny_cpu.yaml", ["loop.position_weights=[0,0]"])


def _fake_generate(reply) -> tuple:
    """(server, url): an HTTP server speaking SGLang's /generate on a free port, its JSON
    answer `reply(path, headers, body)`."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            data = json.dumps(reply(self.path, self.headers, body)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_served_requests_are_recorded_once_with_the_engines_own_figures(tiny_target_dir, tmp_path):
    """record_traffic against an HTTP endpoint speaking SGLang's /generate (canned
    answers): the request carries the chat-rendered ids and the API key, the record the
    decoded answer and the engine's meta_info figures; a resumed round sends nothing twice."""
    from transformers import AutoTokenizer

    from specforge_dspark.decoding.prompts import render
    from specforge_dspark.loop.serve import record_traffic

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    answer = tok.encode("Forty-two clips.", add_special_tokens=False)
    seen = []

    def reply(path: str, headers, body: dict) -> dict:
        seen.append((path, headers.get("Authorization"), body))
        return {"output_ids": answer, "meta_info": {"completion_tokens": len(answer),
                "spec_verify_ct": 2, "spec_correct_drafts_histogram": [0, 1, 1]}}  # fmt: skip

    server, url = _fake_generate(reply)
    requests = [(f"r{i}", [{"role": "user", "content": f"How many clips, {i}?"}], "gsm8k")
                for i in range(3)]  # fmt: skip
    journal = Journal(tmp_path / "records.jsonl")
    try:
        got = record_traffic(url, tok, {tok.eos_token_id}, requests, journal, "v0", 16, key="k")
        again = record_traffic(url, tok, set(), requests, Journal(journal.path), "v0", 16)
    finally:
        server.shutdown()
    assert got == {"recorded": 3, "already": 0} and again == {"recorded": 0, "already": 3}
    assert len(seen) == 3  # the resumed round sent nothing
    path, auth, body = seen[0]
    assert path == "/generate" and auth == "Bearer k"
    assert body["input_ids"] == render(tok, requests[0][1])
    assert body["sampling_params"]["temperature"] == 0.0
    rows = journal.rows()
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": "Forty-two clips."}
    assert served_accept_length(rows[0]) == (len(answer) - 1) / 2
    assert rows[2]["served"]["accepted_hist"] == [0, 1, 1] and rows[2]["workload"] == "gsm8k"


def _fake_engine(verify_of: dict[int, int], answer: list[int]):
    """Loop.start's stand-in: per drafter version an HTTP server speaking SGLang's
    /generate with the same answer for every prompt and that version's verify steps (a
    prompt's length mod 3 added, so requests differ); `stopped` lists the versions
    whose server was stopped."""
    from types import SimpleNamespace

    from specforge_dspark.loop.round import Served

    stopped: list[int] = []

    def start(loop, version: int, export=None) -> Served:
        def reply(path: str, headers, body: dict) -> dict:
            verify = verify_of[version] + len(body["input_ids"]) % 3
            meta = {"completion_tokens": len(answer), "spec_verify_ct": verify}
            return {"output_ids": answer, "meta_info": meta}

        server, url = _fake_generate(reply)

        def stop() -> None:
            stopped.append(version)
            server.shutdown()
            server.server_close()

        return Served(version, SimpleNamespace(stop=stop), url)

    return start, stopped


@pytest.mark.parametrize("promoted_verify", [20, 5])
def test_a_served_regression_after_a_swap_is_confirmed_by_the_engine_and_rolled_back(
    promoted_verify, tiny_qwen3_dir, tmp_path, monkeypatch
):
    """Version 1 (promoted over version 0 at round 0) serves round 1's traffic; the loop
    compares its served accept length with version 0's on the traffic 0 served. At 20
    verify steps for 21 tokens (about 1.0 against 4.0) the drop is put to the engine, which
    decodes version 1's held-out requests with both: version 0 is better, version 1 is
    rolled back and version 0 serves the front again. At 5 (as good as 0) nothing happens."""
    from transformers import AutoTokenizer

    from specforge_dspark.loop.round import Loop

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    answer = tok.encode("The answer is forty-two, as the clips add up.", add_special_tokens=False)
    answer = (answer * 3)[:21]
    start, stopped = _fake_engine({0: 5, 1: promoted_verify}, answer)
    monkeypatch.setattr(Loop, "start", start)
    loop_dir, base = tmp_path / "loop", tmp_path / "export"
    loop_dir.mkdir()
    base.mkdir()
    recipe = load_recipe(REPO / "recipes/tiny_cpu_sglang.yaml", [
        f"target.path={tiny_qwen3_dir}", f"loop.dir={loop_dir}", f"loop.serve_from={base}",
        "loop.traffic=[gsm8k]", "loop.requests_per_round=12", "loop.holdout_share=0.5",
    ])  # fmt: skip
    lineage = Lineage(loop_dir / "lineage.json")
    lineage.add(str(base), None, None, round=None)
    lineage.add(str(base), 0, None, round=0)  # promoted at round 0
    journal = Journal(loop_dir / "records.jsonl")
    for i in range(12):  # what version 0 served in round 0
        meta = {"completion_tokens": 21, "spec_verify_ct": 5 + i % 3}
        row = record(f"old:{i}", [{"role": "user", "content": f"q{i}"}], "a", served_figures(meta),
                     "v0", "sglang", "gsm8k")  # fmt: skip
        journal.append(row)
    (loop_dir / "state.json").write_text(json.dumps({"round": 1, "done": [], "used": []}))
    said: list[str] = []
    loop = Loop(recipe, log=said.append)
    try:
        loop._record(loop.round_dir())
        asked = [("x", [{"role": "user", "content": "How many clips?"}])]
        via_front = loop.decode(loop.front.url, asked)["x"]["verify_ct"]  # who answers now
    finally:
        loop.close()
    seen = json.loads((loop_dir / "rounds" / "1" / "watch.json").read_text())
    versions = json.loads((loop_dir / "lineage.json").read_text())
    round_1 = [r for r in Journal(loop_dir / "records.jsonl").rows() if r["drafter"] == "v1"]
    assert len(round_1) == 12  # the round's traffic, served by version 1
    assert seen["version"] == 1 and seen["parent"] == 0 and seen["served"]["units"] == [12, 12]
    if promoted_verify == 20:
        assert seen["served"]["ci"][1] < -recipe.loop.forget_margin, seen
        assert seen["roll_back"] and seen["confirmed"]["better"] == "a", seen
        held = sum(held_out(r["id"], 0.5) for r in round_1)
        assert seen["confirmed"]["units"] == (held or len(round_1))
        assert not versions[1]["promoted"] and "served regression" in versions[1]["rolled_back"]
        assert loop.lineage.serving()["version"] == 0 and stopped[0] == 1  # 1 left service
        assert via_front < 10  # version 0's figures: it serves the front's requests
        assert any("version 1 rolled back; version 0 serves again" in s for s in said), said
    else:
        assert not seen["roll_back"] and seen["confirmed"] is None, seen
        assert versions[1]["promoted"] and "rolled_back" not in versions[1]
        assert stopped == [1]  # only at close: no second server was started


def test_a_vllm_loop_serves_the_speculators_layout_and_trains_it_too(
    tiny_qwen3_dir, tmp_path, monkeypatch
):
    """loop.engine: vllm: a version's server gets the speculators export beside the sglang
    one the lineage names, with vLLM's interpreter; a round's training exports both."""
    from types import SimpleNamespace

    from specforge_dspark.loop import serve
    from specforge_dspark.loop.round import Loop

    started = []

    def start(target, export, port, log, device, dtype, python):
        started.append((Path(export), python))
        return SimpleNamespace(stop=lambda: None), f"http://127.0.0.1:{port}"

    vllm = serve.ENGINES["vllm"]
    fake = serve.Engine(start, vllm.ask, vllm.layout, vllm.python)
    monkeypatch.setitem(serve.ENGINES, "vllm", fake)
    base = tmp_path / "run" / "export" / "sglang"
    base.mkdir(parents=True)
    recipe = load_recipe(REPO / "recipes/tiny_cpu_sglang.yaml", [
        f"target.path={tiny_qwen3_dir}", f"loop.dir={tmp_path / 'loop'}", f"loop.serve_from={base}",
        "loop.engine=vllm", "target.vllm.python=/opt/vllm/bin/python",
    ])  # fmt: skip
    loop = Loop(recipe, log=lambda s: None)
    served = loop.start(0)
    assert started == [(base.parent / "speculators", "/opt/vllm/bin/python")]
    assert served.version == 0 and served.url.startswith("http://127.0.0.1:")
    cmd = loop.train_command(loop.round_dir())
    assert "export.formats=[sglang,speculators]" in cmd and f"draft.init_from={base}" in cmd
    loop.front.close()
