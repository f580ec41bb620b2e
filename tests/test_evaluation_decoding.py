"""Speculative decoding on the tiny Inkling target: lossless, exact accounting, reports.

The scripted drafters read the target's own greedy continuation, so their acceptance is
known exactly: slot k of the block whose bonus sits at position ctx_len must propose
seq[ctx_len + k + 1]; `wrong` is a padded LM-head row the target never emits.
"""

from __future__ import annotations

import csv
import json
import math
from types import SimpleNamespace

import pytest
import torch

from evaluation import acceptance
from evaluation.acceptance import evaluate, main, run_workload
from evaluation.metrics import step_stats
from specforge_dspark.decoding.hf_target import HFTarget
from specforge_dspark.decoding.loading import head_fns
from specforge_dspark.decoding.prompts import parse_workload, render
from specforge_dspark.decoding.spec_decode import LosslessError, speculative_generate
from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft
from specforge_dspark.engines.tap import AuxTap
from specforge_dspark.objective.frozen_head import load_frozen_head

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = [0, 2]
G = 4
QUESTIONS = [
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "Write a function that returns the sum of a list. " * 5,  # decoding crosses the window
]
PRIMES = ["He has 3 + 5 =", "He has 3 + 5 = <<3+5=8>>8"]  # the target then ends its turn


class ScriptedDrafter:
    """Proposes the first right(step) slots correctly and `wrong` for the rest; G drafts
    per block as DSpark, or `num_drafts` = G - 1 as DFlash."""

    def __init__(self, seq: list[int] | None, wrong: int, right, num_drafts: int = G):
        self.config = SimpleNamespace(block_size=G, target_layer_ids=LAYERS)
        self.num_drafts = num_drafts
        self.seq, self.wrong, self.right = seq, wrong, right
        self.calls: list[dict] = []

    def context(self, aux_BSD: torch.Tensor) -> torch.Tensor:
        return aux_BSD.clone()  # identity, so tests can compare with target features

    def propose(self, ctx_1SH, ctx_len, bonus_token, embed_fn, logits_fn):
        G_ = self.num_drafts
        assert ctx_1SH.shape[:2] == (1, ctx_len)
        n_right = min(self.right(len(self.calls)), G_)
        self.calls.append({"ctx_len": ctx_len, "bonus": bonus_token, "ctx": ctx_1SH})
        tokens = [self.wrong] * G_
        if n_right:
            assert self.seq[ctx_len] == bonus_token, "the bonus is not the token at ctx_len"
            for k in range(n_right):
                tokens[k] = self.seq[ctx_len + k + 1]
        conf = torch.tensor([3.0 if k < n_right else -3.0 for k in range(G_)])
        return torch.tensor(tokens), conf


def _no_head(*_a):
    raise AssertionError("scripted drafters use neither embedding nor LM head")


@pytest.fixture(scope="module")
def target(tiny_target_dir, one_thread) -> HFTarget:
    return HFTarget.load(tiny_target_dir, LAYERS)


@pytest.fixture(scope="module")
def wrong(target) -> int:
    assert target.model.config.vocab_size > target.model.config.unpadded_vocab_size
    return target.model.config.vocab_size - 1  # a padded row: never the target's argmax


def _uncut(target: HFTarget, ids: list[int], n: int) -> list[int]:
    """Greedy continuation that ignores end-of-turn (what an oracle must know)."""
    eos, target.eos_ids = target.eos_ids, set()
    try:
        return target.greedy(ids, n)
    finally:
        target.eos_ids = eos


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    """Two chat prompts, and two primed with an answer's start so the target ends early."""
    tok = target.tokenizer
    ids = [render(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    primed = [ids[0] + tok.encode(p) for p in PRIMES]
    return [*ids, *primed]


def test_greedy_reference_matches_generate(target, prompts, references):
    for i in (0, 2):  # runs to max_new_tokens; ends on end-of-turn
        x = torch.tensor([prompts[i]])
        out = target.model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False
        )
        assert target.greedy(prompts[i], 20) == out[0, x.shape[1] :].tolist()
        assert target.greedy(prompts[i], 40) == references[i][0]


def test_prompts_cover_early_end_of_turn_and_the_sliding_window(target, prompts, references):
    window = target.model.config.sliding_window_size
    assert len(prompts[1]) < window < len(prompts[1]) + len(references[1][0])
    ends = [len(full) for full, _ in references if full[-1] in target.eos_ids]
    assert len(ends) >= 2 and all(n < 40 for n in ends)
    assert any(n % (G + 1) not in (0, 1) for n in ends)  # the end falls inside a step


@pytest.fixture(scope="module")
def references(target, prompts) -> list[tuple[list[int], list[int]]]:
    """Per prompt: plain greedy (ends on end-of-turn) and the continuation beyond it."""
    refs = []
    for ids in prompts:
        uncut = _uncut(target, ids, 40 + G + 1)
        end = next((i + 1 for i, t in enumerate(uncut) if t in target.eos_ids), 40)
        refs.append((uncut[: min(end, 40)], uncut))
    return refs


DRAFTERS = {
    "oracle": lambda step: G,
    "always_wrong": lambda step: 0,
    "partial": lambda step: step % (G + 1),  # 0, 1, .., G, 0, ...
}


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
@pytest.mark.parametrize("max_new", [1, 2, 9, 40])
def test_accounting_is_exact_and_lossless(target, prompts, references, wrong, kind, max_new):
    for ids, (full, uncut) in zip(prompts, references, strict=True):
        ref = full[:max_new]
        drafter = ScriptedDrafter(ids + uncut, wrong, DRAFTERS[kind])
        gen = speculative_generate(target, drafter, ids, max_new, _no_head, _no_head)
        assert gen.tokens == ref
        steps = gen.steps
        assert 1 + sum(s.committed for s in steps) == len(ref)
        assert [s.accepted for s in steps] == [min(DRAFTERS[kind](i), G) for i in range(len(steps))]
        # every step but the last commits accepted + 1; the last may be cut
        assert all(s.committed == s.accepted + 1 for s in steps[:-1])
        if steps:
            assert 1 <= steps[-1].committed <= steps[-1].accepted + 1
        if kind == "oracle":
            assert len(steps) == math.ceil((len(ref) - 1) / (G + 1))
            assert all(s.committed == G + 1 for s in steps[:-1])
        if kind == "always_wrong":
            assert len(steps) == len(ref) - 1
            assert all(s.committed == 1 for s in steps)


@pytest.mark.parametrize("max_new", [2, 9, 40])
def test_dflash_shaped_blocks_run_through_the_same_loop(
    target, prompts, references, wrong, max_new
):
    """G - 1 drafts per block (DFlash drafts from rows 1..G-1): each step verifies
    [bonus, G - 1 drafts], accepts 0..G-1, and the accounting and output are the same."""
    for ids, (full, uncut) in zip(prompts, references, strict=True):
        drafter = ScriptedDrafter(ids + uncut, wrong, DRAFTERS["partial"], num_drafts=G - 1)
        gen = speculative_generate(target, drafter, ids, max_new, _no_head, _no_head)
        assert gen.tokens == full[:max_new]
        steps = gen.steps
        assert [s.accepted for s in steps] == [min(i % (G + 1), G - 1) for i in range(len(steps))]
        assert all(len(s.drafts) == G - 1 for s in steps)
        assert all(s.committed == s.accepted + 1 for s in steps[:-1])
        assert 1 + sum(s.committed for s in steps) == len(gen.tokens)


def test_oracle_accept_length_is_block_plus_one(target, prompts, references, wrong):
    ids, (_, uncut) = prompts[0], references[0]
    assert len(uncut) - 1 >= 2 * (G + 1)
    n_new = 1 + 2 * (G + 1)  # two full steps, nothing cut
    gen = speculative_generate(
        target,
        ScriptedDrafter(ids + uncut, wrong, DRAFTERS["oracle"]),
        ids,
        n_new,
        _no_head,
        _no_head,
    )
    assert [s.committed for s in gen.steps] == [G + 1, G + 1]
    wrong_gen = speculative_generate(
        target,
        ScriptedDrafter(None, wrong, DRAFTERS["always_wrong"]),
        ids,
        n_new,
        _no_head,
        _no_head,
    )
    assert sum(s.committed for s in wrong_gen.steps) / len(wrong_gen.steps) == 1.0


def test_context_features_are_those_of_committed_tokens(target, prompts, references, wrong):
    ids, (_, uncut) = prompts[1], references[1]
    drafter = ScriptedDrafter(ids + uncut, wrong, DRAFTERS["partial"])
    gen = speculative_generate(target, drafter, ids, 30, _no_head, _no_head)
    last = drafter.calls[-1]
    seq = ids + gen.tokens
    assert last["bonus"] == seq[last["ctx_len"]]
    assert target.cache_length() >= last["ctx_len"]
    tap = AuxTap(target.model, LAYERS)  # one uncached forward over the committed tokens
    with torch.inference_mode(), tap:
        target.model(torch.tensor([seq[: last["ctx_len"]]]))
    want = torch.cat(tap.taps(), dim=-1)[0]
    torch.testing.assert_close(last["ctx"][0], want, atol=1e-4, rtol=1e-4)


def test_rerun_cache_mode_is_lossless_too(tiny_target_dir, prompts, references, wrong):
    rerun = HFTarget.load(tiny_target_dir, LAYERS, cache_mode="rerun")
    for ids, (full, uncut) in zip(prompts, references, strict=True):
        drafter = ScriptedDrafter(ids + uncut, wrong, DRAFTERS["partial"])
        gen = speculative_generate(rerun, drafter, ids, 40, _no_head, _no_head)
        assert gen.tokens == full
        assert [s.accepted for s in gen.steps[:-1]] == [
            i % (G + 1) for i in range(len(gen.steps) - 1)
        ]


class RepeatDrafter(ScriptedDrafter):
    """Drafts the bonus token G times: right only on repeats (acceptance varies)."""

    def __init__(self):
        super().__init__(None, 0, lambda step: 0)

    def propose(self, ctx_1SH, ctx_len, bonus_token, embed_fn, logits_fn):
        conf = torch.linspace(2.0, -2.0, G) + 0.1 * (ctx_len % 7)
        return torch.full((G,), bonus_token), conf


def test_evaluate_writes_consistent_reports(tiny_target_dir, tmp_path, shared_data):
    out = tmp_path / "eval"
    head = SimpleNamespace(embed=_no_head, logits=_no_head, logical_vocab=1024)
    summary = evaluate(
        tiny_target_dir,
        RepeatDrafter(),
        ["gsm8k", "mt_bench"],
        num_prompts=1,
        max_new_tokens=12,
        out_dir=out,
        data_dir=shared_data / "eval",
        head=head,
        log=lambda *_: None,
    )
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    wl = on_disk["workloads"]
    assert set(wl) == {"gsm8k", "mt_bench"}
    assert wl["gsm8k"]["generations"] == 1 and wl["mt_bench"]["generations"] == 2  # two turns
    for stats in wl.values():
        assert stats["lossless"] is True
        assert stats["accept_length"] == stats["committed_tokens"] / stats["steps"]
        assert stats["new_tokens"] == stats["committed_tokens"] + stats["generations"]
        assert sum(stats["accept_length_hist"].values()) == stats["steps"]
        assert len(stats["per_position"]) == G
        assert stats["drafted_tokens"] == G * stats["steps"]
        assert stats["padded_draft_rate"] == 0.0  # it drafts bonus tokens: all logical
    overall = on_disk["overall"]
    assert overall["padded_draft_rate"] == 0.0 and on_disk["logical_vocab"] == 1024
    assert overall["steps"] == sum(w["steps"] for w in wl.values())
    pooled = sum(w["committed_tokens"] for w in wl.values()) / overall["steps"]
    assert overall["accept_length"] == pytest.approx(pooled)
    with (out / "per_position.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == G * 3
    for row in rows:
        stats = overall if row["workload"] == "overall" else wl[row["workload"]]
        assert float(row["acceptance_rate"]) == stats["per_position"][int(row["position"])]
        assert int(row["steps"]) == stats["steps"]
    for name in ("per_position.png", "calibration.png", "accept_length_hist.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "| gsm8k |" in report and "padded drafts" in report
    # intervals over prompts, and the decoded texts beside the report
    for stats in [*wl.values(), overall]:
        low, high = stats["accept_length_ci"]
        assert low <= stats["accept_length"] <= high
    gens = [json.loads(line) for line in (out / "generations.jsonl").open()]
    assert [(g["workload"], g["turn"]) for g in gens] == [
        ("gsm8k", 0),
        ("mt_bench", 0),
        ("mt_bench", 1),
    ]
    assert sum(g["verify_steps"] for g in gens) == overall["steps"]
    assert all(g["output"] and g["new_tokens"] == 1 + g["committed"] for g in gens)


def test_ngram_drafter_is_lossless_and_shares_the_reference(tiny_target_dir, tmp_path, shared_data):
    from specforge_dspark.decoding.ngram import NgramDrafter

    references: dict = {}
    kw = dict(num_prompts=2, max_new_tokens=24, data_dir=shared_data / "eval", log=lambda *_: None)
    a = evaluate(tiny_target_dir, NgramDrafter(4), ["gsm8k"], out_dir=tmp_path / "a",
                 references=references, **kw)  # fmt: skip
    assert len(references) == 2 and a["overall"]["lossless"] is True
    assert a["draft"] == "NgramDrafter" and a["block_size"] == 4
    b = evaluate(tiny_target_dir, "ngram:4", ["gsm8k"], out_dir=tmp_path / "b",
                 references=references, **kw)  # fmt: skip
    assert len(references) == 2  # decoded once, checked twice
    assert b["overall"]["accept_length"] == a["overall"]["accept_length"] >= 1.0


def test_mt_bench_second_turn_follows_the_targets_first_answer(target, shared_data, wrong):
    mt = parse_workload("mt_bench", shared_data / "eval")
    drafter = ScriptedDrafter(None, wrong, lambda s: 0)
    stats, gens = run_workload(target, drafter, mt, 1, 8, _no_head, _no_head, lambda *_: None)
    assert stats["generations"] == 2 and stats["lossless"]
    first, second = gens
    answer = target.tokenizer.decode(
        [t for t in first.tokens if t not in target.eos_ids], skip_special_tokens=True
    )
    text = target.tokenizer.decode(second.prompt_ids)
    turns = json.loads((shared_data / "eval" / "mt_bench_questions.jsonl").open().readline())
    assert text.index(turns["turns"][0]) < text.index(answer) < text.index(turns["turns"][1])
    assert text.endswith("<|im_start|>assistant\n")


def test_a_broken_rollback_is_caught(target, prompts, wrong, monkeypatch):
    monkeypatch.setattr(target, "commit", lambda ids, n_keep: None)  # never drops rejects
    drafter = ScriptedDrafter(None, wrong, lambda s: 0)
    with pytest.raises(AssertionError, match="cache must hold exactly the context"):
        speculative_generate(target, drafter, prompts[0], 8, _no_head, _no_head)


def test_any_difference_names_workload_and_prompt(target, shared_data, wrong, monkeypatch):
    calls = []

    def flip_second_prompt(*args):
        gen = speculative_generate(*args)
        calls.append(gen)
        if len(calls) == 2:
            gen.tokens[3] += 1
        return gen

    monkeypatch.setattr(acceptance, "speculative_generate", flip_second_prompt)
    drafter = ScriptedDrafter(None, wrong, lambda s: 0)
    gsm8k = parse_workload("gsm8k", shared_data / "eval")
    with pytest.raises(LosslessError, match="workload gsm8k prompt 1: .* at new token 3"):
        run_workload(target, drafter, gsm8k, 2, 6, _no_head, _no_head, log=lambda *_: None)


def _random_draft(target: HFTarget, markov_rank: int = 16) -> DSparkDraft:
    cfg = target.model.config
    torch.manual_seed(0)
    return DSparkDraft(
        DSparkConfig(
            hidden_size=cfg.hidden_size,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            vocab_size=cfg.vocab_size,
            block_size=G,
            target_layer_ids=LAYERS,
            num_target_layers=cfg.num_hidden_layers,
            mask_token_id=target.tokenizer.mask_token_id,
            markov_rank=markov_rank,
        )
    ).eval()


def test_untrained_dspark_draft_is_lossless(target, tiny_target_dir, prompts, references):
    draft = _random_draft(target)
    embed_fn, logits_fn = head_fns(load_frozen_head(tiny_target_dir))
    for max_new in (1, 7, 40):
        for ids, (full, _) in zip(prompts, references, strict=True):
            gen = speculative_generate(target, draft, ids, max_new, embed_fn, logits_fn)
            assert gen.tokens == full[:max_new]
            assert all(len(s.confidence) == G for s in gen.steps)


def test_accounting_counts_padded_drafts(target, prompts, references, wrong):
    """`wrong` is a padded row: the partial drafter drafts it in every slot it gets wrong."""
    ids, (_, uncut) = prompts[1], references[1]
    drafter = ScriptedDrafter(ids + uncut, wrong, DRAFTERS["partial"])
    gen = speculative_generate(target, drafter, ids, 30, _no_head, _no_head)
    logical = target.model.config.unpadded_vocab_size
    stats = step_stats(gen.steps, G, logical)
    n_wrong = sum(G - min(DRAFTERS["partial"](i), G) for i in range(len(gen.steps)))
    assert stats["padded_drafts"] == n_wrong > 0
    assert stats["padded_draft_rate"] == n_wrong / (G * len(gen.steps))


def test_harness_drafts_over_all_lm_head_rows_as_served(target, tiny_target_dir, prompts):
    """A draft whose Markov head lifts a padded row above every logical one drafts that row
    (SGLang takes the draft's argmax over all LM-head rows); the target never accepts it,
    decoding stays lossless and padded_draft_rate counts it. Cropping the draft's logits
    (what the harness did before) would hide it."""
    head = load_frozen_head(tiny_target_dir)
    padded_row = head.vocab_rows - 1
    assert padded_row >= head.logical_vocab
    draft = _random_draft(target)
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.zero_()[:, 0] = 1.0  # every prev token
        draft.markov_head.markov_w2.weight.zero_()[padded_row, 0] = 1000.0
    embed_fn, logits_fn = head_fns(head)
    ids = prompts[0]
    gen = speculative_generate(target, draft, ids, 12, embed_fn, logits_fn)
    assert gen.tokens == target.greedy(ids, 12)
    assert all(s.drafts == [padded_row] * G and s.accepted == 0 for s in gen.steps)
    assert step_stats(gen.steps, G, head.logical_vocab)["padded_draft_rate"] == 1.0
    cropped = speculative_generate(
        target, draft, ids, 12, embed_fn, lambda h: head.logits(h)[..., : head.logical_vocab]
    )
    assert step_stats(cropped.steps, G, head.logical_vocab)["padded_draft_rate"] == 0.0


def _bigram_draft(target: HFTarget, sequences: list[list[int]]) -> DSparkDraft:
    """A DSparkDraft whose Markov head replays the target's greedy bigrams (first seen wins):
    right where the continuation is locally predictable, wrong elsewhere."""
    nxt: dict[int, int] = {}
    for seq in sequences:
        for a, b in zip(seq, seq[1:], strict=False):
            nxt.setdefault(a, b)
    draft = _random_draft(target, markov_rank=len(nxt))
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.zero_()
        draft.markov_head.markov_w2.weight.zero_()
        for i, (a, b) in enumerate(nxt.items()):
            draft.markov_head.markov_w1.weight[a, i] = 1.0
            draft.markov_head.markov_w2.weight[b, i] = 100.0
    return draft


def test_dspark_draft_with_real_acceptance_is_lossless(
    target, tiny_target_dir, prompts, references
):
    draft = _bigram_draft(
        target, [ids + uncut for ids, (_, uncut) in zip(prompts, references, strict=True)]
    )
    embed_fn, logits_fn = head_fns(load_frozen_head(tiny_target_dir))
    accepted = []
    for max_new in (9, 40):
        for ids, (full, _) in zip(prompts, references, strict=True):
            gen = speculative_generate(target, draft, ids, max_new, embed_fn, logits_fn)
            assert gen.tokens == full[:max_new]
            accepted += [s.accepted for s in gen.steps]
    # the real propose path (slot k drafts position ctx_len+k+1) accepts whole blocks,
    # parts of blocks and nothing, so every kind of rollback is exercised
    assert {0, G} < set(accepted), sorted(accepted)


def test_cli_on_an_exported_draft(target, tiny_target_dir, tmp_path):
    draft_dir = tmp_path / "draft"
    _random_draft(target).save_pretrained(draft_dir)
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"text": QUESTIONS[1]}) + "\n")
    out = tmp_path / "out"
    rc = main(
        [
            "--target", str(tiny_target_dir), "--draft", str(draft_dir),
            "--workloads", f"gsm8k,mine={mine}:text", "--num-prompts", "1",
            "--max-new-tokens", "6", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["workloads"]) == {"gsm8k", "mine"}
    assert summary["overall"]["lossless"] is True and summary["block_size"] == G
    config = json.loads((draft_dir / "config.json").read_text())
    (draft_dir / "config.json").write_text(json.dumps({**config, "num_target_layers": 6}))
    with pytest.raises(ValueError, match="num_target_layers=6, but the target has 4"):
        main(["--target", str(tiny_target_dir), "--draft", str(draft_dir), "--out", str(out)])


def test_batched_references_match_and_a_wrong_one_is_redone_one_by_one(
    tiny_target_dir, tmp_path, shared_data
):
    from evaluation.references import greedy_references
    from specforge_dspark.decoding.ngram import NgramDrafter

    data = shared_data / "eval"
    refs = greedy_references(tiny_target_dir, ["mt_bench"], 2, 16, data_dir=data)
    assert len(refs) == 4  # 2 conversations x 2 turns; turn 2 follows the batched answers
    key = next(iter(refs))
    good = refs[key][0]
    refs[key] = ([t + 1 for t in good], None)  # a wrong batched reference
    logs: list[str] = []
    summary = evaluate(tiny_target_dir, NgramDrafter(3), ["mt_bench"], num_prompts=2,
                       max_new_tokens=16, out_dir=tmp_path, data_dir=data, references=refs,
                       log=logs.append)  # fmt: skip
    assert summary["overall"]["lossless"] is True
    assert len(refs) == 4, "every prompt the evaluation built was in the batched cache"
    assert refs[key][0] == good and refs[key][1] is not None  # decoded one by one again
    # only the corrupted entry was redone: the batches equal one-by-one greedy decoding
    assert sum("batched reference differed" in m for m in logs) == 1
    assert summary["workloads"]["mt_bench"]["speedup"] is None  # batched: not timed


def test_a_greedy_output_that_differs_raises_or_is_followed_and_counted(
    tiny_target_dir, tmp_path, shared_data
):
    """A timed reference that differs (as a quantized target's near tie, rounded apart in a
    verify forward, would make it): the lossless check refuses it; with divergence
    "follow" the evaluation counts it, follows the speculative output and says so."""
    from evaluation.references import greedy_references
    from specforge_dspark.decoding.ngram import NgramDrafter
    from specforge_dspark.decoding.spec_decode import LosslessError

    data = shared_data / "eval"
    refs = greedy_references(tiny_target_dir, ["gsm8k"], 2, 16, data_dir=data)
    key = next(iter(refs))
    refs[key] = ([t + 1 for t in refs[key][0]], 0.5)  # timed: not decoded again
    kw = dict(num_prompts=2, max_new_tokens=16, data_dir=data)
    with pytest.raises(LosslessError, match="workload gsm8k prompt 0"):
        evaluate(tiny_target_dir, NgramDrafter(3), ["gsm8k"], out_dir=tmp_path / "r",
                 references=dict(refs), **kw)  # fmt: skip
    logs: list[str] = []
    summary = evaluate(tiny_target_dir, NgramDrafter(3), ["gsm8k"], out_dir=tmp_path / "f",
                       references=dict(refs), divergence="follow", log=logs.append,
                       **kw)  # fmt: skip
    assert summary["overall"]["diverged"] == 1 and summary["overall"]["lossless"] is False
    assert sum("differs from plain greedy" in m for m in logs) == 1
    with pytest.raises(ValueError, match="divergence must be raise or follow"):
        evaluate(tiny_target_dir, NgramDrafter(3), ["gsm8k"], out_dir=tmp_path / "x",
                 divergence="ignore", **kw)  # fmt: skip
