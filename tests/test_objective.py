"""The training objective against an independent float64 loop reference (DSPARK_SPEC.md s.3).

Shapes: B sequences, S positions, N anchor columns, G block size, V LM-head rows,
L logical vocabulary (rows >= L are padding the target never emits).

Vocabulary semantics (as SGLang serves): the draft's softmax, CE, L1 and argmax run over
all V rows; the teacher is a softmax over the first L rows, probability 0 on the others.
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from specforge_dspark.config.recipe import ObjectiveRecipe
from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft
from specforge_dspark.objective.blocks import build_blocks, sample_anchors
from specforge_dspark.objective.frozen_head import FrozenHead
from specforge_dspark.objective.loss import compute_loss, compute_loss_at

pytestmark = pytest.mark.usefixtures("one_thread")

V, L, H, G, S, N = 53, 48, 32, 4, 24, 6
MASK = 50  # a padded row: fine for the embedding, never for the logits
MUP = 2.0
OBJ = ObjectiveRecipe(num_anchors=N, ce_weight=0.3, l1_weight=0.9, bce_weight=0.7, gamma=3.0)


def make_models(seed: int = 0, **cfg) -> tuple[DSparkDraft, FrozenHead]:
    """A tiny drafter with every parameter random (markov_w2 starts at 0 otherwise)."""
    torch.manual_seed(seed)
    config = DSparkConfig(
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=V,
        block_size=G,
        target_layer_ids=[0, 1, 2],
        num_target_layers=4,
        mask_token_id=MASK,
        markov_rank=8,
        **cfg,
    )
    draft = DSparkDraft(config)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
            if p.dim() == 2:
                p.div_(math.sqrt(p.shape[1]))
    head = FrozenHead(torch.randn(V, H), torch.randn(V, H) * 2.0, L, MUP)
    return draft, head


def make_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    """Sequences: short answer then right padding, a hole and the sequence end, no eligible
    anchor at all, fully supervised."""
    g = torch.Generator().manual_seed(seed)
    ids_BS = torch.randint(0, L, (4, S), generator=g)
    mask_BS = torch.zeros(4, S, dtype=torch.long)
    mask_BS[0, 5:9] = 1  # 3 eligible anchors -> 3 invalid columns
    ids_BS[0, 12:] = 0  # right padding
    mask_BS[1, 3:] = 1
    mask_BS[1, 12] = 0  # blocks cut by an unsupervised label; others by the end
    mask_BS[2, [2, 6, 9]] = 1  # isolated: no eligible anchor
    mask_BS[3, :] = 1
    return {
        "input_ids_BS": ids_BS,
        "loss_mask_BS": mask_BS,
        "aux_hidden_BSD": torch.randn(4, S, 3 * H, generator=g),
        "last_hidden_BSH": torch.randn(4, S, H, generator=g),
    }


def anchors_for(batch, seed: int = 2, n: int = N):
    return sample_anchors(batch["loss_mask_BS"], n, torch.Generator().manual_seed(seed))


def to64(draft, head, batch):
    d64 = copy.deepcopy(draft).double()
    h64 = FrozenHead(
        head.embed_weight.double(), head.lm_head_weight.double(), L, MUP, head.logit_softcap
    )
    b64 = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    return d64, h64, b64


def to16(draft, head, batch):
    d16 = copy.deepcopy(draft).bfloat16()
    h16 = FrozenHead(head.embed_weight.bfloat16(), head.lm_head_weight.bfloat16(), L, MUP)
    b16 = {k: v.bfloat16() if v.is_floating_point() else v for k, v in batch.items()}
    return d16, h16, b16


def run(draft, head, batch, anchors, obj=OBJ):
    """(loss, metrics, grads by name) of one compute_loss_at + backward."""
    draft.zero_grad(set_to_none=True)
    out = compute_loss_at(
        draft, head, **batch, anchors_BN=anchors[0], block_valid_BN=anchors[1], obj=obj
    )
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters()}
    return out.loss.detach(), out.metrics, grads


# --------------------------------------------------------------------------- reference


def teacher_logits(head, h_H):
    """lm_head(h / mup), softcapped when the head has a cap."""
    z = head.lm_head_weight @ (h_H / MUP)
    cap = head.logit_softcap
    return z if cap is None else cap * torch.tanh(z / cap)


def reference(draft, head, batch, anchors_BN, valid_BN, obj=OBJ):
    """Explicit loops over sequences, anchors and slots; float64; autograd for gradients.
    The trained loss follows obj.slot_weighting and obj.divergence; the ce/l1/bce metrics
    are the decay-weighted means whatever they are."""
    ids, lm = batch["input_ids_BS"], batch["loss_mask_BS"]
    aux, last = batch["aux_hidden_BSD"], batch["last_hidden_BSH"]
    B = ids.shape[0]
    num = {"ce": 0.0, "l1": 0.0, "bce": 0.0}
    wsum = 0.0
    objective, slot_count = 0.0, 0
    per_k = {m: [[] for _ in range(G)] for m in ("alpha", "top1", "ce_k", "conf_err")}
    block_accepts = []  # per valid block: greedy accept count over its supervised slots
    block_expected = []  # per valid block: sum_k prod_{i<=k} alpha_i over its supervised slots
    ctx_BSH = draft.context(aux)
    for b in range(B):
        for j in range(anchors_BN.shape[1]):
            if not valid_BN[b, j]:
                continue
            a = int(anchors_BN[b, j])
            assert lm[b, a] and lm[b, a + 1]
            block_ids = torch.tensor([ids[b, a]] + [MASK] * (G - 1))
            visible = torch.zeros(1, G, S + G, dtype=torch.bool)
            visible[0, :, :a] = True  # context strictly before the anchor
            visible[0, :, S:] = True  # the whole block, bidirectional
            h_GH = draft(
                ctx_BSH[b : b + 1],
                torch.arange(S)[None],
                head.embed(block_ids)[None, None],
                (a + torch.arange(G))[None, None],
                visible,
            )[0, 0]
            ys = [ids[b, a + k + 1] if a + k + 1 < S else None for k in range(G)]
            prev = torch.tensor([ids[b, a]] + [y if y is not None else 0 for y in ys[:-1]])
            logits_GV, conf_G = draft.apply_heads(
                h_GH[None, None], head.logits(h_GH)[None, None], prev[None, None]
            )
            accepting, n_accepted, survive, n_expected = True, 0, 1.0, 0.0
            block = []  # per supervised slot: (ce, trained divergence, bce)
            for k in range(G):
                t = a + k + 1
                if t >= S or not lm[b, t]:
                    break  # the block stops at its first unsupervised label
                q = torch.softmax(logits_GV[0, 0, k], -1)  # over all V rows
                with torch.no_grad():
                    p = torch.zeros(V, dtype=q.dtype)  # 0 on the padded rows
                    p[:L] = torch.softmax(teacher_logits(head, last[b, a + k])[:L], -1)
                ce = -torch.log(q[ids[b, t]])
                l1 = (q - p).abs().sum()
                alpha = torch.minimum(p, q.detach()).sum()
                div = l1 if obj.divergence == "l1" else -torch.log(torch.minimum(p, q).sum())
                if conf_G is None:
                    bce, err = 0.0, math.nan
                else:
                    c = conf_G[0, 0, k]
                    bce = -(alpha * F.logsigmoid(c) + (1 - alpha) * F.logsigmoid(-c))
                    err = abs(float(torch.sigmoid(c.detach())) - float(alpha))
                w = math.exp(-k / obj.gamma)
                num["ce"] = num["ce"] + w * ce
                num["l1"] = num["l1"] + w * l1
                num["bce"] = num["bce"] + w * bce
                wsum += w
                block.append((ce, div, bce))
                per_k["alpha"][k].append(float(alpha))
                top1 = bool(q.argmax() == p.argmax())
                per_k["top1"][k].append(float(top1))
                accepting = accepting and top1
                n_accepted += accepting
                survive *= float(alpha)  # every slot up to k accepted
                n_expected += survive
                per_k["ce_k"][k].append(float(ce.detach()))
                per_k["conf_err"][k].append(err)
            block_accepts.append(n_accepted)
            block_expected.append(n_expected)
            for k, (ce, div, bce) in enumerate(block):
                if obj.slot_weighting == "dpace":  # d(sum_t prod_{j<=t} c_j) / d(log c_k)
                    c = [
                        (1 - obj.dpace_alpha) * math.exp(-float(x[0].detach())) + obj.dpace_alpha
                        for x in block
                    ]
                    w = sum(math.prod(c[: t + 1]) for t in range(k, len(block)))
                else:
                    w = math.exp(-k / obj.gamma)
                term = obj.ce_weight * ce + obj.l1_weight * div + obj.bce_weight * bce
                objective = objective + w * term
                slot_count += 1
    terms = {k: torch.as_tensor(v / wsum, dtype=torch.float64) for k, v in num.items()}
    loss = torch.as_tensor(objective / (slot_count if obj.slot_weighting == "dpace" else wsum))
    draft.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters()}
    means = {
        m: torch.tensor([sum(v) / len(v) if v else math.nan for v in per_k[m]], dtype=torch.float64)
        for m in per_k
    }
    tau = 1.0 + sum(block_accepts) / len(block_accepts) if block_accepts else math.nan
    tau_expected = 1.0 + sum(block_expected) / len(block_expected) if block_expected else math.nan
    metrics = {
        "loss": float(loss.detach()),
        **{k: float(v.detach()) for k, v in terms.items()},
        **means,
        "tau": float(tau),
        "tau_expected": float(tau_expected),
        "weight_sum": wsum,
        "valid_blocks": float(valid_BN.sum()),
        "supervised_slots": float(sum(len(v) for v in per_k["alpha"])),
        "sequences_skipped": float((~valid_BN.any(1)).sum()),
    }
    return metrics, grads


def assert_close_metrics(got, want, rtol):
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(
            got[name].double(),
            torch.as_tensor(w, dtype=torch.float64),
            rtol=rtol,
            atol=rtol,
            equal_nan=True,
            msg=name,
        )


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("chunk", [0, 4])
def test_matches_loop_reference_float64(chunk):
    draft, head = make_models()
    draft, head, batch = to64(draft, head, make_batch())
    anchors = anchors_for(batch)
    assert anchors[1].sum(1).tolist() == [3, N, 0, N]  # invalid columns, one skipped sequence
    obj = ObjectiveRecipe(**{**OBJ.__dict__, "chunk_size": chunk})
    loss, metrics, grads = run(draft, head, batch, anchors, obj)
    ref_metrics, ref_grads = reference(draft, head, batch, *anchors, obj)
    assert_close_metrics(metrics, ref_metrics, rtol=1e-9)
    assert float(loss) == pytest.approx(ref_metrics["loss"], rel=1e-12)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert g.abs().max() > 0, name  # every parameter is exercised
        torch.testing.assert_close(grads[name], g, rtol=1e-9, atol=1e-11, msg=name)


def test_float32_matches_float64_reference():
    draft, head = make_models()
    batch = make_batch()
    anchors = anchors_for(batch)
    loss, metrics, grads = run(draft, head, batch, anchors)
    ref_metrics, ref_grads = reference(*to64(draft, head, batch), *anchors)
    assert float(loss) == pytest.approx(ref_metrics["loss"], rel=1e-5)
    assert_close_metrics(metrics, ref_metrics, rtol=1e-4)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name].double(), g, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "options",
    [
        {"slot_weighting": "dpace"},
        {"divergence": "lk"},
        {"slot_weighting": "dpace", "dpace_alpha": 0.0, "divergence": "lk"},
    ],
)
def test_accept_length_objectives_match_reference_float64(options):
    """D-PACE weights and the LK divergence with a confidence head and chunks: the trained
    loss, its gradients and the metrics (ce/l1/bce decay-weighted, loss the objective) as
    the loop reference's."""
    draft, head = make_models()
    draft, head, batch = to64(draft, head, make_batch())
    anchors = anchors_for(batch)
    obj = ObjectiveRecipe(**{**OBJ.__dict__, "chunk_size": 4, **options})
    loss, metrics, grads = run(draft, head, batch, anchors, obj)
    ref_metrics, ref_grads = reference(draft, head, batch, *anchors, obj)
    assert_close_metrics(metrics, ref_metrics, rtol=1e-9)
    assert float(loss) == pytest.approx(ref_metrics["loss"], rel=1e-12)
    default_loss = run(draft, head, batch, anchors)[0]
    assert abs(float(loss) - float(default_loss)) > 1e-3  # the option changes what trains
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("markov", ["gated", "rnn"])
def test_other_heads_and_no_confidence_match_reference(markov):
    draft, head = make_models(markov_head_type=markov, enable_confidence_head=False)
    draft, head, batch = to64(draft, head, make_batch())
    anchors = anchors_for(batch)
    loss, metrics, grads = run(draft, head, batch, anchors)
    no_bce = ObjectiveRecipe(**{**OBJ.__dict__, "bce_weight": 0.0})
    ref_metrics, ref_grads = reference(draft, head, batch, *anchors, no_bce)
    assert float(metrics["bce"]) == 0.0 and torch.isnan(metrics["conf_err"]).all()
    assert float(loss) == pytest.approx(ref_metrics["loss"], rel=1e-12)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-9, atol=1e-11, msg=name)


def test_chunked_equals_unchunked():
    draft, head = make_models()
    draft, head, batch = to64(draft, head, make_batch())
    anchors = anchors_for(batch, n=7)
    results = {}
    for chunk in (0, 1, 3, 4, 7, 50):  # 3 and 4 do not divide N = 7
        obj = ObjectiveRecipe(**{**OBJ.__dict__, "num_anchors": 7, "chunk_size": chunk})
        results[chunk] = run(draft, head, batch, anchors, obj)
    loss0, metrics0, grads0 = results.pop(0)
    for chunk, (loss, metrics, grads) in results.items():
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=0, msg=f"chunk {chunk}")
        assert_close_metrics(metrics, metrics0, rtol=1e-12)
        for name, g in grads0.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-13, msg=name)


def test_slot_k_supervised_by_token_a_plus_k_plus_1():
    """One anchor a on distinct tokens: slot k's CE is -log q_k(x[a+k+1]), its teacher is
    last_hidden[a+k], its Markov prev is x[a+k]; the neighbouring conventions differ."""
    draft, head = make_models()
    draft, head, batch = to64(draft, head, make_batch())
    ids = torch.randperm(L, generator=torch.Generator().manual_seed(3))[:S][None]
    mask = torch.ones(1, S, dtype=torch.long)
    last = batch["last_hidden_BSH"][:1]
    a = 9
    bl = build_blocks(ids, mask, torch.tensor([[a]]), torch.tensor([[True]]), G, MASK, 4.0)
    assert bl.labels_BNG[0, 0].tolist() == ids[0, a + 1 : a + 1 + G].tolist()
    assert bl.prev_BNG[0, 0].tolist() == ids[0, a : a + G].tolist()
    assert bl.ids_BNG[0, 0].tolist() == [ids[0, a].item()] + [MASK] * (G - 1)
    assert bl.pos_BNG[0, 0].tolist() == list(range(a, a + G))
    assert bl.teacher_idx_BNG[0, 0].tolist() == list(range(a, a + G))

    out = compute_loss_at(
        draft,
        head,
        ids,
        mask,
        batch["aux_hidden_BSD"][:1],
        last,
        torch.tensor([[a]]),
        torch.tensor([[True]]),
        OBJ,
    )
    visible = torch.zeros(1, G, S + G, dtype=torch.bool)
    visible[0, :, :a] = visible[0, :, S:] = True
    with torch.no_grad():
        h = draft(
            draft.context(batch["aux_hidden_BSD"][:1]),
            torch.arange(S)[None],
            head.embed(bl.ids_BNG),
            bl.pos_BNG,
            visible,
        )
        z = draft.apply_heads(h, head.logits(h), bl.prev_BNG)[0][0, 0]
        logq = torch.log_softmax(z, -1)  # all V rows
        p = F.pad(torch.softmax(head.logits(last[0, a : a + G])[:, :L], -1), (0, V - L))
    ce = [-logq[k, ids[0, a + k + 1]] for k in range(G)]
    ce_shifted = [-logq[k, ids[0, a + k]] for k in range(G)]  # DFlash's slot-0-is-bonus
    torch.testing.assert_close(out.metrics["ce_k"], torch.stack(ce), rtol=1e-12, atol=0)
    assert all(abs(x - y) > 1e-6 for x, y in zip(ce, ce_shifted, strict=True))
    alpha = torch.minimum(p, logq.exp()).sum(-1)
    torch.testing.assert_close(out.metrics["alpha"], alpha, rtol=1e-12, atol=0)


def test_padded_rows_count_against_the_draft_and_train():
    """Padded LM-head rows that dominate every draft softmax: the teacher gives them no
    mass, so they cost L1 and CE and lose every top-1 (as served, the draft's argmax sees
    them); metrics match the all-rows reference and the padded Markov rows get gradient."""
    draft, head = make_models()
    draft, head, batch = to64(draft, head, make_batch())
    with torch.no_grad():
        # rows >= L aligned with every hidden state: logits there would be the largest
        head.lm_head_weight[L:] = 50.0 * torch.ones(V - L, H)
        batch["last_hidden_BSH"].abs_()
        draft.norm.weight.abs_()
    anchors = anchors_for(batch)
    hidden = torch.cat([batch["last_hidden_BSH"][0], torch.ones(1, H)])
    assert (head.logits(hidden).argmax(-1) >= L).all()  # the trap is armed
    _, metrics, grads = run(draft, head, batch, anchors)
    ref_metrics, _ = reference(draft, head, batch, *anchors)
    assert_close_metrics(metrics, ref_metrics, rtol=1e-9)
    assert float(metrics["top1"].max()) == 0.0 and float(metrics["tau"]) == 1.0
    assert float(metrics["alpha"].max()) < 0.05  # the draft's mass sits on padded rows
    w2_grad = grads["markov_head.markov_w2.weight"]
    assert (w2_grad[L:].abs().sum(1) > 0).all() and w2_grad[:L].abs().max() > 0


def test_no_grad_evaluation_gives_the_same_metrics():
    draft, head = make_models()
    batch = make_batch()
    anchors = anchors_for(batch)
    _, metrics, _ = run(draft, head, batch, anchors)
    with torch.no_grad():
        out = compute_loss_at(
            draft, head, **batch, anchors_BN=anchors[0], block_valid_BN=anchors[1], obj=OBJ
        )
    assert out.loss.grad_fn is None
    assert_close_metrics(out.metrics, metrics, rtol=1e-6)
    logged = out.log_dict()
    assert logged["tau"] == pytest.approx(float(metrics["tau"]), rel=1e-6)
    assert logged["tau_expected"] == pytest.approx(float(metrics["tau_expected"]), rel=1e-6)
    assert [logged[f"alpha/{k}"] for k in range(G)] == pytest.approx(metrics["alpha"].tolist())
    assert all(isinstance(v, float) for v in logged.values())


def test_tau_averages_per_block_accept_lengths(monkeypatch):
    """Uneven blocks (4, 2 and 3 supervised slots) with scripted greedy matches and
    acceptance probabilities: tau is the mean over blocks of 1 + (leading matches among the
    block's supervised slots), tau_expected the mean of 1 + sum_k prod_{i<=k} alpha_i over
    the same slots; the retired per-slot-mean value differs."""
    from specforge_dspark.objective import metrics, vocab_loss

    ids = torch.arange(10)[None] % L
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[0, 5] = 0
    anchors, valid = torch.tensor([[0, 2, 6]]), torch.ones(1, 3, dtype=torch.bool)
    # per block, slot: 1 = the draft's argmax is the teacher's (slots past a block's
    # supervised prefix are scripted 1 to show they do not count)
    match_XG = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.float32)
    # acceptance probabilities per block, slot (past the supervised prefix: do not count)
    alpha_XG = torch.tensor([[0.5, 0.8, 0.1, 0.9], [0.2, 0.5, 1.0, 1.0], [1.0, 0.5, 0.5, 0.7]])
    eval_mask = build_blocks(ids, mask, anchors, valid, G, MASK, 4.0).eval_mask_BNG[0]
    assert eval_mask.sum(-1).tolist() == [4, 2, 3]
    assert metrics.accepted_drafts(match_XG, eval_mask).tolist() == [2, 0, 3]
    expected = [0.5 + 0.5 * 0.8 + 0.5 * 0.8 * 0.1 + 0.5 * 0.8 * 0.1 * 0.9, 0.2 + 0.2 * 0.5, 1.75]
    got = metrics.expected_accepts(alpha_XG, eval_mask).tolist()
    assert got == pytest.approx(expected)
    real = vocab_loss.vocab_chunk

    def scripted(plan, sl, *rest):
        stats, grads = real(plan, sl, *rest)
        stats[2], stats[5] = alpha_XG[sl], match_XG[sl]  # alpha and top1
        return stats, grads

    monkeypatch.setattr(vocab_loss, "vocab_chunk", scripted)
    draft, head = make_models()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        out = compute_loss_at(
            draft,
            head,
            ids,
            mask,
            torch.randn(1, 10, 3 * H, generator=g),
            torch.randn(1, 10, H, generator=g),
            anchors,
            valid,
            OBJ,
        )
    m = out.metrics
    assert float(m["tau"]) == pytest.approx(1 + (2 + 0 + 3) / 3)
    # slot means over supervised blocks: 2/3, 3/3, 1/2, 1/1
    assert m["top1"].tolist() == pytest.approx([2 / 3, 1.0, 0.5, 1.0])
    assert float(m["tau_expected"]) == pytest.approx(1 + sum(expected) / 3)
    # the retired value, a product of per-slot MEAN alphas, is not the mean of products
    means = [(0.5 + 0.2 + 1.0) / 3, (0.8 + 0.5 + 0.5) / 3, (0.1 + 0.5) / 2, 0.9]
    slot_mean = 1 + torch.tensor(means).cumprod(0).sum().item()
    assert abs(float(m["tau_expected"]) - slot_mean) > 0.05


def test_no_valid_block_gives_zero_loss_and_zero_grads_everywhere():
    """A micro-batch (or rank) without any eligible anchor still takes part in backward:
    every parameter gets a gradient of exactly zero."""
    draft, head = make_models()
    batch = {k: v[2:3] for k, v in make_batch().items()}
    out = compute_loss(draft, head, **batch, obj=OBJ, generator=torch.Generator())
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and float(out.metrics["sequences_skipped"]) == 1.0
    assert float(out.metrics["valid_blocks"]) == 0.0
    for name, p in draft.named_parameters():
        assert p.grad is not None and (p.grad == 0).all(), name


def test_gradient_accumulation_weights_micro_steps_equally():
    """Documented semantics: each micro-step is its own pooled mean; the window gradient is
    the mean of the micro-steps' gradients ((loss / accum).backward() per micro-step)."""
    draft, head = make_models()
    draft, head, batch = to64(draft, head, make_batch())
    steps = [{k: v[i : i + 1] for k, v in batch.items()} for i in (0, 3)]  # 3 vs 6 blocks
    anchors = [anchors_for(s) for s in steps]
    refs = [reference(draft, head, s, *a)[1] for s, a in zip(steps, anchors, strict=True)]
    draft.zero_grad(set_to_none=True)
    for s, a in zip(steps, anchors, strict=True):
        out = compute_loss_at(draft, head, **s, anchors_BN=a[0], block_valid_BN=a[1], obj=OBJ)
        (out.loss / len(steps)).backward()
    for name, p in draft.named_parameters():
        torch.testing.assert_close(
            p.grad, (refs[0][name] + refs[1][name]) / 2, rtol=1e-9, atol=1e-12, msg=name
        )


def test_one_backward_fires_each_parameter_hook_once_and_saves_nothing_vocab_sized():
    """DeepSpeed/DDP reduce gradients from post-accumulate hooks: exactly one per parameter
    per backward. Nothing [.., V] (or [.., L]) is saved for backward."""
    draft, head = make_models()
    batch = make_batch()
    anchors = anchors_for(batch)
    fired = {n: 0 for n, _ in draft.named_parameters()}
    for n, p in draft.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: fired.__setitem__(n, fired[n] + 1))
    weights = {t.untyped_storage().data_ptr() for t in [*draft.parameters(), *head.buffers()]}
    saved_shapes = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:  # views of weights cost nothing
            saved_shapes.append(tuple(t.shape))
        return t

    # decoder chunks checkpointed: its saved masks [.., S + Q] would read as L-sized here
    obj = ObjectiveRecipe(**{**OBJ.__dict__, "chunk_size": 2, "decode_chunk_size": 2})
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compute_loss_at(
            draft, head, **batch, anchors_BN=anchors[0], block_valid_BN=anchors[1], obj=obj
        )
    out.loss.backward()
    assert set(fired.values()) == {1}
    # logits, softmaxes and their gradients would end in V or L
    assert saved_shapes and all(s[-1:] not in ((V,), (L,)) for s in saved_shapes)


# --------------------------------------------------------------------------- anchors


def test_sampler_takes_only_eligible_positions_without_duplicates():
    mask = torch.tensor(
        [
            [0, 1, 1, 1, 0, 1, 1, 0, 1, 0, 1, 1],
            [0, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
        ]
    )
    eligible = [{1, 2, 5, 10}, set(), set(range(11))]
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 4, 11, 20):
        for _ in range(20):
            anchors, valid = sample_anchors(mask, n, g)
            assert anchors.shape == valid.shape == (3, n)
            for b in range(3):
                picked = anchors[b][valid[b]].tolist()
                assert len(picked) == len(set(picked)) == min(n, len(eligible[b]))
                assert set(picked) <= eligible[b]
                assert valid[b].tolist() == sorted(valid[b].tolist(), reverse=True)


def test_sampler_is_uniform_over_subsets():
    """Chi-square over the 10 possible 3-subsets of 5 eligible positions: each must be
    equally likely (a sampler biased towards early or late positions fails)."""
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 0]]).expand(30000, -1)  # eligible 1,2,5,6,7
    eligible = [1, 2, 5, 6, 7]
    anchors, valid = sample_anchors(mask, 3, torch.Generator().manual_seed(123))
    assert valid.all()
    subsets = torch.sort(anchors, 1).values
    codes = (subsets * torch.tensor([100, 10, 1])).sum(1)
    counts = torch.bincount(codes, minlength=1000).double()
    cells = [a * 100 + b * 10 + c for a, b, c in itertools.combinations(eligible, 3)]
    observed = counts[cells]
    assert observed.sum() == 30000
    expected = 30000 / len(cells)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 27.88  # chi-square, 9 degrees of freedom, p = 0.001


class _GeneratorDeviceCheck(torch.overrides.TorchFunctionMode):
    """Refuses a random draw on another device than its generator's, as CUDA does for a
    CPU generator ("Expected a 'cuda' device type for generator")."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        gen, device = kwargs.get("generator"), kwargs.get("device")
        if gen is not None and device is not None and torch.device(device) != gen.device:
            raise RuntimeError(f"Expected a '{torch.device(device).type}' device for generator")
        return func(*args, **kwargs)


def test_sampler_draws_on_the_cpu_generator_for_a_batch_on_another_device():
    mask = make_batch()["loss_mask_BS"]
    with _GeneratorDeviceCheck():
        cpu = sample_anchors(mask, N, torch.Generator().manual_seed(4))
        meta = sample_anchors(mask.to("meta"), N, torch.Generator().manual_seed(4))
    assert [t.device.type for t in meta] == ["meta", "meta"]
    assert [(t.shape, t.dtype) for t in meta] == [(t.shape, t.dtype) for t in cpu]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampler_gives_the_same_anchors_on_cuda_as_on_cpu():
    mask = make_batch()["loss_mask_BS"]
    cpu = sample_anchors(mask, N, torch.Generator().manual_seed(4))
    cuda = sample_anchors(mask.cuda(), N, torch.Generator().manual_seed(4))
    assert all(c.is_cuda for c in cuda)
    assert all(torch.equal(a, c.cpu()) for a, c in zip(cpu, cuda, strict=True))


def test_bfloat16_draft_and_head_train_close_to_float32():
    """bf16 weights and features: softmaxes still run in fp32; loss and gradients stay close."""
    draft, head = make_models()
    batch = make_batch()
    anchors = anchors_for(batch)
    loss32, _, grads32 = run(draft, head, batch, anchors)
    loss16, metrics16, grads16 = run(*to16(draft, head, batch), anchors)
    assert loss16.dtype == torch.float32 and metrics16["alpha"].dtype == torch.float64
    assert float(loss16) == pytest.approx(float(loss32), rel=2e-2)
    for name, g in grads32.items():
        assert grads16[name].dtype == torch.bfloat16
        cos = F.cosine_similarity(grads16[name].double().flatten(), g.double().flatten(), dim=0)
        assert cos > 0.98, name


def test_softcapped_teacher_matches_reference():
    draft, head = make_models()
    capped = FrozenHead(head.embed_weight, head.lm_head_weight, L, MUP, logit_softcap=2.0)
    draft, capped, batch = to64(draft, capped, make_batch())
    anchors = anchors_for(batch)
    loss, metrics, grads = run(draft, capped, batch, anchors)
    ref_metrics, ref_grads = reference(draft, capped, batch, *anchors)
    assert_close_metrics(metrics, ref_metrics, rtol=1e-9)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-9, atol=1e-11, msg=name)
    uncapped = run(draft, to64(draft, head, batch)[1], batch, anchors)[1]
    assert abs(float(uncapped["l1"]) - float(metrics["l1"])) > 1e-2  # the cap matters here


def test_bf16_teacher_logits_reach_the_loss_in_float32(monkeypatch):
    """The teacher's softmax sees the target's float32 logits, not bf16-rounded ones."""
    from specforge_dspark.objective import vocab_loss

    seen = []
    real = vocab_loss.slot_terms_

    def spy(logits_ML, conf_M, teacher_logits_ML, *rest):
        seen.append(teacher_logits_ML.clone())
        return real(logits_ML, conf_M, teacher_logits_ML, *rest)

    monkeypatch.setattr(vocab_loss, "slot_terms_", spy)
    draft, head = make_models()
    batch = make_batch()
    run(*to16(draft, head, batch), anchors_for(batch))
    assert seen and all(t.dtype == torch.float32 for t in seen)
    teacher = torch.cat(seen)
    assert (teacher != teacher.bfloat16().float()).float().mean() > 0.9  # not bf16 values


def test_bf16_parameter_gradients_are_summed_over_chunks_in_float32(monkeypatch):
    """One block per chunk (64 chunks): each parameter's gradient is the exact sum of the
    chunks' bf16 gradients rounded once to bf16; a bf16 running sum is off by ~4e-3."""
    from specforge_dspark.objective import vocab_loss

    per_chunk = []
    real = vocab_loss.vocab_chunk

    def spy(*args):
        stats, grads = real(*args)
        per_chunk.append([None if g is None else g.double() for g in grads[1:]])
        return stats, grads

    monkeypatch.setattr(vocab_loss, "vocab_chunk", spy)
    draft, head = make_models()
    d16, h16, b16 = to16(draft, head, make_batch())
    obj = ObjectiveRecipe(**{**OBJ.__dict__, "num_anchors": 16, "chunk_size": 1})
    anchors = sample_anchors(b16["loss_mask_BS"], 16, torch.Generator().manual_seed(2))
    _, _, grads = run(d16, h16, b16, anchors, obj)
    assert len(per_chunk) == 64
    trainable = [n for n, p in d16.named_parameters() if p.requires_grad]
    checked = 0
    for i, name in enumerate(trainable):
        parts = [c[i] for c in per_chunk if c[i] is not None]
        if not parts:
            continue  # not a head parameter: its gradient flows back through h
        exact = torch.stack(parts).sum(0)
        assert grads[name].dtype == torch.bfloat16
        err = float((grads[name].double() - exact.bfloat16().double()).norm() / exact.norm())
        assert err < 2e-4, (name, err)
        checked += 1
    assert checked >= 3  # the Markov and confidence heads


def test_bench_dispatch_reports_a_missing_benchmark(monkeypatch, capsys):
    from specforge_dspark.cli import bench

    calls = []
    fake = types.SimpleNamespace(bench_main=lambda argv: calls.append(argv) or 0)
    monkeypatch.setitem(sys.modules, "fake_bench_module", fake)
    monkeypatch.setattr(
        bench,
        "BENCHES",
        {
            "absent": ("specforge_dspark.no_such_module", "bench_main"),
            "here": ("fake_bench_module", "bench_main"),
        },
    )
    assert bench.main(["absent"]) == 1
    assert "bench absent: not available (specforge_dspark.no_such_module" in capsys.readouterr().out
    assert bench.main(["here", "--x", "1"]) == 0 and calls == [["--x", "1"]]
    assert bench.main(["all"]) == 1 and calls[-1] == []  # runs the others, reports the absent
    assert bench.main(["nonsense"]) == 2


def test_bench_objective_runs_each_block_size_and_reports_the_rss_ratio(monkeypatch, capsys):
    from specforge_dspark.cli.bench import objective as bench_objective

    seen = []

    def fake_run(cmd, capture_output, text):
        get = lambda flag: cmd[cmd.index(flag) + 1]  # noqa: E731
        G, n = int(get("--block-sizes")), int(get("--anchors"))
        seen.append((get("--kind"), G, n))
        line = f"objective kind=x G={G} anchors={n} chunk=32 peak_rss_mb={1000 * G + n}"
        return types.SimpleNamespace(returncode=0, stdout=line + "\n", stderr="")

    monkeypatch.setattr(bench_objective.subprocess, "run", fake_run)
    argv = ["--anchors", "32", "256", "--chunks", "32", "--block-sizes", "7", "16"]
    assert bench_objective.bench_main([*argv, "--kind", "dflash"]) == 0
    assert seen == [("dflash", 7, 32), ("dflash", 7, 256), ("dflash", 16, 32), ("dflash", 16, 256)]
    out = capsys.readouterr().out
    assert "G=16 chunk=32 rss_ratio anchors 256/32 = 1.014" in out  # 16256 / 16032
