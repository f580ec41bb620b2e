"""Padded LM-head rows: the objective must drive them out of the served draft's argmax.

SGLang 0.5.23 takes the DSpark draft's argmax over every LM-head row (`models/dspark.py`
crops the draft's logits only to `lm_head.org_vocab_size`, the padded row count for
Inkling) while the target emits only its logical tokens. A drafter whose Markov head lifts
the padded rows above every logical row (adversarial markov_w2 rows >= L) drafts padded
rows, each of which cuts its block. Training with our objective (draft softmax over all
rows, teacher probability 0 on padded rows) pushes them down until none wins on held-out
inputs; the former objective (draft cropped to the logical rows, computed here
independently) gives those rows exactly zero gradient, so they keep winning.

Shapes: B sequences, S positions, N anchors, G block size, V LM-head rows, L logical rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specforge_dspark.config.recipe import ObjectiveRecipe
from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft, build_visibility_mask
from specforge_dspark.objective.blocks import build_blocks, sample_anchors
from specforge_dspark.objective.frozen_head import FrozenHead, load_frozen_head
from specforge_dspark.objective.loss import compute_loss_at

pytestmark = pytest.mark.usefixtures("one_thread")

B, S, N, G = 2, 24, 8, 4
STEPS, LR = 50, 0.05
TOKENS = 128  # ids drawn from the first TOKENS logical tokens: every Markov row trains
OBJ = ObjectiveRecipe(num_anchors=N)


@pytest.fixture(scope="module")
def head(tiny_target_dir) -> FrozenHead:
    """The tiny Inkling target's head: 1088 rows, 1024 logical tokens, muP 4."""
    head = load_frozen_head(tiny_target_dir)
    assert head.vocab_rows > head.logical_vocab
    return head


def adversarial_draft(head: FrozenHead) -> DSparkDraft:
    """A tiny drafter whose Markov bias puts every padded row far above the logical ones:
    W1[prev] has a constant component 1 and W2's padded rows a large weight on it."""
    torch.manual_seed(0)
    draft = DSparkDraft(
        DSparkConfig(
            hidden_size=head.hidden_size,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=128,
            vocab_size=head.vocab_rows,
            block_size=G,
            target_layer_ids=[0, 2],
            num_target_layers=4,
            mask_token_id=head.logical_vocab,  # a padded row, as Inkling's mask token
            markov_rank=8,
        )
    )
    L = head.logical_vocab
    with torch.no_grad():
        w1 = draft.markov_head.markov_w1.weight
        w2 = draft.markov_head.markov_w2.weight
        w1.normal_(0.0, 0.1)[:, 0] = 1.0
        w2.normal_(0.0, 0.1)[L:, 0] = 5.0 + torch.rand(w2.shape[0] - L)
    return draft


def make_batch(head: FrozenHead, seed: int) -> dict[str, torch.Tensor]:
    """Random logical tokens and target features, supervised after a short prompt."""
    g = torch.Generator().manual_seed(seed)
    H = head.hidden_size
    mask_BS = torch.ones(B, S, dtype=torch.long)
    mask_BS[:, :4] = 0
    return {
        "input_ids_BS": torch.randint(0, TOKENS, (B, S), generator=g),
        "loss_mask_BS": mask_BS,
        "aux_hidden_BSD": torch.randn(B, S, 2 * H, generator=g),
        "last_hidden_BSH": torch.randn(B, S, H, generator=g) * 4.0,
    }


def anchors_of(batch, seed: int):
    return sample_anchors(batch["loss_mask_BS"], N, torch.Generator().manual_seed(seed))


def teacher_forced(draft, head, batch, anchors_BN, valid_BN):
    """(draft logits over ALL rows [B, N, G, V], confidence, blocks), teacher forced."""
    bl = build_blocks(
        batch["input_ids_BS"],
        batch["loss_mask_BS"],
        anchors_BN,
        valid_BN,
        G,
        draft.config.mask_token_id,
        OBJ.gamma,
    )
    ctx_BSH = draft.context(batch["aux_hidden_BSD"])
    visible = build_visibility_mask(anchors_BN, valid_BN, torch.ones(B, S, dtype=torch.bool), G)
    pos_BS = torch.arange(S).expand(B, S)
    h_BNGH = draft(ctx_BSH, pos_BS, head.embed(bl.ids_BNG), bl.pos_BNG, visible)
    logits_BNGV, conf_BNG = draft.apply_heads(h_BNGH, head.logits(h_BNGH), bl.prev_BNG)
    return logits_BNGV, conf_BNG, bl


def cropped_objective_loss(draft, head, batch, anchors_BN, valid_BN) -> torch.Tensor:
    """The former objective, written out: draft AND teacher softmaxes over the logical rows
    only (padded rows never enter the loss), 0.1 CE + 0.9 L1 + 1.0 BCE, slot-weighted."""
    L = head.logical_vocab
    logits_BNGV, conf_BNG, bl = teacher_forced(draft, head, batch, anchors_BN, valid_BN)
    logq_BNGL = torch.log_softmax(logits_BNGV[..., :L].float(), -1)
    with torch.no_grad():
        h_BNGH = batch["last_hidden_BSH"][torch.arange(B)[:, None, None], bl.teacher_idx_BNG]
        p_BNGL = torch.softmax(head.teacher_logits(h_BNGH)[..., :L], -1)
    ce = -logq_BNGL.gather(-1, bl.labels_BNG[..., None]).squeeze(-1)
    l1 = (logq_BNGL.exp() - p_BNGL).abs().sum(-1)
    alpha = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    bce = F.binary_cross_entropy_with_logits(conf_BNG, alpha, reduction="none")
    w = bl.weight_BNG.float()
    terms = OBJ.ce_weight * ce + OBJ.l1_weight * l1 + OBJ.bce_weight * bce
    return (w * terms).sum() / w.sum()


@torch.no_grad()
def padded_argmax_rate(draft, head, batch, anchors) -> float:
    """Supervised slots whose draft argmax over all rows is a padded row / all of them."""
    logits_BNGV, _, bl = teacher_forced(draft, head, batch, *anchors)
    padded_BNG = logits_BNGV.argmax(-1) >= head.logical_vocab
    return float(padded_BNG[bl.eval_mask_BNG].float().mean())


@torch.no_grad()
def padded_proposal_rate(draft, head, batch) -> float:
    """Padded drafts / drafts of the served, sequential proposal (DSparkDraft.propose with
    logits over all rows, as SGLang), one block after each of a few contexts."""
    ctx_1SH = draft.context(batch["aux_hidden_BSD"][:1])
    ids = batch["input_ids_BS"][0]
    drafts = torch.cat(
        [draft.propose(ctx_1SH, n, ids[n], head.embed, head.logits)[0] for n in (6, 12, 18)]
    )
    return float((drafts >= head.logical_vocab).float().mean())


def train(draft, head, loss_fn) -> DSparkDraft:
    opt = torch.optim.Adam(draft.parameters(), lr=LR)
    for step in range(STEPS):
        batch = make_batch(head, seed=100 + step)
        opt.zero_grad(set_to_none=True)
        loss_fn(draft, head, batch, *anchors_of(batch, seed=step)).backward()
        opt.step()
    return draft


def new_objective_loss(draft, head, batch, anchors_BN, valid_BN) -> torch.Tensor:
    return compute_loss_at(
        draft, head, **batch, anchors_BN=anchors_BN, block_valid_BN=valid_BN, obj=OBJ
    ).loss


def test_trap_is_armed_and_only_the_new_objective_reaches_padded_rows(head):
    draft = adversarial_draft(head)
    held_out = make_batch(head, seed=1)
    anchors = anchors_of(held_out, seed=1)
    assert padded_argmax_rate(draft, head, held_out, anchors) == 1.0
    assert padded_proposal_rate(draft, head, held_out) == 1.0

    L, w2 = head.logical_vocab, draft.markov_head.markov_w2.weight
    cropped_objective_loss(draft, head, held_out, *anchors).backward()
    assert (w2.grad[L:] == 0).all() and w2.grad[:L].abs().max() > 0
    draft.zero_grad(set_to_none=True)
    new_objective_loss(draft, head, held_out, *anchors).backward()
    assert w2.grad[L:, 0].min() > 0  # every padded row is pushed down


def test_new_objective_drives_padded_rows_out_of_the_argmax(head):
    held_out = make_batch(head, seed=1)
    anchors = anchors_of(held_out, seed=1)
    new = train(adversarial_draft(head), head, new_objective_loss)
    old = train(adversarial_draft(head), head, cropped_objective_loss)
    assert padded_argmax_rate(new, head, held_out, anchors) == 0.0
    assert padded_proposal_rate(new, head, held_out) == 0.0
    assert padded_argmax_rate(old, head, held_out, anchors) > 0.9
    assert padded_proposal_rate(old, head, held_out) > 0.9
