"""SGLang's own DFLASH judges our DFlash and DFlash2 exports: a DFlash drafter (block 16,
sliding-window layers, recipes/tiny_cpu_dflash.yaml), and the same with DFlash2's
candidate selector (`draft.kind=dflash2`), trained here against the tiny Inkling target
are served by SGLang's `--speculative-algorithm DFLASH` on its CPU engine with SGLang's
own Inkling, and agree with our harness's decode on every prompt: tokens, verify counts,
accepted-draft histograms and accept lengths. The tiny Inkling's muP multiplier is 4, so
the DFlash2 judge also checks the exported `output_multiplier` (drafters/dflash2.py).

The drafter is trained briefly on the target's own greedy answers to the very prompts it
is then served (2 GSM8K test prompts): a judge test needs many accepted drafts, short
and long runs of them, which a DFlash drafter on this tiny teacher does not reach on
held-out text in a few minutes (tests/test_train_dflash.py measures that side). SGLang's
Inkling under Triton's interpreter verifies a 16-token block in seconds, so the served
text is short.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from specforge_dspark.engines.cpu.sglang_dflash import extend_forward_kwargs, radix_topk
from tests.live_sglang import free_port

REPO = Path(__file__).resolve().parents[1]
PROMPTS = 2
NEW_TOKENS = 24
STEPS = 150


def _run(cmd: list[str], timeout: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def served_answers(tiny_target_dir, tmp_path_factory) -> Path:
    """The tiny target's greedy answers to the first PROMPTS GSM8K test prompts (both
    kinds train on them)."""
    data = tmp_path_factory.mktemp("served_answers") / "regenerated.jsonl"
    _run([
        sys.executable, "-m", "data_pipelines.regenerate", "--recipe",
        "recipes/tiny_cpu_dflash.yaml", "--input", "../shared/data/eval/gsm8k_test.jsonl",
        "--out", str(data), "--backend", "hf", "--batch-size", str(PROMPTS),
        "--max-new-tokens", "48", "--max-rows", str(PROMPTS), "--quiet",
    ], timeout=300)  # fmt: skip
    return data


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def dflash_export(request, served_answers, tmp_path_factory) -> Path:
    """A DFlash (or DFlash2: the same backbone plus its selector) drafter trained STEPS
    steps (one rank, hf backend) on `served_answers`; its SGLang DFLASH export."""
    out, data = tmp_path_factory.mktemp(f"served_{request.param}"), served_answers
    _run([
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
        "--master_port", str(free_port()), "train.py", "--recipe",
        "recipes/tiny_cpu_dflash.yaml", "--resume", "none", f"train.output_dir={out}",
        f"train.max_steps={STEPS}", "train.eval_interval=0",
        f"checkpoint.save_interval={STEPS}", f"data.train_files=[{data}]",
        "data.format=messages", "data.eval_files=[]", f"data.max_rows={PROMPTS}",
        "data.max_length=160", "objective.num_anchors=16", "optim.lr=0.005",
        "tracking.enabled=false", "train.preflight_samples=0", "export.formats=[sglang]",
        f"draft.kind={request.param}",
    ], timeout=600)  # fmt: skip
    return out / "export" / "sglang"


@pytest.mark.slow
def test_sglang_dflash_serves_our_dflash_export_as_our_harness_decodes_it(
    request, dflash_export, tiny_target_dir, tmp_path
):
    from evaluation.serve_check import explain, serve_check
    from specforge_dspark.drafters.registry import KINDS

    report = serve_check(
        tiny_target_dir, dflash_export, ["gsm8k"], num_prompts=PROMPTS,
        max_new_tokens=NEW_TOKENS, out_dir=tmp_path, port=free_port(), log=print,
    )  # fmt: skip
    saved = json.loads((tmp_path / "serve_check.json").read_text())
    server_log = (tmp_path / "sglang_server.log").read_text(errors="replace")
    assert "'speculative_algorithm': 'DFLASH'" in server_log  # chosen from the export's config
    kind = request.node.callspec.params["dflash_export"]
    architecture = json.loads((dflash_export / "config.json").read_text())["architectures"]
    assert architecture == [KINDS[kind].architecture]  # DFlashDraftModel / DFlash2DraftModel
    assert saved["agree"] is True, [explain(r) for r in saved["prompts"] if not r["agree"]]
    assert saved["num_prompts"] == PROMPTS
    assert saved["sglang_accept_length"] == pytest.approx(saved["harness_accept_length"])
    hists = [r["sglang_hist"] for r in saved["prompts"]]
    accepted = sum(k * n for h in hists for k, n in enumerate(h))
    runs = sum(n for h in hists for n in h[2:])  # steps accepting two drafts or more
    print(f"DFLASH served accept length {saved['sglang_accept_length']:.3f}: {accepted} drafts "
          f"accepted, {runs} steps accepting two or more; histograms {hists}")  # fmt: skip
    assert accepted >= 20 and runs >= 2, (accepted, runs, report["harness_accept_length"])


def test_our_dflash_drafts_are_the_argmax_sglang_dflash_takes(tiny_target_dir):
    """muP: the tiny Inkling's multiplier is 4.0 and our DFlash draft logits are
    lm_head(h / 4) (FrozenHead.logits, as trained); SGLang's DFLASH drafts are the argmax of
    the RAW hidden times the target head (`_DflashDraftSampler`, dflash_worker_v2.py ~189,
    and the eager ~1690), no division. A positive scale leaves an argmax where it is, so
    DFlashDraft.propose's drafts are the engine's, on every row."""
    from specforge_dspark.drafters.dflash import DFlashConfig, DFlashDraft
    from specforge_dspark.objective.frozen_head import load_frozen_head
    from tests.sglang_shim import import_sglang

    worker = import_sglang("sglang.srt.speculative.dflash_worker_v2")
    head = load_frozen_head(tiny_target_dir)
    assert head.mup_multiplier == 4.0
    cfg = DFlashConfig(
        hidden_size=head.hidden_size, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=64, vocab_size=head.vocab_rows,
        block_size=16, target_layer_ids=[0, 1, 2], num_target_layers=4, mask_token_id=9,
    )  # fmt: skip
    torch.manual_seed(0)
    draft = DFlashDraft(cfg).eval()
    seen: list[torch.Tensor] = []

    def logits_fn(h):
        seen.append(h)
        return head.logits(h)

    ctx = draft.context(torch.randn(1, 40, 3 * head.hidden_size))
    for bonus in (5, 77, 300):
        ours, _ = draft.propose(ctx, 40, bonus, head.embed, logits_fn)
        h_GH = torch.cat([torch.zeros(1, head.hidden_size), seen[-1]])  # row 0: the bonus
        sampler = worker._DflashDraftSampler(
            weight=head.lm_head_weight, block_size=16, num_org=head.vocab_rows,
            org_vocab_start=0, max_bs=1,
        )  # fmt: skip
        sampler(h_GH)
        assert torch.equal(ours, sampler.out[:15]), bonus


def _batch(embeds, replace=None, positions=None):
    return types.SimpleNamespace(
        input_embeds=embeds, replace_embeds=replace, replace_positions=positions
    )


def _bf16_original(self, forward_batch, pp_proxy_tensors):
    """model_runner.py ~1771-1782 as SGLang 0.5.23 has it: embeds cast to bfloat16."""
    kwargs = {}
    if forward_batch.input_embeds is not None:
        kwargs["input_embeds"] = forward_batch.input_embeds.bfloat16()
    if forward_batch.replace_embeds is not None:
        kwargs["input_embeds"][forward_batch.replace_positions] = forward_batch.replace_embeds.to(
            kwargs["input_embeds"].dtype
        )
    return kwargs


def test_the_dflash_draft_gets_its_noise_embeddings_in_the_runners_dtype():
    embeds = torch.randn(6, 8, dtype=torch.float32) * 1.001
    fp32, bf16 = (
        types.SimpleNamespace(dtype=torch.float32),
        types.SimpleNamespace(dtype=torch.bfloat16),
    )
    got = extend_forward_kwargs(_bf16_original, fp32, _batch(embeds), None)["input_embeds"]
    assert got.dtype == torch.float32 and torch.equal(got, embeds)  # unrounded
    kept = extend_forward_kwargs(_bf16_original, bf16, _batch(embeds), None)["input_embeds"]
    assert kept.dtype == torch.bfloat16
    assert extend_forward_kwargs(_bf16_original, fp32, _batch(None), None) == {}
    rows = torch.randn(2, 8)
    got = extend_forward_kwargs(
        _bf16_original, fp32, _batch(embeds, rows, torch.tensor([1, 4])), None
    )["input_embeds"]
    assert torch.equal(got[[1, 4]], rows) and torch.equal(got[[0, 2, 3, 5]], embeds[[0, 2, 3, 5]])


def test_the_selectors_top_k_takes_sglangs_torch_branch_on_cpu_only():
    def flashinfer_top_k(scores, k):  # what flashinfer 0.7.2 does with a CPU tensor
        raise ValueError("device must be a cuda device")

    scores = torch.randn(3, 50)
    values, ids = radix_topk(flashinfer_top_k, scores, 4)
    want = torch.topk(scores, 4, dim=-1)
    assert torch.equal(values, want.values) and torch.equal(ids, want.indices)
    cuda = types.SimpleNamespace(is_cuda=True)
    assert radix_topk(lambda s, k: ("flashinfer", k), cuda, 4) == ("flashinfer", 4)


def test_a_dflash_exports_conventions_are_read_and_checked(tiny_target_dir, tmp_path):
    """serve_check refuses a drafter made for another target: a DFlash export's record is
    read with its own config (no Markov rank), and it never drafts from the anchor."""
    from specforge_dspark.config.recipe import load_recipe
    from specforge_dspark.drafters.conventions import ConventionsError
    from specforge_dspark.drafters.dflash import DFlashConfig, DFlashDraft
    from specforge_dspark.export.conventions import check_conventions, recorded_conventions
    from specforge_dspark.export.dflash import export_dflash

    cfg = DFlashConfig.from_recipe(load_recipe(REPO / "recipes/tiny_cpu_dflash.yaml").draft)
    out = export_dflash(DFlashDraft(cfg), None, tmp_path / "dflash", tiny_target_dir)
    recorded = recorded_conventions(out)
    assert recorded["sample_from_anchor"] is False and recorded["mup_multiplier"] == 4.0
    assert recorded["target_layer_ids"] == [0, 1, 2] and recorded["vocab_rows"] == 1088
    check_conventions(out, target_path=tiny_target_dir)
    config = json.loads((out / "config.json").read_text())
    config["specforge_dspark"]["mup_multiplier"] = 1.0
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConventionsError, match="mup_multiplier"):
        check_conventions(out, target_path=tiny_target_dir)
