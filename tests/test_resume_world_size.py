"""Resume on another world size (issue 23, item 1): checkpoint.py, repartition.py,
data_order.py.

A checkpoint saved on W ranks resumes on W': the ZeRO-2 optimizer state is re-partitioned
(the whole fp32 master weights and Adam moments are unchanged), train.grad_accum keeps the
global batch (refused, naming the keys, when W' does not divide W x grad_accum), the LR
schedule continues from the same step and the epoch continues where it stood, so that each
sample of it is trained exactly once. The tiny run goes 2 ranks -> 1 -> 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specforge_dspark.config.recipe import load_recipe, recipe_from_dict
from specforge_dspark.training import checkpoint as ck
from specforge_dspark.training import data_order
from specforge_dspark.training.checkpoint import FORMAT_VERSION, ResumeError
from specforge_dspark.training.repartition import FP32, cut, parts, read_shards, sharded_keys
from tests import faults_tiny as ft
from tests.live_sglang import free_port

RECIPE = "recipes/tiny_cpu.yaml"
ROWS = ["data.max_rows=12"]  # 10 prepared rows: 5 steps an epoch at a global batch of 2


def unpartitioned(path: Path) -> dict[str, list[torch.Tensor]]:
    """{"master", "exp_avg", "exp_avg_sq": [flat_N per parameter group]}: the whole
    fp32 master weights and Adam moments of checkpoint `path`, whatever its world size."""
    shards = read_shards(path)
    out: dict[str, list[torch.Tensor]] = {}
    for g in range(len(shards[0][FP32])):
        total = sum(s[FP32][g].numel() for s in shards)
        for key in [None, *sharded_keys(shards[0], g)]:
            whole = cut(parts(shards, g, key), 0, total).clone()
            out.setdefault(key or "master", []).append(whole)
    return out


def _meta(recipe, world: int, grad_accum: int = 0) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "world_size": world,
        "recipe": recipe.to_dict(),
        "grad_accum": grad_accum,
    }


def _recipe(**train) -> object:
    return recipe_from_dict({"train": {"micro_batch_size": 1, "grad_accum": 1, **train}})


# --------------------------------------------------------------------------- units


@pytest.mark.parametrize("world, mb", [(1, 1), (2, 1), (2, 3), (4, 2)])
def test_unchanged_world_keeps_the_shard_order(world, mb):
    """Rank r's micro-batch j is shard[j*mb : (j+1)*mb] of shard = perm[r::world], as before."""
    n = 23
    perm = data_order.permutation(0, 1, n)
    for r in range(world):
        shard = perm[r::world]
        for j in range(n // (world * mb)):
            want = shard[j * mb : (j + 1) * mb].tolist()
            assert data_order.micro_rows(perm, j * world * mb, r, world, mb) == want


def test_a_world_change_mid_epoch_trains_each_sample_once():
    n, mb, cursor = 12, 1, SimpleNamespace(epoch=0, epoch_samples=0)
    perm, trained = data_order.permutation(0, 0, n), []
    for world, micro_steps in [(2, 2), (1, 2), (3, 3)]:  # 4 + 2 + 6 samples: 12, then 3
        for _ in range(micro_steps):
            epoch, at = cursor.epoch, cursor.epoch_samples
            rows = [data_order.micro_rows(perm, at, r, world, mb) for r in range(world)]
            trained += [(epoch, x) for rank_rows in rows for x in rank_rows]
            data_order.advance(cursor, n, world, mb)
            if cursor.epoch != epoch:
                perm = data_order.permutation(0, cursor.epoch, n)
    first = [x for e, x in trained if e == 0]
    assert first == data_order.permutation(0, 0, n).tolist()  # the epoch's order, once each
    assert [x for e, x in trained if e == 1] == data_order.permutation(0, 1, n)[:3].tolist()


def test_old_checkpoints_derive_the_cursor_and_a_short_tail_moves_on():
    state = SimpleNamespace(micro_step=13, epoch=2, epoch_samples=-1)  # 5 micro steps/epoch
    data_order.restore_cursor(state, 11, 2, 2, 1)
    assert (state.epoch, state.epoch_samples) == (2, 6)
    state = SimpleNamespace(micro_step=0, epoch=0, epoch_samples=9)  # 1 left, 2 ranks
    data_order.restore_cursor(state, 10, 1, 2, 1)
    assert (state.epoch, state.epoch_samples) == (1, 0)


def test_grad_accum_keeps_the_global_batch(tmp_path):
    r = _recipe()
    shrink = ck.check_compatible(_meta(r, world=4), r, 2, tmp_path)
    assert (shrink.changed, shrink.saved_grad_accum, shrink.grad_accum) == (True, 1, 2)
    # continuing on 2 ranks, the recipe as written (grad_accum 1) or with the kept value
    for given in (r, _recipe(grad_accum=2)):
        again = ck.check_compatible(_meta(r, world=2, grad_accum=2), given, 2, tmp_path)
        assert (again.changed, again.grad_accum) == (False, 2)
        assert "train.grad_accum 2, not the recipe's 1: keeps the global batch of 4" in (
            again.describe(0, 4, 10, recipe_grad_accum=1)
        )
    back = ck.check_compatible(_meta(r, world=2, grad_accum=2), r, 4, tmp_path)
    assert back.grad_accum == 1
    same = ck.check_compatible(_meta(r, world=2), r, 2, tmp_path)
    assert not same.changed and same.describe(0, 4, 10, recipe_grad_accum=1) == ""


def test_other_global_batches_are_refused_naming_the_keys(tmp_path):
    r = _recipe()
    with pytest.raises(ResumeError, match="train.grad_accum: 1 -> 3"):
        ck.check_compatible(_meta(r, world=2), _recipe(grad_accum=3), 1, tmp_path)
    with pytest.raises(ResumeError) as e:  # 2 x 1 has no whole grad_accum on 4 ranks
        ck.check_compatible(_meta(r, world=2), r, 4, tmp_path)
    msg = str(e.value)
    assert "world_size 2, resuming with 4" in msg and "global batch of 2" in msg
    assert "train.micro_batch_size 1" in msg and "train.grad_accum 1" in msg
    assert "Resume on [1, 2] rank(s)" in msg
    z0 = recipe_from_dict({"dist": {"zero_stage": 0}})  # ZeRO-3 is refused at load
    with pytest.raises(ResumeError, match="dist.zero_stage 1 and 2, not 0"):
        ck.check_compatible(_meta(z0, world=2), z0, 1, tmp_path)


# --------------------------------------------------------------------------- 2 -> 1 -> 2


def _train(out: Path, ranks: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = ft.command(out, *ROWS, *extra)
    cmd[cmd.index("--nproc_per_node") + 1] = str(ranks)
    return _run(cmd, out, (*ROWS, *extra))


def _resave(ckpt: Path, out: Path, ranks: int) -> Path:
    """`ckpt` loaded on `ranks` ranks and saved again untrained: out/ckpt/step-N."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    cmd += ["--master_port", str(free_port()), "-m", "tests.resave_checkpoint"]
    _run([*cmd, RECIPE, str(ckpt), str(out), *ft.OVERRIDES, *ROWS], out, ROWS)
    return out / "ckpt" / ckpt.name


def _run(cmd: list[str], out: Path, overrides: tuple) -> subprocess.CompletedProcess:
    p = ft.run(cmd, out, overrides)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _assert_same_state(saved: Path, resaved: Path) -> None:
    """Weights, LR scheduler, whole master weights and Adam moments, Adam's step."""
    a, b = ft.state(saved), ft.state(resaved)
    unsharded = {"adam": [], "master": []}  # compared whole below: their shards differ
    assert ft.same_update_state({**a, **unsharded}, {**b, **unsharded})
    full_a, full_b = unpartitioned(saved), unpartitioned(resaved)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert all(map(torch.equal, full_a[key], full_b[key])), key
    steps = {float(s["step"]) for adam in (a["adam"], b["adam"]) for s in _adam(adam)}
    assert len(steps) == 1


def _adam(shards: list[dict]) -> list[dict]:
    return [s for shard in shards for s in shard["state"].values()]


def _trained(out: Path) -> list[int]:
    """Sample ids in the order trained: by micro step, then rank (the global order)."""
    records = [(m, r, ids) for r in (0, 1) for m, ids in ft.trained_ids(out, r)]
    return [i for _, _, ids in sorted(records) for i in ids]


@pytest.mark.slow
def test_two_ranks_to_one_and_back(tmp_path, tiny_target_dir):
    from data_pipelines.prepare import prepare_dataset
    from specforge_dspark.training.distributed import lr_lambda

    out = tmp_path / "run"
    first = _train(out, 2, "--resume", "none", "--stop-at-step", "2")
    step2 = out / "ckpt" / "step-2"
    # 2 -> 1: the state right after re-partitioning is the saved one
    _assert_same_state(step2, _resave(step2, tmp_path / "resave1", 1))
    second = _train(out, 1, "--resume", "auto", "--stop-at-step", "4")
    said = second.stdout + second.stderr
    assert "re-partitioned from 2 to 1 rank(s)" in said
    assert "train.grad_accum 1 -> 2 keeps the global batch of 2" in said
    assert "epoch 0: 6 of 10 samples left, split over 1 rank(s)" in said
    step4 = out / "ckpt" / "step-4"
    meta = json.loads((step4 / "train_state.json").read_text())
    assert meta["world_size"] == 1 and meta["grad_accum"] == 2
    assert meta["recipe"]["train"]["grad_accum"] == 1  # the recipe as given
    # 1 -> 2
    _assert_same_state(step4, _resave(step4, tmp_path / "resave2", 2))
    third = _train(out, 2, "--resume", "auto")
    said = third.stdout + third.stderr
    assert "train.grad_accum 2 -> 1 keeps the global batch of 2" in said
    assert "epoch 0: 2 of 10 samples left, split over 2 rank(s)" in said

    # every sample of epoch 0 once, then epoch 1 from its start: the uninterrupted order
    recipe = load_recipe(RECIPE, [f"train.output_dir={out}", *ft.OVERRIDES, *ROWS])
    data = prepare_dataset(recipe, split="train")
    n = len(data)
    assert n == 10 and f"{n} rows" in first.stdout + first.stderr
    order = [data_order.permutation(0, e, n) for e in (0, 1)]
    want = [int(data[int(r)]["sample_id"]) for r in [*order[0], *order[1][: 16 - n]]]
    assert _trained(out) == want  # 8 steps x 2 samples: all of epoch 0, 6 of epoch 1

    # the LR schedule of the uninterrupted run at every step: 1-2 are that run, 3 and 5
    # the first steps after a switch
    lr = lr_lambda(recipe, ft.STEPS)
    logged = ft.metrics(out)
    assert sorted(logged) == list(range(1, ft.STEPS + 1))
    for step, m in logged.items():
        assert m["lr"] == recipe.optim.lr * lr(step), step
        assert m["epoch"] == (0 if step < 5 else 1), step
