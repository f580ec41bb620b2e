"""Regeneration pieces: input prompts, the exactly-once journal, the hf backend."""

from __future__ import annotations

import json
import threading

import pytest

from data_pipelines.backends import RequestError, chat_url, parse_openai_response
from data_pipelines.formats import FormatConfig, RowError
from data_pipelines.journal import Journal
from data_pipelines.regen_jobs import prompts_of
from data_pipelines.regenerate import main


def test_prompts_of_keeps_system_and_user_turns_in_order():
    cfg = FormatConfig(system_prompt="recipe sys")
    row = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": ""},
                             {"from": "human", "value": "b"}]}  # fmt: skip
    assert prompts_of(row, cfg) == [
        {"role": "system", "content": "recipe sys"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    assert prompts_of({"question": "q"}, FormatConfig()) == [{"role": "user", "content": "q"}]
    assert prompts_of({"turns": ["x", "y"]}, FormatConfig())[1] == {"role": "user", "content": "y"}
    row = {"system": "own", "messages": [{"role": "user", "content": "q"}]}
    assert prompts_of(row, cfg)[0] == {"role": "system", "content": "own"}
    for bad, reason in [
        ([1], "row_not_object"),
        ({"messages": [{"role": "assistant", "content": "a"}]}, "no_user_turn"),
        ({"messages": [{"role": "user", "content": 3}]}, "bad_content_type"),
        ({"answer": "only"}, "missing_field"),
    ]:
        with pytest.raises(RowError) as e:
            prompts_of(bad, FormatConfig())
        assert e.value.reason == reason


def test_journal_repairs_torn_tail_and_locks(tmp_path):
    out, err = tmp_path / "o.jsonl", tmp_path / "o.errors.jsonl"
    out.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "mess')
    err.write_text('{"id": "x", "reason": "http_400"}\n')
    j = Journal(out, err)
    assert j.done == {"a", "b"} and j.is_done("x") and not j.is_done("c")
    with pytest.raises(RuntimeError, match="another process"):
        Journal(out, err)
    j.write({"id": "c", "messages": []})
    with pytest.raises(AssertionError):
        j.write({"id": "c", "messages": []})
    j.close()
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b", "c"]
    j = Journal(out, err, retry_errors=True)  # errors are moved aside and retried
    assert not j.is_done("x") and err.read_text() == ""
    assert len(list(tmp_path.glob("o.errors.jsonl.*"))) == 1
    j.close()


def test_openai_response_parsing():
    assert chat_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    msg = {"content": "hi", "reasoning": "because"}
    ans = parse_openai_response({"choices": [{"message": msg, "finish_reason": "length"}]})
    assert (ans.content, ans.reasoning_content, ans.finish_reason) == ("hi", "because", "length")
    with pytest.raises(RequestError) as e:
        parse_openai_response({"error": "x"})
    assert e.value.reason == "bad_response"


def test_hf_backend_batched_multiturn_and_resume(tmp_path, tiny_target_dir, capsys, monkeypatch):
    from data_pipelines.backends import HFBackend

    calls: list[list[list[dict]]] = []
    real = HFBackend.answer_batch

    def spy(self, conversations, openings=None):
        calls.append([list(c) for c in conversations])
        return real(self, conversations, openings)

    monkeypatch.setattr(HFBackend, "answer_batch", spy)
    src = tmp_path / "in.jsonl"
    rows = [
        {"id": "two", "messages": [{"role": "user", "content": "Who are you?"},
                                   {"role": "user", "content": "Have a nice day!"}]},
        {"id": "one", "question": "Natalia sold clips to 48 of her friends."},
        {"id": "sg", "conversations": [{"from": "human", "value": "What is up?"}]},
    ]  # fmt: skip
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target:\n  path: {tiny_target_dir}\n")
    out = tmp_path / "regen.jsonl"
    argv = ["--recipe", str(recipe), "--input", str(src), "--out", str(out), "--backend", "hf"]
    argv += ["--batch-size", "2", "--max-new-tokens", "4", "--quiet"]
    argv += ["--chat-template-kwargs", '{"enable_thinking": false}']
    assert main(argv) == 0
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(got) == {"two", "one", "sg"}
    two = got["two"]["messages"]
    assert [m["role"] for m in two] == ["user", "assistant", "user", "assistant"]
    assert all(m["content"].strip() for m in two)
    assert set(got["two"]["finish_reasons"]) <= {"stop", "length"}
    # batches of 2 conversations, turn by turn; turn 2 is conditioned on the own answer
    assert [len(c) for c in calls] == [2, 1, 1]
    assert calls[1][0] == [two[0], {"role": "assistant", "content": two[1]["content"]}, two[2]]
    assert main(argv) == 0  # resume: nothing left to do
    assert len(out.read_text().splitlines()) == 3
    assert "0 rows written this run (3 in all)" in capsys.readouterr().out


def test_unreachable_server_stops_the_run_and_resume_retries(tmp_path):
    from tests.test_regenerate_resume import FakeServer, answer_for

    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"r{i}", "question": f"q{i}"}) + "\n" for i in range(40))
    )
    srv = FakeServer(quota=10**6)
    srv.gate.set()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data:\n  regenerate:\n    backend: openai\n    url: {srv.url}\n")
    out = tmp_path / "o.jsonl"
    argv = ["--recipe", str(recipe), "--input", str(src), "--out", str(out), "--quiet"]
    argv += ["--retries", "0", "--concurrency", "2"]
    srv.server_close()  # nothing listens on the port now
    assert main(argv) == 1  # stops after 16 rows in a row failed, not after all 40
    errors = [json.loads(line) for line in (tmp_path / "o.errors.jsonl").read_text().splitlines()]
    assert 16 <= len(errors) < 40 and all(e["transient"] for e in errors)
    assert {e["reason"] for e in errors} == {"connection_error"}

    srv = FakeServer(quota=10**6)  # the server is back (on a new port)
    srv.gate.set()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert main([*argv, "--url", srv.url]) == 0
    finally:
        srv.shutdown()
        srv.server_close()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(f"r{i}" for i in range(40))
    want = "A-" + answer_for([{"role": "user", "content": "q7"}])
    assert next(r for r in rows if r["id"] == "r7")["messages"][1]["content"] == want


def test_hf_samples_open_with_sampled_tokens_then_decode_greedily(
    tmp_path, tiny_target_dir, capsys
):
    """--answers-per-prompt 3 --opening-tokens 3: per prompt the greedy answer (equal to a plain
    run's) and two more whose ids are the sampled opening then the greedy continuation of it."""
    import torch

    from data_pipelines.backends import HFBackend
    from specforge_dspark.config.servers import RegenerateRecipe

    src = tmp_path / "in.jsonl"
    rows = [{"id": "a", "question": "Who are you?"}, {"id": "b", "question": "What is 2+3?"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target:\n  path: {tiny_target_dir}\n")
    base = ["--recipe", str(recipe), "--input", str(src), "--backend", "hf", "--quiet"]
    base += ["--batch-size", "6", "--max-new-tokens", "12"]
    plain, many = tmp_path / "plain.jsonl", tmp_path / "many.jsonl"
    assert main([*base, "--out", str(plain)]) == 0
    argv = [*base, "--out", str(many), "--answers-per-prompt", "3", "--opening-tokens", "3"]
    assert main(argv) == 0
    got = {r["id"]: r["messages"][-1]["content"] for r in map(json.loads, many.open())}
    assert sorted(got) == ["a", "a#1", "a#2", "b", "b#1", "b#2"]
    for r in map(json.loads, plain.open()):
        assert got[r["id"]] == r["messages"][-1]["content"]
    assert main(argv) == 0  # resume: every sample is journaled under its own id
    assert "0 rows written this run (6 in all)" in capsys.readouterr().out

    rc = RegenerateRecipe(max_new_tokens=12, opening_tokens=3)
    hf = HFBackend(str(tiny_target_dir), rc)
    text = hf.tok.apply_chat_template([{"role": "user", "content": "Who are you?"}],
                                      tokenize=False, add_generation_prompt=True)  # fmt: skip
    ids = hf.tok([text], add_special_tokens=False, return_tensors="pt")["input_ids"]
    greedy = hf.generate_ids(ids, torch.ones_like(ids))[0]
    openings = []
    for seed in range(4):
        torch.manual_seed(seed)
        new = hf.generate_ids(ids, torch.ones_like(ids), opening=3)[0]
        assert 3 < len(new) <= 12
        hf.rc = RegenerateRecipe(max_new_tokens=9)  # the configured decoding, from the opening
        head = torch.cat([ids, torch.tensor([new[:3]])], 1)
        assert hf.generate_ids(head, torch.ones_like(head))[0] == new[3:]
        hf.rc = rc
        openings.append(new[:3])
    assert any(o != greedy[:3] for o in openings)  # the opening is sampled, not greedy


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--answers-per-prompt", "2"], "repeats the first answer"),
        (
            ["--answers-per-prompt", "2", "--opening-tokens", "4", "--max-new-tokens", "4"],
            "below --max-new",
        ),
        (["--answers-per-prompt", "2", "--opening-tokens", "2", "--backend", "openai", "--url", "http://h"],
         "needs the hf or sglang backend"),
    ],
)  # fmt: skip
def test_regenerate_refuses_samples_it_cannot_make(tmp_path, capsys, flags, message):
    src = tmp_path / "in.jsonl"
    src.write_text('{"question": "q"}\n')
    recipe = tmp_path / "r.yaml"
    recipe.write_text("target:\n  path: /nowhere\n")
    argv = ["--recipe", str(recipe), "--input", str(src), "--out", str(tmp_path / "o.jsonl")]
    assert main([*argv, *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
