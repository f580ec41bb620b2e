"""Sequence packing (`data.pack: true`): several prepared conversations trained as one
sequence of at most data.max_length tokens.

`pack_plan` decides once, from the prepared rows' lengths, which conversations share a
sequence: best-fit decreasing (longest row first, into the open sequence with the least
room that still fits it; ties by row index, so the plan is a function of the data alone).
Each pack is one training unit of data_order.py: an epoch shuffles the packs, and a
micro-batch holds train.micro_batch_size of them.

The engines never see a pack. Each conversation is its own request, so the target's
features of a packed sequence are exactly those of each conversation alone (no attention
crosses a boundary in the target), and `pack_features` concatenates a micro-batch's
per-conversation features into its packs, with `position_ids` restarting at 0 for each
conversation. The objective reads them (objective/loss.py): a block's context starts at
its conversation's first token and its positions are the conversation's own, as when
served. Blocks never straddle a boundary: `pack_features` leaves a conversation's first
token unsupervised (a chat template's first token always is), so no anchor sits on it
and every block's supervised prefix (objective/blocks.py) stops before it.

The target sees a micro-batch as one batch of its conversations: at most
train.micro_batch_size x data.max_length tokens however many conversations, which the
ragged feature slots are sized for (transport/slot_budget.py).

Shape legend: B conversations of the micro-batch, S their padded length, P packed rows,
L the longest pack's length, D aux width, H hidden size.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Mapping, Sequence

import torch

from specforge_dspark.transport.features import TargetFeatures


def pack_plan(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows (indices into `lengths`) of each pack, every row in exactly one pack and each
    pack's total length at most `capacity`; a pack's rows in index order, packs in the
    order they were opened (the longest rows first)."""
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"data.pack: prepared row {i} has {lengths[i]} tokens, more than data.max_length="
            f"{capacity} ({len(too_long)} such row(s)); prepare the data with this max_length"
        )
    packs: list[list[int]] = []
    rooms: list[int] = []  # sorted distinct free room of the open packs
    open_by_room: dict[int, list[int]] = {}  # room -> indices of the packs with that room
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        j = bisect_left(rooms, n)
        if j < len(rooms):  # the tightest open pack that fits
            room = rooms[j]
            p = open_by_room[room].pop()
            if not open_by_room[room]:
                del open_by_room[room]
                rooms.pop(j)
        else:
            room, p = capacity, len(packs)
            packs.append([])
        packs[p].append(i)
        room -= n
        if room > 0:
            if room not in open_by_room:
                open_by_room[room] = []
                insort(rooms, room)
            open_by_room[room].append(p)
    return [sorted(p) for p in packs]


def pack_index(plan: list[list[int]], sample_ids: Sequence[int]) -> dict[int, int]:
    """sample_id -> its pack, for `pack_features` (`sample_ids[r]` is row r's id)."""
    return {int(sample_ids[r]): p for p, rows in enumerate(plan) for r in rows}


def pack_features(f: TargetFeatures, pack_of: Mapping[int, int]) -> TargetFeatures:
    """The micro-batch's conversations `f` ([B, S], each alone) as its packs ([P, L]):
    consecutive samples of one pack (by `pack_of`; a sample it does not know, such as an
    eval row, is a pack of its own) are concatenated in order, right-padded to the
    longest pack; `position_ids` restart at 0 per conversation (0 on padding), and each
    conversation after a pack's first has its first token unsupervised. `sample_ids` of
    the result lists every conversation, pack by pack. Every position's rows only (a
    window of rows is never asked for with data.pack: training/build.py)."""
    if f.row0 is not None:
        raise ValueError("pack_features: packing needs every position's rows, not a window")
    groups: list[list[int]] = []
    for i, sid in enumerate(f.sample_ids):
        key = pack_of.get(int(sid))
        if groups and key is not None and pack_of.get(int(f.sample_ids[groups[-1][-1]])) == key:
            groups[-1].append(i)
        else:
            groups.append([i])
    lengths = f.lengths.tolist()
    totals = [sum(lengths[i] for i in g) for g in groups]
    P, L = len(groups), max(totals)
    ids_PL = f.input_ids.new_zeros(P, L)
    mask_PL = f.loss_mask.new_zeros(P, L)
    pos_PL = f.input_ids.new_zeros(P, L)
    aux_PLD = f.aux_hidden.new_zeros(P, L, f.aux_hidden.shape[-1])
    last_PLH = f.last_hidden.new_zeros(P, L, f.last_hidden.shape[-1])
    for p, g in enumerate(groups):
        o = 0
        for i in g:
            n = lengths[i]
            ids_PL[p, o : o + n] = f.input_ids[i, :n]
            mask_PL[p, o : o + n] = f.loss_mask[i, :n]
            if o:
                mask_PL[p, o] = 0
            pos_PL[p, o : o + n] = torch.arange(n, device=pos_PL.device)
            aux_PLD[p, o : o + n] = f.aux_hidden[i, :n]
            last_PLH[p, o : o + n] = f.last_hidden[i, :n]
            o += n
    return TargetFeatures(
        list(f.sample_ids),
        ids_PL,
        mask_PL,
        torch.tensor(totals, dtype=f.lengths.dtype, device=f.lengths.device),
        aux_PLD,
        last_PLH,
        position_ids=pos_PL,
    )


def row_lengths(dataset) -> list[int]:
    """Token count of each prepared row (a datasets.Dataset with `input_ids`), read from
    the arrow offsets without materialising the ids."""
    lengths: list[int] = []
    for batch in dataset.with_format("arrow").iter(batch_size=4096):
        ids = batch.column("input_ids").combine_chunks()
        lengths += ids.value_lengths().to_pylist()
    return lengths


def describe_plan(plan: list[list[int]], lengths: Sequence[int], capacity: int) -> str:
    """One line: how many rows went into how many sequences, and what share of the
    max_length token budget they use (packed, and with one row per sequence)."""
    tokens = sum(lengths)
    fill = tokens / max(len(plan) * capacity, 1)
    alone = tokens / max(len(lengths) * capacity, 1)
    return (
        f"data.pack: {len(lengths)} rows in {len(plan)} sequences of at most {capacity} "
        f"tokens ({len(lengths) / max(len(plan), 1):.2f} rows per sequence, using {fill:.0%} of "
        f"their max_length; one row per sequence uses {alone:.0%})"
    )
