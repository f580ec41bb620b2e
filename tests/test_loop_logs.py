"""The loop's request-log reader (loop/logs.py): response bodies serialized by the engines'
own response classes, each in its own venv, are journaled with the engine's figures, once,
and a malformed line is refused by file and line with nothing lost."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from specforge_dspark.config.recipe import load_recipe
from specforge_dspark.loop.logs import ingest_logs
from specforge_dspark.loop.records import Journal, served_accept_length

REPO = Path(__file__).resolve().parents[1]

# Each prints one response body as its server sends it (model_dump of the response class).
VLLM_BODY = """
import json
from vllm.entrypoints.generate.base.protocol import PerRequestMetrics, SpeculativeDecodingMetrics
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage)
from vllm.entrypoints.serve.engine.protocol import UsageInfo
spec = SpeculativeDecodingMetrics(mean_acceptance_length=2.5, draft_acceptance_rate=0.5,
    acceptance_histogram=[1, 0, 2, 1], num_spec_steps=4, num_accepted_draft_tokens=7,
    num_draft_tokens=12, num_spec_tokens=3)
r = ChatCompletionResponse(model="t", usage=UsageInfo(prompt_tokens=5, completion_tokens=11,
    total_tokens=16), choices=[ChatCompletionResponseChoice(index=0,
    message=ChatMessage(role="assistant", content="vllm's answer"))],
    metrics=PerRequestMetrics(speculative_decoding=spec))
print(json.dumps(r.model_dump()))
"""
SGLANG_BODY = """
import json
from sglang.srt.entrypoints.openai.protocol import (ChatCompletionResponse,
    ChatCompletionResponseChoice, ChatMessage, SglExt, SpecTokensDetails, UsageInfo)
d = SpecTokensDetails(spec_verify_ct=3, spec_correct_drafts_histogram=[0, 1, 2])
r = ChatCompletionResponse(id="x", model="t", usage=UsageInfo(prompt_tokens=5,
    completion_tokens=9, total_tokens=14), choices=[ChatCompletionResponseChoice(index=0,
    message=ChatMessage(role="assistant", content="sglang's answer"), finish_reason="stop")],
    sglext=SglExt(spec_tokens_details=d))
print(json.dumps(r.model_dump()))
"""


def _body(python: str, script: str) -> dict:
    out = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _line(request_id: str, body: dict, **extra) -> str:
    request = {"model": "t", "messages": [{"role": "user", "content": f"q {request_id}"}]}
    return json.dumps({"id": request_id, "request": request, "response": body, **extra}) + "\n"


@pytest.mark.slow
def test_both_engines_logged_responses_are_journaled_once_with_their_own_figures(tmp_path):
    from tests.live_vllm import VLLM_PYTHON
    from tests.netns import SGLANG_PYTHON

    vllm = _body(str(VLLM_PYTHON), VLLM_BODY)
    sglang = _body(str(SGLANG_PYTHON), SGLANG_BODY)
    log, journal = tmp_path / "gateway.jsonl", Journal(tmp_path / "records.jsonl")
    log.write_text(_line("a", vllm) + _line("b", sglang, drafter="v1") + _line("c", vllm)[:40])

    assert ingest_logs([str(log)], journal, "v2") == {"recorded": 2, "already": 0}
    rows = {r["id"]: r for r in journal.rows()}
    a, b = rows["a"], rows["b"]
    assert (a["engine"], a["drafter"], b["engine"], b["drafter"]) == ("vllm", "v2", "sglang", "v1")
    assert a["served"] == {"completion_tokens": 11, "verify_ct": 4, "accepted_hist": [1, 0, 2, 1]}
    assert b["served"] == {"completion_tokens": 9, "verify_ct": 3, "accepted_hist": [0, 1, 2]}
    assert a["messages"][-1] == {"role": "assistant", "content": "vllm's answer"}
    assert b["messages"][0] == {"role": "user", "content": "q b"}
    assert served_accept_length(a) == pytest.approx(10 / 4)

    # the half-written line is read once the gateway finishes it; nothing is journaled twice
    log.write_text(_line("a", vllm) + _line("b", sglang) + _line("c", vllm))
    assert ingest_logs([str(log)], journal, "v2") == {"recorded": 1, "already": 2}
    assert [r["id"] for r in journal.rows()] == ["a", "b", "c"]


def test_a_malformed_line_is_refused_by_file_and_line_and_the_lines_before_it_are_kept(
    tmp_path,
):
    body = {"choices": [{"message": {"content": "x"}}], "usage": {"completion_tokens": 3},
            "metrics": {"speculative_decoding": {"num_spec_steps": 1,
                                                 "acceptance_histogram": [0, 1]}}}  # fmt: skip
    no_figures = {"choices": [{"message": {"content": "x"}}], "usage": {"completion_tokens": 3}}
    log, journal = tmp_path / "gateway.jsonl", Journal(tmp_path / "records.jsonl")
    log.write_text(_line("a", body) + _line("b", no_figures) + _line("c", body))
    with pytest.raises(ValueError, match=r"gateway\.jsonl:2: .*per-request-spec-decode-metrics"):
        ingest_logs([str(log)], journal, "v0")
    assert [r["id"] for r in journal.rows()] == ["a"]

    bad_turn = json.dumps({"id": "d", "request": {"messages": [{"role": "assistant",
                           "content": "x"}]}, "response": body}) + "\n"  # fmt: skip
    log.write_text(_line("a", body) + bad_turn)
    with pytest.raises(ValueError, match=r"gateway\.jsonl:2: .*must end with a user turn"):
        ingest_logs([str(log)], journal, "v0")
    with pytest.raises(ValueError, match=r"loop\.request_logs: cannot read .*missing\.jsonl"):
        ingest_logs([str(tmp_path / "missing.jsonl")], journal, "v0")


def test_a_round_journals_the_request_logs_without_starting_a_server(
    tiny_qwen3_dir, tmp_path, monkeypatch
):
    """loop.request_logs and no loop.traffic: the record phase journals the gateway's log as
    served by the serving version and starts no server of its own."""
    from specforge_dspark.loop.round import Loop

    def start(*args, **kwargs):
        raise AssertionError("the record phase started a server")

    monkeypatch.setattr(Loop, "start", start)
    details = {"spec_verify_ct": 2, "spec_correct_drafts_histogram": [0, 2]}
    body = {"choices": [{"message": {"content": "x"}}], "usage": {"completion_tokens": 5},
            "sglext": {"spec_tokens_details": details}}  # fmt: skip
    log, base = tmp_path / "gateway.jsonl", tmp_path / "export"
    log.write_text(_line("u1", body) + _line("u2", body))
    base.mkdir()
    recipe = load_recipe(REPO / "recipes/tiny_cpu_sglang.yaml", [
        f"target.path={tiny_qwen3_dir}", f"loop.dir={tmp_path / 'loop'}", f"loop.serve_from={base}",
        "loop.traffic=[]", f"loop.request_logs=[{log}]",
    ])  # fmt: skip
    said: list[str] = []
    loop = Loop(recipe, log=said.append)
    try:
        loop._record(loop.round_dir())
    finally:
        loop.close()
    rows = Journal(tmp_path / "loop" / "records.jsonl").rows()
    assert [(r["id"], r["drafter"], r["engine"]) for r in rows] == [
        ("u1", "v0", "sglang"), ("u2", "v0", "sglang")]  # fmt: skip
    assert any("2 logged requests journaled" in s for s in said), said
