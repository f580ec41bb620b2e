"""DFlash drafter: masks, loss against a naive reference, chunking, train/serve rows, files."""

from __future__ import annotations

import math

import pytest
import torch

from specforge_dspark.config.recipe import ObjectiveRecipe
from specforge_dspark.drafters.dflash import DFlashConfig, DFlashDraft, build_dflash_masks
from specforge_dspark.objective.frozen_head import FrozenHead
from specforge_dspark.objective.loss import compute_loss_at

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    vocab_size=72,
    block_size=5,
    target_layer_ids=[0, 2],
    num_target_layers=4,
    mask_token_id=65,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=6,
)


def draft_and_head(
    seed: int = 0, kind: tuple = (DFlashConfig, DFlashDraft), **over
) -> tuple[DFlashDraft, FrozenHead]:
    """A random draft of `kind` (config and network classes) and a random head (64
    logical rows, muP 2), in float64."""
    torch.manual_seed(seed)
    config, network = kind
    draft = network(config(**{**TINY, **over})).double()
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    g = torch.Generator().manual_seed(7)
    V, H = draft.config.vocab_size, draft.config.hidden_size
    head = FrozenHead(
        torch.randn(V, H, generator=g).double(), torch.randn(V, H, generator=g).double(), 64, 2.0
    )
    return draft, head


def batch(draft: DFlashDraft, S: int = 16, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    aux = torch.randn(1, S, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g).double()
    last = torch.randn(1, S, cfg.hidden_size, generator=g).double()
    ids = torch.randint(0, 60, (1, S), generator=g)
    mask = torch.ones(1, S, dtype=torch.long)
    mask[0, :3] = 0
    mask[0, 11] = 0  # a hole: blocks stop at their first unsupervised label
    return ids, mask, aux, last


def test_sliding_mask_is_causal_inside_the_block_and_windowed():
    anchors, valid = torch.tensor([[3, 7]]), torch.tensor([[True, True]])
    G, W, S = 4, 5, 10
    masks = build_dflash_masks(anchors, valid, torch.ones(1, S, dtype=torch.bool), G, W)
    full, sliding = masks["full_attention"][0], masks["sliding_attention"][0]
    for j, a in enumerate(anchors[0].tolist()):
        for k in range(G):
            q, pos_q = j * G + k, a + k
            for c in range(S):  # context keys: before the anchor, inside the window
                assert bool(full[q, c]) == (c < a)
                assert bool(sliding[q, c]) == (c < a and c > pos_q - W)
            for jj in range(2):
                for i in range(G):
                    key = S + jj * G + i
                    assert bool(full[q, key]) == (jj == j)
                    assert bool(sliding[q, key]) == (jj == j and i <= k)


def naive_loss(draft, head, ids, mask, aux, last, anchors, obj):
    """Block by block through `propose`'s own forward: rows 1..G-1 of the block at a
    predict x[a+1..a+G-1], teacher lm_head(last[a+k]) over the logical rows. Slot weights
    exp(-k / gamma) over their sum, or D-PACE's over the supervised slot count (looped
    products of the smoothed confidences); the divergence L1 or -log sum(min(p, q))."""
    G, S = draft.config.block_size, ids.shape[1]
    ctx = draft.context(aux)
    total, weight = 0.0, 0.0
    for a in anchors:
        block = torch.full((G,), draft.config.mask_token_id)
        block[0] = ids[0, a]
        masks = draft.masks(
            torch.tensor([[a]]),
            torch.ones(1, 1, dtype=torch.bool),
            torch.ones(1, S, dtype=torch.bool),
        )
        h = draft(
            ctx,
            torch.arange(S)[None],
            head.embed(block)[None, None],
            (a + torch.arange(G))[None, None],
            masks,
        )[0, 0, 1:]
        q = torch.softmax(head.logits(h), -1)
        teacher_idx = (a + torch.arange(G - 1)).clamp(max=S - 1)
        p = torch.softmax(head.teacher_logits(last[0, teacher_idx])[:, :64], -1)
        p = torch.cat([p, p.new_zeros(G - 1, q.shape[-1] - 64)], -1)
        slots = []  # (ce, divergence) of the block's supervised prefix
        for k in range(G - 1):
            t = a + k + 1
            if t >= S or not mask[0, t]:
                break
            ce = -torch.log(q[k, ids[0, t]])
            if obj.divergence == "lk":
                div = -torch.log(torch.minimum(q[k], p[k]).sum())
            else:
                div = (q[k] - p[k]).abs().sum()
            slots.append((ce, div))
        conf = [
            (1 - obj.dpace_alpha) * math.exp(-float(ce.detach())) + obj.dpace_alpha
            for ce, _ in slots
        ]
        for k, (ce, div) in enumerate(slots):
            if obj.slot_weighting == "dpace":
                w = sum(math.prod(conf[: t + 1]) for t in range(k, len(slots)))
                weight += 1.0
            else:
                w = math.exp(-k / obj.gamma)
                weight += w
            total = total + w * (obj.ce_weight * ce + obj.l1_weight * div)
    return total / weight


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"slot_weighting": "dpace"},
        {"divergence": "lk"},
        {"slot_weighting": "dpace", "dpace_alpha": 0.2, "divergence": "lk"},
    ],
)
def test_loss_equals_the_naive_reference_and_chunking_changes_nothing(options):
    """The default objective, D-PACE weights and the LK divergence: loss and gradients as
    the per-block loop reference's; chunking changes nothing."""
    draft, head = draft_and_head()
    ids, mask, aux, last = batch(draft)
    anchors = [3, 6, 9, 13]
    anchors_BN, valid = torch.tensor([anchors]), torch.ones(1, 4, dtype=torch.bool)
    obj = ObjectiveRecipe(num_anchors=4, bce_weight=0.0, chunk_size=0, **options)
    ref = naive_loss(draft, head, ids, mask, aux, last, anchors, obj)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in draft.named_parameters()}
    draft.zero_grad()
    out = compute_loss_at(draft, head, ids, mask, aux, last, anchors_BN, valid, obj)
    torch.testing.assert_close(out.loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.metrics["loss"], ref.detach(), rtol=1e-10, atol=1e-12)
    assert out.metrics["alpha"].shape == (draft.config.block_size - 1,)

    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters()}
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-8, atol=1e-11, msg=n)
    draft.zero_grad()
    chunked = ObjectiveRecipe(**{**obj.__dict__, "chunk_size": 1})
    out1 = compute_loss_at(draft, head, ids, mask, aux, last, anchors_BN, valid, chunked)
    out1.loss.backward()
    torch.testing.assert_close(out1.loss, out.loss, rtol=1e-12, atol=0)
    for n, p in draft.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-9, atol=1e-12)


def test_training_rows_are_the_rows_propose_drafts_from():
    draft, head = draft_and_head()
    ids, mask, aux, last = batch(draft)
    G = draft.config.block_size
    anchors = torch.tensor([[4, 8]])
    ctx = draft.context(aux)
    S = ids.shape[1]
    block = torch.full((1, 2, G), draft.config.mask_token_id)
    block[..., 0] = ids[0, anchors[0]]
    pos = anchors[..., None] + torch.arange(G)
    masks = draft.masks(
        anchors, torch.ones(1, 2, dtype=torch.bool), torch.ones(1, S, dtype=torch.bool)
    )
    h = draft(ctx, torch.arange(S)[None], head.embed(block), pos, masks)
    for j, a in enumerate(anchors[0].tolist()):
        drafts, conf = draft.propose(ctx, a, ids[0, a], head.embed, head.logits)
        assert conf is None and drafts.shape == (G - 1,)
        assert torch.equal(drafts, head.logits(h[0, j, 1:]).argmax(-1))


def test_sliding_layers_see_only_their_window():
    draft, head = draft_and_head(layer_types=["sliding_attention"] * 2, sliding_window=5)
    ids, _, aux, _ = batch(draft)
    a, G, W = 12, 5, 5
    ctx = draft.context(aux)
    base, _ = draft.propose(ctx, a, ids[0, a], head.embed, head.logits)
    # the lowest query position is a, so context below a - W + 1 is out of every window;
    # a two-layer stack reaches no further back (keys are context, not earlier queries)
    far = ctx.clone()
    far[:, : a - W + 1] += 5.0
    assert torch.equal(draft.propose(far, a, ids[0, a], head.embed, head.logits)[0], base)

    def rows(c):
        one = torch.ones(1, 1, dtype=torch.bool)
        masks = draft.masks(torch.tensor([[a]]), one, torch.ones(1, a, dtype=torch.bool))
        block = head.embed(torch.full((1, 1, G), draft.config.mask_token_id))
        return draft(
            c[:, :a], torch.arange(a)[None], block, (a + torch.arange(G))[None, None], masks
        )

    near = ctx.clone()
    near[:, a - 1] += 5.0
    h_far, h_near = rows(far), rows(near)
    torch.testing.assert_close(h_far, rows(ctx), rtol=0, atol=0)
    assert not torch.allclose(h_far, h_near)


def test_save_and_load_round_trip(tmp_path):
    draft, _ = draft_and_head()
    draft.float().save_pretrained(tmp_path / "d", dtype=torch.float32)
    again = DFlashDraft.from_pretrained(tmp_path / "d")
    assert again.config == draft.config
    for k, v in draft.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_config_refuses_what_it_does_not_model():
    with pytest.raises(ValueError, match="sliding_window"):
        DFlashConfig(**{**TINY, "sliding_window": 3})
    raw = DFlashConfig(**TINY).to_dict()
    with pytest.raises(ValueError, match="conv_kernel_size"):
        DFlashConfig.from_dict(
            {**raw, "dflash_config": {**raw["dflash_config"], "conv_kernel_size": 4}}
        )
