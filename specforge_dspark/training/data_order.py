"""The order in which training samples are trained, and the cursor a checkpoint keeps.

Epoch e trains the permutation perm_e = randperm(n, seed * 1000 + e) front to back. On
`world` ranks with micro batch `mb`, a micro step takes the next world * mb positions:
rank r's micro-batch holds positions offset + i * world + r (i < mb), where `offset` is the
count of positions the epoch has already trained (TrainState.epoch_samples). An epoch ends
when fewer than world * mb positions are left; that tail is not trained in this epoch.

The cursor (epoch, epoch_samples) counts samples, not micro steps, so it means the same on
any world size: a run resumed on W' ranks continues with perm_e[epoch_samples:] split over
W' ranks, and every sample of the epoch is still trained at most once, in the same order
(exactly once when n - epoch_samples is a multiple of W' * mb). On an unchanged world size
the order is what it always was: shard r = perm_e[r::world], micro-batch j = shard[j*mb:].

With data.pack the samples ordered are the packs of training/packing.py (`plan`: the rows of
each), n is their count, and a micro-batch lists the rows of its packs in order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

EVAL_ROWS = 32  # teacher-forced eval: the first rows of data.eval_files, split over ranks
EVAL_ID = 1 << 40  # eval samples travel the same stream, told apart by their ids


def permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    """[n] the order of epoch `epoch`'s samples."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))


def micro_rows(perm: torch.Tensor, offset: int, rank: int, world: int, mb: int) -> list[int]:
    """Rows of rank `rank`'s micro-batch starting at position `offset` of `perm`."""
    return perm[offset + rank : offset + world * mb : world].tolist()


def advance(cursor, n: int, world: int, mb: int) -> None:
    """Move `cursor` (epoch, epoch_samples) past one micro step of `world` ranks."""
    cursor.epoch_samples += world * mb
    settle(cursor, n, world, mb)


def settle(cursor, n: int, world: int, mb: int) -> None:
    """The next epoch when only the tail of this one is left (fewer than world * mb)."""
    if n - cursor.epoch_samples < world * mb:
        cursor.epoch, cursor.epoch_samples = cursor.epoch + 1, 0


def samples_left(cursor, n: int, world: int, mb: int) -> int:
    """Samples the current epoch still trains on `world` ranks."""
    return (n - cursor.epoch_samples) // (world * mb) * world * mb


def restore_cursor(state, n: int, saved_world: int, world: int, mb: int) -> None:
    """The cursor of a resumed `state` on `world` ranks. A checkpoint older than
    epoch_samples (-1) trained micro steps of `saved_world` ranks only, so `micro_step`
    says where its epoch stands; a tail too short for `world` ranks moves to the next epoch."""
    if state.epoch_samples < 0:
        per_epoch = n // (saved_world * mb)
        state.epoch, i = divmod(state.micro_step, per_epoch)
        state.epoch_samples = i * saved_world * mb
    settle(state, n, world, mb)


def eval_rows(eval_set, rank: int, world: int) -> range:
    """This rank's rows of the eval set (the same count on every rank)."""
    n = min(len(eval_set), EVAL_ROWS) // world * world
    return range(rank, n, world)


def batches(
    recipe, dataset, eval_set, rank: int, world: int, state, plan: list[list[int]] | None = None
) -> Iterator[list]:
    """Micro-batches of this rank from where `state` (TrainState) stands onwards; with a
    packing `plan`, the samples ordered are its packs.

    Every train.eval_interval optimizer steps (of `state.grad_accum` micro steps) the eval
    rows follow (ids >= EVAL_ID), one per batch; a run resumed at such a step starts with
    them (the stopped run saved before them). `state` is read once: the stream runs ahead.
    """
    t, mb = recipe.train, recipe.train.micro_batch_size
    n = len(dataset) if plan is None else len(plan)
    rows_of = (lambda u: (u,)) if plan is None else plan.__getitem__
    every, grad_accum = t.eval_interval, state.grad_accum
    cursor = _Cursor(state.epoch, state.epoch_samples)
    step, micro = state.step, 0
    evals = eval_rows(eval_set, rank, world) if every else range(0)
    if every and step and step % every == 0:  # resumed where the evals were due
        yield from ([_sample(eval_set[r], EVAL_ID)] for r in evals)
    while True:
        perm = permutation(t.seed, cursor.epoch, n)
        epoch = cursor.epoch
        while cursor.epoch == epoch:
            rows = micro_rows(perm, cursor.epoch_samples, rank, world, mb)
            yield [_sample(dataset[r]) for u in rows for r in rows_of(u)]
            advance(cursor, n, world, mb)
            micro += 1
            if micro % grad_accum == 0:
                step += 1
                if every and step % every == 0:
                    yield from ([_sample(eval_set[r], EVAL_ID)] for r in evals)


class _Cursor:
    def __init__(self, epoch: int, epoch_samples: int):
        self.epoch, self.epoch_samples = epoch, epoch_samples


def _sample(row: dict, id_base: int = 0):
    from specforge_dspark.transport.features import Sample

    return Sample(
        sample_id=id_base + int(row["sample_id"]),
        input_ids=torch.tensor(row["input_ids"], dtype=torch.long),
        loss_mask=torch.tensor(row["loss_mask"], dtype=torch.long),
    )
