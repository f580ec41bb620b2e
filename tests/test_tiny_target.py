"""The tiny target is a real Inkling checkpoint that loads offline from its folder."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specforge_dspark.config.recipe import load_recipe


def test_loads_offline_with_auto_classes(tiny_target_dir, repo):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    cfg = model.config
    assert type(model).__name__ == "InklingForCausalLM"
    assert {"hybrid", "hybrid_sliding"} <= set(cfg.layer_types)  # hybrid attention
    assert "sparse" in cfg.mlp_layer_types and cfg.n_routed_experts > 1  # MoE
    assert cfg.logits_mup_width_multiplier != 1.0
    assert cfg.unpadded_vocab_size == len(tok) < cfg.vocab_size  # padded LM head rows
    assert tok.mask_token_id is not None and tok.mask_token_id < len(tok)
    # the tiny recipe is consistent with the target it trains against
    r = load_recipe(repo / "recipes" / "tiny_cpu.yaml")
    assert r.draft.vocab_size == cfg.vocab_size and r.draft.hidden_size == cfg.hidden_size
    assert r.draft.num_target_layers == cfg.num_hidden_layers
    assert r.draft.mask_token_id == tok.mask_token_id
    assert (
        max(r.draft.target_layer_ids) <= cfg.num_hidden_layers - 2
        and len(r.draft.target_layer_ids) >= 2
    )


def test_chat_template_and_generation(tiny_target_dir):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    msgs = [
        {"role": "user", "content": "How many apples?"},
        {"role": "assistant", "content": "Three apples."},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<|im_start|>user\nHow many apples?<|im_end|>\n"
        "<|im_start|>assistant\nThree apples.<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(
        msgs[:1], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert prompt.endswith("<|im_start|>assistant\n<think></think>")
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    ids = tok.apply_chat_template(
        msgs[:1], add_generation_prompt=True, return_tensors="pt", return_dict=False
    )
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, do_sample=False)
    words = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert sum(c.isalpha() for c in words) > 10  # text-like after pre-training, not byte noise


def test_pretraining_lowered_the_loss_and_build_is_cached(tiny_target_dir):
    from specforge_dspark.targets.target import build

    info = json.loads((tiny_target_dir / "build_info.json").read_text())
    losses = info["pretrain_losses"]
    assert losses[-1] < losses[0] - 2.0
    before = (tiny_target_dir / "model.safetensors").stat().st_mtime_ns
    build(tiny_target_dir, log=lambda *a: None)
    assert (tiny_target_dir / "model.safetensors").stat().st_mtime_ns == before


def test_loops_detects_short_periods_only():
    from specforge_dspark.targets.corpus import loops

    assert loops([7] * 48)
    assert loops(list(range(100)) + [1, 2, 3] * 16)  # period 3 in the last 48
    assert loops([0] * 10 + list(range(8)) * 6)  # period 8
    assert not loops(list(range(9)) * 6)  # period 9
    assert not loops([1, 2] * 23)  # too short to judge (46 < 48 tokens)
    assert not loops([1, 2] * 30 + [5])  # broken by the last token


def test_target_writes_without_looping(tiny_target_dir):
    """Measured at build (build_info.json) and re-checked here on the first prompts."""
    from specforge_dspark.targets.pretrain import LOOP_WORKLOADS, greedy_loop_rate

    info = json.loads((tiny_target_dir / "build_info.json").read_text())
    rows = info["continuations"]
    assert len(rows) == 20 * len(LOOP_WORKLOADS) and {r["workload"] for r in rows} == set(
        LOOP_WORKLOADS
    )
    assert info["loop_rate"] == pytest.approx(sum(r["loops"] for r in rows) / len(rows))
    assert info["loop_rate"] <= 0.20, f"the tiny target loops on {info['loop_rate']:.0%} of prompts"
    held = info["heldout_loss"]
    assert {"gsm8k_test_answers", "mt_bench_questions", "sharegpt_answers", "mean"} <= set(held)
    assert 0 < held["gsm8k_test_answers"] < 3.0 and 0 < held["mean"] < 4.0
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    again = greedy_loop_rate(model, tok, num_prompts=1)["continuations"]
    first = {(r["workload"], r["index"]): r for r in rows}
    for r in again:  # the recorded continuations are this model's
        assert first[(r["workload"], r["index"])]["text"] == r["text"]


def test_a_build_kept_by_key_is_copied_not_rebuilt(tmp_path, monkeypatch):
    """A second clone on the same machine copies the finished build of the same key from
    the store ($SPECFORGE_TINY_STORE); another key is not taken from it."""
    from specforge_dspark.targets import store as stores
    from specforge_dspark.targets import target

    store = tmp_path / "store"
    kept = store / "qwen3-k1"
    kept.mkdir(parents=True)
    (kept / ".build_key").write_text("k1")
    (kept / "model.safetensors").write_text("the kept build")
    monkeypatch.setenv(stores.STORE, str(store))
    monkeypatch.setattr(target, "build_key", lambda settings: "k1")
    said: list[str] = []
    out = target.build(tmp_path / "clone" / "tiny_qwen3", arch="qwen3", log=said.append)
    assert (out / "model.safetensors").read_text() == "the kept build"
    assert said == [f"tiny target: copied the build of key k1 from {kept}"]

    def no_build(*args):
        raise AssertionError("rebuilt")

    monkeypatch.setattr(target, "build_key", lambda settings: "k2")
    monkeypatch.setattr(target, "_build_into", no_build)
    with pytest.raises(AssertionError, match="rebuilt"):  # key k2 is not in the store
        target.build(tmp_path / "other", arch="qwen3", log=said.append)
    monkeypatch.setenv(stores.STORE, "")
    assert stores.store() is None
