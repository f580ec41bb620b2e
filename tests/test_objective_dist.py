"""Rank pooling: two gloo ranks with different numbers of valid blocks train like one
process on the union of their sequences (DSPARK_SPEC.md section 3, item 6), with the
fixed decay slot weights and with D-PACE's (whose normaliser, the supervised slots, is
pooled over the ranks like the decay weights' sum: not computed per rank)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specforge_dspark.objective.loss import compute_loss_at
from tests.test_objective import OBJ, anchors_for, make_batch, make_models, to64

SHARDS = ([0, 2], [1, 3])  # rank 0: 3 valid blocks and a skipped sequence; rank 1: 12 blocks


def _union_inputs():
    draft, head, batch = to64(*make_models(), make_batch())
    return draft, head, batch, anchors_for(batch)


def _rank_main(rank: int, store_dir: str, weighting: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=len(SHARDS)
    )
    draft, head, batch, (anchors, valid) = _union_inputs()
    rows = SHARDS[rank]
    out = compute_loss_at(
        draft,
        head,
        **{k: v[rows] for k, v in batch.items()},
        anchors_BN=anchors[rows],
        block_valid_BN=valid[rows],
        obj=dataclasses.replace(OBJ, slot_weighting=weighting),
    )
    out.loss.backward()
    grads = {}
    for name, p in draft.named_parameters():  # what DDP / DeepSpeed do: average over ranks
        dist.all_reduce(p.grad)
        grads[name] = p.grad / dist.get_world_size()
    torch.save(
        {"grads": grads, "metrics": out.metrics, "loss": out.loss.detach()},
        os.path.join(store_dir, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_two_ranks_equal_one_process_on_the_union(tmp_path, weighting):
    mp.spawn(_rank_main, args=(str(tmp_path), weighting), nprocs=len(SHARDS), join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(len(SHARDS))]

    draft, head, batch, (anchors, valid) = _union_inputs()
    obj = dataclasses.replace(OBJ, slot_weighting=weighting)
    out = compute_loss_at(draft, head, **batch, anchors_BN=anchors, block_valid_BN=valid, obj=obj)
    out.loss.backward()

    assert [float(r["metrics"]["valid_blocks"]) for r in ranks] == [15.0, 15.0]
    # the ranks' losses differ (3 vs 12 blocks) but average to the pooled loss
    assert abs(float(ranks[0]["loss"]) - float(ranks[1]["loss"])) > 0.1
    mean_loss = (ranks[0]["loss"] + ranks[1]["loss"]) / 2
    torch.testing.assert_close(mean_loss, out.loss.detach(), rtol=1e-12, atol=0)
    for r in ranks:
        for name, value in out.metrics.items():
            torch.testing.assert_close(
                r["metrics"][name], value, rtol=1e-12, atol=1e-15, equal_nan=True, msg=name
            )
        for name, p in draft.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=1e-10, atol=1e-13, msg=name)
