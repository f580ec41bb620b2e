"""DFlash2 drafter: its greedy drafts against SGLang's own selector code, the selector
loss against a naive per-slot reference, the stop-gradient, and the export SGLang loads."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specforge_dspark.config.recipe import ObjectiveRecipe
from specforge_dspark.drafters.dflash2 import DFlash2Config, DFlash2Draft
from specforge_dspark.drafters.registry import KINDS, kind_of_dir, loss_fn
from specforge_dspark.export import dflash as export_dflash
from specforge_dspark.export.source import checkpoint_kind
from specforge_dspark.objective.frozen_head import FrozenHead
from specforge_dspark.objective.loss import compute_loss_at
from specforge_dspark.objective.selector_loss import selector_term
from specforge_dspark.objective.vocab_loss import FusedVocabLoss, VocabPlan
from tests.sglang_shim import import_sglang
from tests.test_dflash import batch
from tests.test_dflash import draft_and_head as dflash_draft_and_head
from tests.test_export import loaded_params, unpacked_params
from tests.test_export_dflash import sglang_dflash_model

pytestmark = pytest.mark.usefixtures("one_thread")

SELECTOR = dict(selector_rank=6, selector_top_k=4)


def draft_and_head(seed: int = 0) -> tuple[DFlash2Draft, FrozenHead]:
    return dflash_draft_and_head(seed, (DFlash2Config, DFlash2Draft), **SELECTOR)


def test_registry_lists_dflash2():
    assert KINDS["dflash2"].architecture == "DFlash2DraftModel"
    assert loss_fn("dflash2").keywords["extra"] is selector_term


def test_greedy_drafts_are_sglangs_selector_walk():
    """Our propose against SGLang's CandidateSelector.build_lattice + sample_path (its CPU
    branch, greedy rows) over the same hidden rows and candidates."""
    dflash = import_sglang("sglang.srt.models.dflash")
    draft, head = draft_and_head()
    draft, head = (
        draft.float(),
        FrozenHead(
            *(t.float() for t in (head.embed_weight, head.lm_head_weight)), head.vocab_rows, 2.0
        ),
    )
    theirs = dflash.CandidateSelector(hidden_size=32, vocab_size=72, state_rank=6, top_k=4)
    theirs.load_state_dict(draft.candidate_selector.state_dict())
    g = torch.Generator().manual_seed(5)
    checked = 0
    for ctx_len, bonus in ((6, 3), (9, 40), (12, 17)):
        ctx = draft.context(torch.randn(1, 12, 64, generator=g))
        ours, _ = draft.propose(ctx, ctx_len, bonus, head.embed, head.logits)
        with torch.no_grad():
            h = draft.block_hidden(ctx, ctx_len, bonus, head.embed)[1:][None]
            unary, cand = head.logits(h).float().topk(4, dim=-1)
            with torch._dynamo.config.patch(disable=True):  # eager: no C++ build in a test
                scores = theirs.build_lattice(
                    candidate_ids=cand,
                    unary_logits=unary,
                    hidden_states=h,
                    anchor_token_ids=torch.tensor([bonus]),
                )
                tokens, _ = theirs.sample_path(
                    candidate_ids=cand,
                    scores=scores,
                    uniforms=torch.rand(1, 4),
                    temperatures=torch.ones(1),
                    greedy_mask=torch.ones(1, dtype=torch.bool),
                )
        assert ours.tolist() == tokens[0].tolist()
        checked += int((ours != cand[0, :, 0]).any())  # the walk chose past the top-1
    assert checked >= 1, "every walk equalled the unary argmax: the pair term never mattered"


def naive_selector(draft, head, h_XGH, teacher_XGH, prev_XG, coef_XG, mask_XG):
    """Per slot, in plain loops: candidates, gold injection, pair scores, CE."""
    sel, K = draft.candidate_selector, draft.config.selector_top_k
    A, B, P = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    total, right, found, n = 0.0, 0, 0, 0
    for x in range(h_XGH.shape[0]):
        for g in range(h_XGH.shape[1]):
            h = h_XGH[x, g].detach()
            logits = head.logits(h).float()
            gold = int(head.teacher_logits(teacher_XGH[x, g])[: head.logical_vocab].argmax())
            cand = [int(i) for i in logits.topk(K).indices]
            hit = gold in cand
            if not hit:
                cand[-1] = gold
            code = A[int(prev_XG[x, g])] * (P @ h)
            scores = torch.stack([logits[c] + (code * B[c]).sum() for c in cand])
            target = cand.index(gold)
            total = total + coef_XG[x, g] * -F.log_softmax(scores.float(), 0)[target]
            if mask_XG[x, g]:
                n, found = n + 1, found + hit
                right += int(scores.argmax()) == target
    return total, right / n, found / n


def test_selector_loss_equals_the_naive_reference_and_chunking_changes_nothing():
    """The candidates come from the vocab loss's own chunks (FusedVocabLoss with top_k),
    the term scores them; against plain per-slot loops over the head."""
    draft, head = draft_and_head()
    g = torch.Generator().manual_seed(1)
    X, G, H = 5, 4, 32
    h = torch.randn(X, G, H, generator=g).double()
    teacher = h + 0.7 * torch.randn(X, G, H, generator=g).double()  # near: some gold in top-K
    prev = torch.randint(0, 72, (X, G), generator=g)
    labels = torch.randint(0, 64, (X, G), generator=g)
    coef = torch.rand(X, G, generator=g).double()
    mask = torch.rand(X, G, generator=g) > 0.2
    want, acc, recall = naive_selector(draft, head, h, teacher, prev, coef, mask)
    obj = ObjectiveRecipe(bce_weight=0.0)
    for chunk in (1, 2, X):
        plan = VocabPlan(draft, head, prev, labels, teacher, coef, obj, chunk, False, top_k=4)
        FusedVocabLoss.apply(plan, h)
        got, metrics = selector_term(draft, plan.candidates, h, prev, coef, coef, mask, 1.0)
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6)
        assert metrics["selector_acc"].item() == pytest.approx(acc)
        assert metrics["candidate_recall"].item() == pytest.approx(recall)
    assert 0 < recall < 1, "the gold was always (or never) among the top-K: injection untested"


def test_the_selector_term_trains_only_the_selector():
    """Stop-gradient: the backbone's gradients are the DFlash loss's alone."""
    draft, head = draft_and_head()
    ids, mask, aux, last = batch(draft)
    anchors, valid = torch.tensor([[3, 6, 8]]), torch.ones(1, 3, dtype=torch.bool)
    obj = ObjectiveRecipe(num_anchors=3, bce_weight=0.0, chunk_size=2)
    grads = []
    for extra in (None, selector_term):
        draft.zero_grad()
        out = compute_loss_at(draft, head, ids, mask, aux, last, anchors, valid, obj, extra=extra)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    plain, with_selector = grads
    assert not any(n.startswith("candidate_selector") for n in plain)
    for name, grad in plain.items():
        assert torch.equal(grad, with_selector[name]), name
    selector = [g for n, g in with_selector.items() if n.startswith("candidate_selector")]
    assert len(selector) == 3 and all(g.abs().sum() > 0 for g in selector)
    assert {"selector_loss", "selector_acc", "candidate_recall"} <= set(out.metrics)


def test_export_is_what_sglangs_dflash2_model_loads(tmp_path, monkeypatch):
    draft, _ = draft_and_head()
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"logits_mup_width_multiplier": 4.0}))
    draft = draft.float()
    out = export_dflash.export_dflash(draft, None, tmp_path / "d2", target_path=target)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert raw["dflash_config"]["output_multiplier"] == 0.25
    assert draft.config.output_multiplier == 1.0  # the exported draft is left as it was
    assert kind_of_dir(out) == checkpoint_kind(out) == "dflash2"
    back = DFlash2Draft.from_pretrained(out)
    assert back.config.selector_top_k == 4 and back.config.output_multiplier == 0.25

    hf_config = import_sglang("sglang.srt.utils.hf_transformers.config").get_config(
        str(out), trust_remote_code=False
    )
    parsed = import_sglang("sglang.srt.speculative.dflash_utils").parse_dflash_draft_config(
        draft_hf_config=hf_config
    )
    assert (parsed.selector_rank, parsed.selector_top_k) == (6, 4)
    assert parsed.output_multiplier == 0.25
    model = sglang_dflash_model("DFlash2DraftModel", hf_config, monkeypatch)
    ours = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in ours.items()} == unpacked_params(model)
    params = loaded_params(model, ours)
    for name in ("predecessor_codebook", "successor_codebook", "hidden_projection.weight"):
        key = f"candidate_selector.{name}"
        assert torch.equal(params[key].float(), ours[key].float()), key


def test_the_selector_off_drafts_the_backbones_argmax_from_the_same_export(tmp_path):
    """`no-selector:DIR` (decoding/loading.py) decodes a DFlash2 export as DFlash would:
    every row's argmax of the same backbone, so the selector's own gain is measured from
    one checkpoint; a DSpark or DFlash export is refused (it has no selector)."""
    from specforge_dspark.decoding.loading import load_drafter

    draft, head = draft_and_head()
    draft = draft.float()
    draft.save_pretrained(tmp_path / "dflash2", dtype=torch.float32)
    on = load_drafter(str(tmp_path / "dflash2"), "cpu", torch.float32)
    off = load_drafter(f"no-selector:{tmp_path / 'dflash2'}", "cpu", torch.float32)
    assert on.use_selector and not off.use_selector
    logits = lambda h: head.logits(h).float()  # noqa: E731
    g = torch.Generator().manual_seed(5)
    differed = 0
    for ctx_len, bonus in ((6, 3), (9, 40), (12, 17)):
        ctx = off.context(torch.randn(1, 12, 64, generator=g))
        ours, _ = off.propose(ctx, ctx_len, bonus, head.embed, head.logits)
        with torch.no_grad():
            h = off.block_hidden(ctx, ctx_len, bonus, head.embed)[1:]
        assert ours.tolist() == logits(h).argmax(-1).tolist()  # DFlash's drafts
        with_selector, _ = on.propose(ctx, ctx_len, bonus, head.embed, head.logits)
        differed += int(not torch.equal(with_selector, ours))
    assert differed >= 1, "the selector never changed a draft: the check shows nothing"
    plain, _ = dflash_draft_and_head(0)
    plain.save_pretrained(tmp_path / "dflash", dtype=torch.float32)
    with pytest.raises(ValueError, match="not a DFlash2 export"):
        load_drafter(f"no-selector:{tmp_path / 'dflash'}", "cpu", torch.float32)


def test_jointly_the_selector_trains_the_backbone_too():
    """objective.selector_detach: false (the other references' choice): the selector's CE
    reaches the backbone, whose gradients then differ from the DFlash loss's alone."""
    draft, head = draft_and_head()
    ids, mask, aux, last = batch(draft)
    anchors, valid = torch.tensor([[3, 6, 8]]), torch.ones(1, 3, dtype=torch.bool)
    grads = []
    for extra, detach in ((None, True), (selector_term, False)):
        obj = ObjectiveRecipe(num_anchors=3, bce_weight=0.0, chunk_size=2, selector_detach=detach)
        draft.zero_grad()
        out = compute_loss_at(draft, head, ids, mask, aux, last, anchors, valid, obj, extra=extra)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    plain, joint = grads
    moved = [n for n, g in plain.items() if not torch.equal(g, joint[n])]
    assert any(n.startswith("layers.") for n in moved), moved


def test_under_dpace_the_selector_ce_is_weighted_by_each_slots_reach(monkeypatch):
    """With objective.slot_weighting dpace the selector's per-slot CE carries the D-PACE
    weights the vocab loss computed (the references weight it by reach), not the uniform
    normaliser the decay weighting would give it."""
    from specforge_dspark.objective import vocab_loss

    fixed = {}

    def reach(conf_XG, mask_XG, alpha):  # a known stand-in for D-PACE's weights
        fixed["w"] = torch.linspace(2.0, 0.5, conf_XG.shape[-1]).expand_as(conf_XG) * mask_XG
        return fixed["w"].to(conf_XG.dtype)

    monkeypatch.setattr(vocab_loss, "dpace_weights", reach)
    seen = []

    def capture(draft, cands, h, prev, coef_XG, *rest, **kw):
        seen.append(coef_XG.clone())
        return selector_term(draft, cands, h, prev, coef_XG, *rest, **kw)

    capture.top_k = selector_term.top_k
    draft, head = draft_and_head()
    ids, mask, aux, last = batch(draft)
    anchors, valid = torch.tensor([[3, 6, 8]]), torch.ones(1, 3, dtype=torch.bool)
    obj = ObjectiveRecipe(num_anchors=3, bce_weight=0.0, chunk_size=8, slot_weighting="dpace")
    compute_loss_at(draft, head, ids, mask, aux, last, anchors, valid, obj, extra=capture)
    coef = seen[0]
    supervised = coef > 0
    uniform = coef[supervised].max() / 2.0  # the normaliser, times the stand-in's 2.0 at slot 0
    want = fixed["w"].view_as(coef).to(coef.dtype) * uniform
    torch.testing.assert_close(coef, want)
    assert coef[supervised].unique().numel() > 1  # not the uniform normaliser


def test_evaluation_checks_the_export_behind_no_selector(monkeypatch, tmp_path):
    """evaluation.acceptance checks the conventions of DIR itself for `no-selector:DIR`
    (the bake-off's DFlash2 with its selector off failed there on the prefixed path)."""
    import specforge_dspark.export.conventions as conventions
    from evaluation.acceptance import evaluate

    checked = []

    def check(path, target_path=None):
        checked.append(str(path))
        raise RuntimeError("checked")

    monkeypatch.setattr(conventions, "check_conventions", check)
    with pytest.raises(RuntimeError, match="checked"):
        evaluate(
            tmp_path / "target", f"no-selector:{tmp_path / 'dflash2'}", ["gsm8k"], 1, 8, tmp_path
        )
    assert checked == [str(tmp_path / "dflash2")]
