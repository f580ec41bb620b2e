"""The feature slot budget (transport/slot_budget.py) and the ragged slot layout (shm.py).

A slot holds a request's rows back to back (sequence b's at the sum of the lengths before
it), so a request costs its tokens, not rows x longest. On a bimodal mix of conversation
lengths packed by data.pack, whose micro-batches laid out rows x longest would need many
times the budget, every request fits and the largest slot file stays within the bytes
the start-up check printed. A request over the budget fails before anything is written,
naming the recipe keys that set it.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.training.packing import pack_plan
from specforge_dspark.transport.features import PaddedBatch
from specforge_dspark.transport.request import issue_tickets
from specforge_dspark.transport.shm import SlotLayout
from specforge_dspark.transport.slot_budget import job_id, make_slots, request_budget
from specforge_dspark.transport.slot_writer import SlotMaps, write_features
from specforge_dspark.transport.tickets import DONE

D, H = 12, 4


def _recipe(tmp_path, pack: bool, max_length: int = 64, micro: int = 2, batch: int = 1):
    return recipe_from_dict(
        {
            "data": {"max_length": max_length, "pack": pack},
            "train": {"micro_batch_size": micro, "output_dir": str(tmp_path)},
            "target": {"batch_size": batch},
        }
    )


def _batch(lengths: list[int], first_id: int = 0) -> PaddedBatch:
    S = max(lengths)
    ids = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.arange(1, n + 1)
    ids_list = list(range(first_id, first_id + len(lengths)))
    return PaddedBatch(ids_list, ids, ids.ne(0).long(), torch.tensor(lengths))


def _rows(sample_id: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the engine writes for a sequence: values that name the sample and the row."""
    base = torch.arange(n, dtype=torch.float32)[:, None] + 1000.0 * (sample_id + 1)
    return base + torch.arange(D) / 100, -(base + torch.arange(H) / 100)


def test_the_budget_is_what_a_request_can_hold(tmp_path):
    plain = request_budget(_recipe(tmp_path, pack=False, micro=2, batch=3))
    assert (plain.tokens, plain.seqs) == (3 * 64, 4)  # 4: train.preflight_samples rows
    assert "data.max_length=64" in plain.keys and "target.batch_size=3" in plain.keys
    packed = request_budget(_recipe(tmp_path, pack=True, micro=2))
    assert (packed.tokens, packed.seqs) == (2 * 64, 2 * 64)  # one conversation per token
    assert "train.micro_batch_size=2" in packed.keys and "data.pack" in packed.keys


def test_bimodal_packed_micro_batches_stay_within_the_printed_budget(tmp_path, monkeypatch):
    monkeypatch.setattr("specforge_dspark.transport.slot_writer.SLOTS", SlotMaps())
    L, micro = 64, 2
    g = torch.Generator().manual_seed(0)
    lengths = [  # bimodal: a third long conversations, two thirds short ones
        int(torch.randint(48, L + 1, (1,), generator=g))
        if i % 3 == 0
        else int(torch.randint(2, 9, (1,), generator=g))
        for i in range(240)
    ]
    plan = pack_plan(lengths, L)
    recipe = _recipe(tmp_path, pack=True, max_length=L, micro=micro)
    printed: list[str] = []
    slots = make_slots(0, 3, D, H, torch.float32, recipe, say=printed.append)
    try:
        budget_bytes = int(re.search(r"\((\d+) bytes\)", printed[0]).group(1))
        budget = request_budget(recipe)
        assert f"{budget.tokens} tokens / {budget.seqs} sequences" in printed[0]
        peak_size = peak_touched = padded_tokens = 0
        for i in range(0, len(plan) - micro + 1, micro):
            rows = [r for p in plan[i : i + micro] for r in p]
            batch = _batch([lengths[r] for r in rows], first_id=rows[0])
            slot = slots[(i // micro) % len(slots)]
            views = issue_tickets(slot, batch)
            for b, r in enumerate(rows):  # the engine answers each ticket
                t = slot.read_ticket(b)
                write_features(str(slot.path), b, t.nonce, 0, *_rows(rows[0] + b, lengths[r]))
                assert slot.read_ticket(b).status == DONE
            aux, last = views.padded(batch.shape[1])  # the trainer's features
            for b, r in enumerate(rows):
                want_aux, want_last = _rows(rows[0] + b, lengths[r])
                assert torch.equal(aux[b, : lengths[r]], want_aux)
                assert torch.equal(last[b, : lengths[r]], want_last)
                assert not aux[b, lengths[r] :].any() and not last[b, lengths[r] :].any()
            st = os.stat(slot.path)
            peak_size = max(peak_size, st.st_size)
            peak_touched = max(peak_touched, st.st_blocks * 512)
            padded_tokens = max(padded_tokens, batch.shape[0] * batch.shape[1])
        print(
            f"bimodal packed: budget {budget_bytes} bytes per slot ({budget.tokens} tokens); "
            f"peak slot file {peak_size} bytes, {peak_touched} touched; rows x longest would "
            f"need {padded_tokens} tokens"
        )
        assert padded_tokens > 2 * budget.tokens  # laid out rows x longest it would not fit
        assert peak_size <= budget_bytes and peak_touched <= budget_bytes
    finally:
        for s in slots:
            s.close()


def test_a_request_over_the_budget_fails_before_anything_is_written(tmp_path):
    recipe = _recipe(tmp_path, pack=False, max_length=64, micro=1, batch=1)
    (slot,) = make_slots(0, 1, D, H, torch.float32, recipe, say=lambda line: None)
    try:
        issue_tickets(slot, _batch([40]))
        path, layout, ticket = slot.path, slot.layout, slot.read_ticket(0)
        with pytest.raises(ValueError) as e:
            issue_tickets(slot, _batch([40, 40]))  # 80 tokens: more than one row can be
        msg = str(e.value)
        assert "80 tokens" in msg and "budget of 64 tokens" in msg
        assert "data.max_length=64" in msg and "target.batch_size=1" in msg
        assert slot.path == path and slot.layout == layout and slot.read_ticket(0) == ticket
    finally:
        slot.close()


def test_tickets_point_at_ragged_rows(tmp_path):
    recipe = _recipe(tmp_path, pack=True, max_length=64, micro=1)
    (slot,) = make_slots(0, 1, D, H, torch.float32, recipe, say=lambda line: None)
    try:
        lengths = [5, 2, 7]
        issue_tickets(slot, _batch(lengths))
        lay = slot.layout
        for b, o in enumerate([0, 5, 7]):
            t = slot.read_ticket(b)
            assert t.rows == lengths[b] and t.aux_off == lay.aux_off + o * D * 4
            assert t.last_off == lay.last_off + o * H * 4
        assert lay.capacity == 14  # the request's tokens, not 3 x 7
        assert lay.nbytes == SlotLayout.plan(14, 3, D, H, torch.float32).nbytes
    finally:
        slot.close()


def test_slot_names_carry_the_job_of_their_output_dir(tmp_path):
    a, b = _recipe(tmp_path / "a", pack=False), _recipe(tmp_path / "b", pack=False)
    assert job_id(a) != job_id(b) and job_id(a) == job_id(_recipe(tmp_path / "a", pack=True))
    (slot,) = make_slots(0, 1, D, H, torch.float32, a, say=lambda line: None)
    try:
        slot.prepare([3])
        assert slot.path.name.startswith(f"sfdspark-{job_id(a)}-{os.getpid()}-r0s0-")
    finally:
        slot.close()
