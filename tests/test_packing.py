"""Sequence packing (data.pack, training/packing.py): the plan, the packed features, the
objective over a packed row, the data order and resume.

The claim under test: a packed row trains exactly what its conversations alone train.
The target's features are each conversation's own (one request per conversation), and
the draft's loss and gradients over a packed row equal those over the same
conversations as separate rows with the same anchors (context, positions and blocks
never cross a conversation), for DSpark and for DFlash with sliding-window layers.

Shapes: B conversations, S padded length, N anchors, L packed length, D aux width.
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from specforge_dspark.config.recipe import ObjectiveRecipe, recipe_from_dict
from specforge_dspark.engines.hf import HFTarget
from specforge_dspark.engines.tap import read_target_dims
from specforge_dspark.objective.loss import compute_loss_at
from specforge_dspark.training import checkpoint as ck
from specforge_dspark.training.data_order import batches
from specforge_dspark.training.packing import pack_features, pack_index, pack_plan
from specforge_dspark.transport.features import Sample, pad_batch
from tests import faults_tiny as ft
from tests import test_dflash, test_objective

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- the plan


def test_plan_holds_every_row_once_within_capacity_and_is_best_fit():
    rng = random.Random(0)
    lengths = [rng.randint(5, 120) for _ in range(500)]
    plan = pack_plan(lengths, 128)
    assert sorted(r for p in plan for r in p) == list(range(500))
    assert max(sum(lengths[r] for r in p) for p in plan) <= 128
    assert all(p == sorted(p) for p in plan)
    assert pack_plan(lengths, 128) == plan  # a function of the lengths alone
    lower = math.ceil(sum(lengths) / 128)  # no plan has fewer sequences
    assert len(plan) <= 11 / 9 * lower + 1, (len(plan), lower)  # first-fit decreasing bound
    # best fit, by hand: 60 opens A (room 40), 50 opens B (room 50), 40 fills A (the
    # tightest fit, not B), 30 and 20 go to B
    assert pack_plan([60, 50, 40, 30, 20], 100) == [[0, 2], [1, 3, 4]]


def test_plan_refuses_a_row_longer_than_the_sequence():
    with pytest.raises(ValueError, match=r"row 1 has 130 tokens.*max_length=128.*1 such row"):
        pack_plan([10, 130, 20], 128)


def test_each_pack_is_trained_once_per_epoch_its_rows_together():
    """data_order over packs on 2 ranks: each micro-batch lists the rows of one pack in
    order, and the epoch trains every pack once (all but an odd one left over)."""
    rng = random.Random(1)
    rows = [{"sample_id": 100 + i, "input_ids": [1] * n, "loss_mask": [1] * n}
            for i, n in enumerate(rng.randint(5, 60) for _ in range(40))]  # fmt: skip
    plan = pack_plan([len(r["input_ids"]) for r in rows], 64)
    recipe = recipe_from_dict({"train": {"micro_batch_size": 1, "eval_interval": 0}})
    state = ck.TrainState(epoch_samples=0, grad_accum=1)
    seen = []
    for rank in (0, 1):
        it = batches(recipe, rows, None, rank, 2, state, plan)
        seen += [[s.sample_id - 100 for s in next(it)] for _ in range(len(plan) // 2)]
    assert all(ids in plan for ids in seen)
    pack_of = pack_index(plan, [r["sample_id"] for r in rows])
    assert all(pack_of[100 + r] == p for p, rows_of in enumerate(plan) for r in rows_of)
    assert len({tuple(ids) for ids in seen}) == len(seen) == len(plan) // 2 * 2


# --------------------------------------------------------------------------- the features


def _conversation(sample_id: int, n: int, prompt: int, seed: int) -> Sample:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, dtype=torch.long)
    mask[prompt:] = 1  # the prompt unsupervised, the answer supervised
    return Sample(sample_id, torch.randint(10, 1000, (n,), generator=g), mask)


def test_packed_features_are_each_conversations_own(tiny_target_dir):
    """What the trainer packs from the hf engine's answer to a micro-batch (one padded
    request of its conversations) equals, segment by segment, each conversation's
    features alone; one request for the concatenation (what packing at the engine
    without boundaries would send) does not."""
    hidden = read_target_dims(tiny_target_dir, [0, 1, 2]).hidden_size
    target = HFTarget(str(tiny_target_dir), "float32", "cpu", [0, 1, 2], chunk=1)
    convs = [_conversation(7, 23, 6, 0), _conversation(8, 17, 5, 1), _conversation(9, 30, 9, 2)]
    evals = Sample(1 << 40, convs[0].input_ids, convs[0].loss_mask)  # unknown to the plan
    feats = target.forward(pad_batch([*convs, evals]), hidden)
    packed = pack_features(feats, {7: 0, 8: 0, 9: 1})

    assert packed.sample_ids == [7, 8, 9, 1 << 40]
    assert packed.lengths.tolist() == [40, 30, 23]
    assert packed.input_ids.shape == (3, 40)
    segments = [(0, 0, convs[0]), (0, 23, convs[1]), (1, 0, convs[2]), (2, 0, convs[0])]
    for row, start, conv in segments:
        alone = target.forward(pad_batch([conv]), hidden)
        n, seg = len(conv.input_ids), slice(start, start + len(conv.input_ids))
        torch.testing.assert_close(packed.aux_hidden[row, seg], alone.aux_hidden[0], rtol=0, atol=0)
        torch.testing.assert_close(
            packed.last_hidden[row, seg], alone.last_hidden[0], rtol=0, atol=0
        )
        assert torch.equal(packed.input_ids[row, seg], conv.input_ids)
        assert packed.position_ids[row, seg].tolist() == list(range(n))
        want_mask = conv.loss_mask.clone()
        want_mask[0] = 0  # a conversation's first token is never a label in a pack
        assert torch.equal(packed.loss_mask[row, seg], want_mask)
    assert not packed.loss_mask[1:, 30:].any() and not packed.aux_hidden[1, 30:].any()

    joined = Sample(0, torch.cat([convs[0].input_ids, convs[1].input_ids]), torch.ones(40))
    across = target.forward(pad_batch([joined]), hidden)  # attention crosses the boundary
    assert (across.aux_hidden[0, 23:] - packed.aux_hidden[0, 23:]).abs().max() > 1e-2


# --------------------------------------------------------------------------- the objective

LENGTHS, PROMPTS = (13, 9, 11), (3, 2, 4)
ANCHORS = ((3, 5, 8, 10), (2, 4, 6), (4, 7, 9))  # eligible: supervised anchor and next token


def _models(kind: str):
    if kind == "dspark":
        draft, head = test_objective.make_models()
        return draft.double(), head.double(), ObjectiveRecipe(num_anchors=4, gamma=3.0)
    draft, head = test_dflash.draft_and_head()  # sliding window 6 on layer 0
    return draft, head, ObjectiveRecipe(num_anchors=4)


def _rows(draft, seed: int = 5):
    """The three conversations' tokens, masks and random features, each alone."""
    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    D, H = len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size
    out = []
    for n, p in zip(LENGTHS, PROMPTS, strict=True):
        mask = torch.zeros(n, dtype=torch.long)
        mask[p:] = 1
        ids = torch.randint(10, 48, (n,), generator=g)  # logical tokens of both heads
        out.append((ids, mask, torch.randn(n, D, generator=g).double(),
                    torch.randn(n, H, generator=g).double()))  # fmt: skip
    return out


def _loss(draft, head, obj, ids, mask, aux, last, anchors, valid, pos=None):
    draft.zero_grad()
    out = compute_loss_at(
        draft, head, ids, mask, aux, last, anchors, valid, obj, position_ids_BS=pos
    )
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_packed_row_trains_what_its_conversations_train_alone(kind):
    draft, head, obj = _models(kind)
    rows = _rows(draft)
    # alone: one right-padded row per conversation
    S, N = max(LENGTHS), max(map(len, ANCHORS))
    ids, mask = torch.zeros(3, S, dtype=torch.long), torch.zeros(3, S, dtype=torch.long)
    aux, last = torch.zeros(3, S, rows[0][2].shape[1]), torch.zeros(3, S, rows[0][3].shape[1])
    aux, last = aux.double(), last.double()
    anchors, valid = torch.zeros(3, N, dtype=torch.long), torch.zeros(3, N, dtype=torch.bool)
    for b, ((x, m, a, h), anc) in enumerate(zip(rows, ANCHORS, strict=True)):
        ids[b, : len(x)], mask[b, : len(x)], aux[b, : len(x)], last[b, : len(x)] = x, m, a, h
        anchors[b, : len(anc)], valid[b, : len(anc)] = torch.tensor(anc), True
    alone, alone_grads = _loss(draft, head, obj, ids, mask, aux, last, anchors, valid)

    # packed: one row, through pack_features as the trainer does
    from specforge_dspark.transport.features import TargetFeatures

    feats = TargetFeatures([0, 1, 2], ids, mask, torch.tensor(LENGTHS), aux, last)
    p = pack_features(feats, {0: 0, 1: 0, 2: 0})
    offsets = [0, LENGTHS[0], LENGTHS[0] + LENGTHS[1]]
    flat = torch.tensor([[o + a for o, anc in zip(offsets, ANCHORS, strict=True) for a in anc]])
    ones = torch.ones_like(flat, dtype=torch.bool)
    args = (p.input_ids, p.loss_mask, p.aux_hidden, p.last_hidden, flat, ones)
    packed, packed_grads = _loss(draft, head, obj, *args, pos=p.position_ids)

    assert packed.loss.item() == pytest.approx(alone.loss.item(), rel=1e-12)
    assert packed_grads.keys() == alone_grads.keys()
    for name, g in alone_grads.items():
        torch.testing.assert_close(packed_grads[name], g, rtol=1e-9, atol=1e-12, msg=name)
    for key in ("tau", "tau_expected", "ce", "l1"):
        if key in alone.log_dict():
            assert packed.log_dict()[key] == pytest.approx(alone.log_dict()[key], rel=1e-9), key
    # the same row without positions: context and positions run across conversations
    naive, _ = _loss(draft, head, obj, *args)
    assert abs(naive.loss.item() - alone.loss.item()) > 1e-6


# --------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_a_packed_run_stopped_and_resumed_equals_the_uninterrupted_one(tmp_path):
    """2 ranks, data.pack: stopped at step 3 and resumed, every step's loss and the final
    weights, Adam state and master weights equal the uninterrupted packed run's bitwise;
    and packing trains other batches than the unpacked run."""
    pack = ("data.pack=true", "data.max_length=384")  # the rows as the demo prepares them
    straight = ft.train(tmp_path / "straight", "--resume", "none", *pack)
    assert straight.returncode == 0, straight.stderr[-3000:]
    said = re.search(r"data.pack: (\d+) rows in (\d+) sequences", straight.stdout)
    assert said and int(said[2]) < int(said[1]), straight.stdout[-2000:]
    first = ft.train(tmp_path / "stopped", "--resume", "none", "--stop-at-step", "3", *pack)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(ft.losses(tmp_path / "stopped")) == [1, 2, 3]
    again = ft.train(tmp_path / "stopped", "--resume", "auto", *pack)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout + again.stderr

    want, got = ft.losses(tmp_path / "straight"), ft.losses(tmp_path / "stopped")
    assert sorted(want) == list(range(1, ft.STEPS + 1))
    assert got == want
    last = f"ckpt/step-{ft.STEPS}"
    assert ft.same_update_state(
        ft.state(tmp_path / "straight" / last), ft.state(tmp_path / "stopped" / last)
    )
    packed_ids = [ids for _, ids in ft.trained_ids(tmp_path / "straight", 0)]
    assert any(len(ids) > 1 for ids in packed_ids)  # micro-batch 1 holds whole packs
