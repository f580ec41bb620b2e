"""Sequence parallelism (objective/sequence_parallel.py): two gloo ranks that each hold
half of every sequence's features, attending across the pair through DeepSpeed's Ulysses,
give the loss, the metrics and every gradient of one process holding the whole sequences
(float64), with the same anchors; also for a length that does not divide, packed rows and
decoder chunks recomputed in backward (whose all-to-alls run again)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specforge_dspark.objective.loss import compute_loss_at
from specforge_dspark.objective.sequence_parallel import (
    SeqShard,
    shard_features,
    split_anchors,
)
from tests import faults_tiny as ft
from tests.inject import drills
from tests.test_companions import COMPANION
from tests.test_objective import OBJ, anchors_for, make_batch, make_models, to64

RANKS = 2
CASES = {
    "odd length": {"length": 23, "packed": False, "obj": {}},
    "packed, chunks recomputed": {
        "length": 24,
        "packed": True,
        "obj": {"decode_chunk_size": 4, "recompute": "on"},
    },
}


def _inputs(case: dict):
    draft, head, batch = to64(*make_models(), make_batch())
    S = case["length"]
    batch = {k: v[:, :S] for k, v in batch.items()}
    if case["packed"]:  # two conversations per row: positions restart at 10
        pos_S = torch.arange(S)
        batch["position_ids_BS"] = torch.where(pos_S < 10, pos_S, pos_S - 10).expand(4, S)
    anchors = anchors_for(batch, n=8)
    return draft, head, batch, anchors, dataclasses.replace(OBJ, num_anchors=8, **case["obj"])


def _rank_main(rank: int, store_dir: str, name: str) -> None:
    import deepspeed

    from specforge_dspark.training.distributed import skip_deepspeed_shm_build

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=RANKS
    )
    skip_deepspeed_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    draft, head, batch, (anchors, valid), obj = _inputs(CASES[name])
    shard = SeqShard(dist.new_group(list(range(RANKS))), rank, RANKS)
    whole = SimpleNamespace(
        aux_hidden=batch.pop("aux_hidden_BSD"), last_hidden=batch.pop("last_hidden_BSH")
    )
    aux, last = shard_features(whole, shard, draft.config.block_size - 1)
    out = compute_loss_at(
        draft,
        head,
        **batch,
        aux_hidden_BSD=aux,
        last_hidden_BSH=last,
        anchors_BN=anchors,
        block_valid_BN=valid,
        obj=obj,
        shard=shard,
    )
    out.loss.backward()
    grads = {}
    for p_name, p in draft.named_parameters():  # what DeepSpeed does: average over ranks
        dist.all_reduce(p.grad)
        grads[p_name] = p.grad / RANKS
    saved = {"grads": grads, "metrics": out.metrics, "loss": out.loss.detach(), "rows": aux.shape}
    torch.save(saved, os.path.join(store_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_per_sequence_equal_one(tmp_path, name):
    mp.spawn(_rank_main, args=(str(tmp_path), name), nprocs=RANKS, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(RANKS)]

    draft, head, batch, (anchors, valid), obj = _inputs(CASES[name])
    out = compute_loss_at(draft, head, **batch, anchors_BN=anchors, block_valid_BN=valid, obj=obj)
    out.loss.backward()

    S = CASES[name]["length"]
    assert [r["rows"][1] for r in ranks] == [(S + 1) // 2] * RANKS  # half the positions each
    # each rank's loss is its own anchors' share (they differ); their mean is the loss
    assert abs(float(ranks[0]["loss"]) - float(ranks[1]["loss"])) > 1e-3
    torch.testing.assert_close(
        (ranks[0]["loss"] + ranks[1]["loss"]) / RANKS, out.loss.detach(), rtol=1e-10, atol=0
    )
    assert float(out.metrics["valid_blocks"]) > 10
    for r in ranks:
        for key, value in out.metrics.items():
            torch.testing.assert_close(
                r["metrics"][key], value, rtol=1e-10, atol=1e-13, equal_nan=True, msg=key
            )
        for p_name, p in draft.named_parameters():
            torch.testing.assert_close(
                r["grads"][p_name], p.grad, rtol=1e-9, atol=1e-12, msg=p_name
            )


def test_split_anchors_keeps_each_ranks_own_in_order():
    anchors = torch.tensor([[9, 2, 14, 5, 0], [3, 11, 0, 0, 0]])
    valid = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    got, ok = split_anchors(anchors, valid, 16, 2)  # slices [0, 8) and [8, 16)
    assert got.tolist() == [[[2, 5], [9, 14]], [[3, 0], [11, 0]]]
    assert ok.tolist() == [[[True, True], [True, True]], [[True, False], [True, False]]]


def test_heads_and_world_that_do_not_divide_are_refused():
    from specforge_dspark.config.recipe import RecipeError, load_recipe
    from specforge_dspark.training.distributed import sequence_shard

    with pytest.raises(
        RecipeError, match=r"sequence_parallel=3 must divide draft.num_attention_heads \(4\)"
    ):
        load_recipe("recipes/tiny_cpu.yaml", ["dist.sequence_parallel=3"])
    recipe = load_recipe("recipes/tiny_cpu.yaml", ["dist.sequence_parallel=2"])
    with pytest.raises(ValueError, match="does not divide the world size 3"):
        sequence_shard(recipe, 0, 3)
    import train  # the dry run refuses it too, before sizing anything

    argv = ["--recipe", "recipes/tiny_cpu.yaml", "--dry-run", "--world-size", "3"]
    assert train.main([*argv, "dist.sequence_parallel=2"]) == 2
    assert train.main([*argv, "dist.sequence_parallel=3", "draft.num_attention_heads=6"]) == 0


# --------------------------------------------------------------------------- train.py


def _train(out: Path, ranks: int, *extra: str, nan: str = "") -> subprocess.CompletedProcess:
    cmd = ft.command(out, "train.max_steps=4", *extra)
    cmd[cmd.index("--nproc_per_node") + 1] = str(ranks)
    env = ft.environment(out, {drills.NAN: nan} if nan else None)
    p = subprocess.run(cmd, cwd=ft.REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode in (0, 143), p.stderr[-3000:]
    return p


@pytest.mark.slow
def test_train_two_ranks_per_sequence_then_resume_on_one(tmp_path, tiny_target_dir):
    """train.py with dist.sequence_parallel=2 on 2 ranks steps like 1 rank on the same
    batches (losses, weights), a DFlash companion with sliding-window layers too; its
    step-2 checkpoint resumes on 1 rank without it, and steps 3-4 are the 1-rank run's.
    Each rank of the pair gets only its slice from the engine; NaN features in the second
    rank's slice of micro-batch 2 clear those samples on both ranks, as NaN features of
    the same micro-batch do in the 1-rank run."""
    one, split = tmp_path / "one", tmp_path / "split"
    _train(one, 1, COMPANION, "--resume", "none", nan="features:2")
    said = _train(split, 2, COMPANION, "dist.sequence_parallel=2", "--resume", "none",
                  "--stop-at-step", "2", nan="features:2@1")  # fmt: skip
    assert "on 2 rank(s) (1 group(s) of 2 per sequence)" in said.stdout + said.stderr
    assert "each rank asks hf for its slice of every sequence's features" in said.stdout
    assert "[drill] rank 1: NaN features in micro-batch 2" in said.stderr
    resumed = _train(split, 1, COMPANION, "--resume", "auto")
    assert "re-partitioned from 2 to 1 rank(s)" in resumed.stdout + resumed.stderr
    for sub in ("", "companions/dflash"):  # each rank held half of the positions: same updates
        got, want = ft.losses(split / sub), ft.losses(one / sub)
        assert sorted(got) == sorted(want) == [1, 3, 4]  # step 2: every sample cleared
        assert got == pytest.approx(want, rel=1e-5), sub
        for step in (2, 4):
            ckpt = f"ckpt/step-{step}"
            _assert_close_weights(split / sub / ckpt, one / sub / ckpt)


def _assert_close_weights(a: Path, b: Path) -> None:
    """Within lr / 20 (Adam's first steps divide by the gradient's own size, so a weight
    whose gradient is ~0 moves by a rounding-sized amount either way: measured up to 1.1e-5
    for 3 of 49,152 fc weights; a wrong mask moves many by ~lr = 2e-3)."""
    wa, wb = ft.state(a)["module"], ft.state(b)["module"]
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-4, msg=name)


def test_the_hf_worker_hands_a_rank_its_window_only(tiny_target_dir):
    """With a window (FeatureStream.window, what dist.sequence_parallel asks) the hf
    worker writes only those rows, into slots sized for them: equal to the same rows of
    every position's features, zero past a sequence's end (one ends before the window)."""
    from specforge_dspark.training.stream import FeatureStream
    from tests.test_stream import make_samples, tiny_recipe

    recipe = tiny_recipe(tiny_target_dir, batch_size=1)
    batches = [make_samples([37, 5, 60]), make_samples([64], seed=1, first_id=200)]
    window = lambda S: (S // 2 - 4, S // 2 + 3)  # noqa: E731  second half, 7 rows of halo
    with FeatureStream(recipe) as stream:
        whole = [(f.aux_hidden.clone(), f.last_hidden.clone()) for f in stream.iterate(batches)]
    with FeatureStream(recipe) as stream:
        stream.window = window
        for (aux, last), f in zip(whole, stream.iterate(batches), strict=True):
            lo, W = window(aux.shape[1])
            assert f.row0 == lo and f.aux_hidden.shape[1] == f.last_hidden.shape[1] == W
            for got, want in ((f.aux_hidden, aux), (f.last_hidden, last)):
                want = torch.cat((want, torch.zeros_like(want)), 1)[:, lo : lo + W]
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        capacities = [slot.layout.capacity for slot in stream.engine.slots[:2]]
    # batch 0: S 60, rows [26, 59): 11 + 0 + 33 of 102; batch 1: S 64, [28, 63): 35 of 64
    assert capacities == [44, 35]
