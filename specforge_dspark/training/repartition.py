"""Resume a checkpoint on another number of ranks: the global batch and the ZeRO state.

The global batch (train.micro_batch_size x ranks x train.grad_accum) is kept: on W' ranks
a checkpoint saved on W ranks with grad_accum g steps with g' = W * g / W', refused when W'
does not divide W * g (`resume_layout`).

ZeRO-1/2 keeps, per parameter group, one flat fp32 buffer of the draft's parameters
(`flat_N`, DeepSpeed's order, no per-parameter padding), padded at its end to a multiple
of 2 x ranks and cut into `ranks` equal partitions of P elements: rank r holds flat
positions [r * P, (r + 1) * P). Its `*_optim_states.pt` saves that partition of the fp32
master weights (`single_partition_of_fp32_groups`, end padding stripped) and of Adam's
`exp_avg` / `exp_avg_sq` (`base_optimizer_state`, padded). So the W saved partitions,
stripped and concatenated, are the whole `flat_N`; each new rank cuts its own partition
[r' * P', (r' + 1) * P') out of them and loads the state dict DeepSpeed itself would have
saved on W' ranks through DeepSpeed's own loader, master weights included
(`load_zero_partitions`). The files are memory-mapped: a rank reads the slices it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from specforge_dspark.training.safe_load import safe_load

FP32 = "single_partition_of_fp32_groups"
BASE = "base_optimizer_state"


@dataclass(frozen=True)
class ResumeLayout:
    """How a checkpoint's global batch is laid out before and after a resume."""

    saved_world: int
    """Data-parallel ranks (ranks / dist.sequence_parallel), saved and now."""
    world: int
    saved_grad_accum: int
    grad_accum: int
    """The train.grad_accum this run steps with: it keeps the saved global batch."""
    micro_batch_size: int
    saved_ranks: int = 0
    """Every rank (the ZeRO partitions), saved and now; 0: the data-parallel ranks."""
    ranks: int = 0

    @property
    def changed(self) -> bool:
        """Whether the ZeRO state is re-partitioned."""
        return (self.saved_ranks or self.saved_world) != (self.ranks or self.world)

    def describe(self, epoch: int, left: int, n: int, recipe_grad_accum: int) -> str:
        """What a resume re-partitioned, or why it steps with another train.grad_accum
        than the recipe's (for the log); empty when neither."""
        g = self.micro_batch_size * self.world * self.grad_accum
        batch = f"the global batch of {g} (micro batch {self.micro_batch_size} x {self.world} "
        batch += f"rank(s) x {self.grad_accum})"
        if not self.changed:
            if self.grad_accum == recipe_grad_accum:
                return ""
            return (
                f"train.grad_accum {self.grad_accum}, not the recipe's {recipe_grad_accum}: "
                f"keeps {batch} of the checkpoint, saved on another world size before"
            )
        return (
            f"re-partitioned from {self.saved_ranks or self.saved_world} to "
            f"{self.ranks or self.world} rank(s): the ZeRO "
            "optimizer state (fp32 master weights, Adam moments) is re-sharded; "
            f"train.grad_accum {self.saved_grad_accum} -> {self.grad_accum} keeps {batch}; "
            f"epoch {epoch}: {left} of {n} samples left, split over {self.world} rank(s)"
        )


def resume_layout(
    saved_world: int,
    saved_grad_accum: int,
    mb: int,
    world: int,
    zero_stage: int,
    saved_ranks: int = 0,
    ranks: int = 0,
) -> ResumeLayout:
    """The layout of a resume on `world` data-parallel ranks (of `ranks` in all, when
    sequence parallelism makes them differ); ValueError (naming the keys) when no whole
    train.grad_accum keeps the global batch or the ZeRO stage cannot be re-partitioned."""
    ranks_x_accum = saved_world * saved_grad_accum
    if world != saved_world and ranks_x_accum % world:
        fits = [w for w in range(1, ranks_x_accum + 1) if ranks_x_accum % w == 0]
        raise ValueError(
            f"saved with world_size {saved_world}, resuming with {world}: its global batch "
            f"of {mb * ranks_x_accum} (train.micro_batch_size {mb} x {saved_world} rank(s) x "
            f"train.grad_accum {saved_grad_accum}) has no whole train.grad_accum on {world} "
            f"ranks. Resume on {fits} rank(s), or start a new run (another train.output_dir): "
            "changing the global batch, train.micro_batch_size or train.grad_accum changes "
            "the training"
        )
    before, after = saved_ranks or saved_world, ranks or world
    if before != after and zero_stage not in (1, 2):
        raise ValueError(
            f"saved on {before} ranks, resuming on {after}: re-partitioning supports "
            f"dist.zero_stage 1 and 2, not {zero_stage}; resume on {before} ranks"
        )
    accum = ranks_x_accum // world
    return ResumeLayout(saved_world, world, saved_grad_accum, accum, mb, saved_ranks, ranks)


def shard_files(path: Path) -> list[Path]:
    """The ZeRO optimizer shards of checkpoint `path`, in rank order."""
    files = sorted(path.glob("*zero_pp_rank_*_optim_states.pt"), key=_shard_rank)
    assert [_shard_rank(f) for f in files] == list(range(len(files))), files
    return files


def _shard_rank(f: Path) -> int:
    return int(f.name.split("zero_pp_rank_")[1].split("_")[0])


def read_shards(path: Path) -> list[dict]:
    """Every rank's ZeRO optimizer state dict (memory-mapped: only what is sliced is read)."""
    return [
        safe_load(f, map_location="cpu", mmap=True)["optimizer_state_dict"]
        for f in shard_files(path)
    ]


def load_zero_partitions(engine, path: Path) -> None:
    """Collective: load the ZeRO-1/2 optimizer state of checkpoint `path`, saved on any
    number of ranks, into this engine's partitions (after engine.load_checkpoint with
    load_optimizer_states=False has loaded the weights and the LR scheduler)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    assert isinstance(opt, DeepSpeedZeroOptimizer), type(opt)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    shards = read_shards(path)
    first = shards[0]
    assert not any(map(any, first.get("param_alignment_paddings", []))), "per-parameter padding"
    assert not any(map(any, opt.round_robin_bit16_padding)), "per-parameter padding"
    names = {id(p): n for n, p in engine.module.named_parameters()}
    state, master = {}, []
    for g, group in enumerate(first[BASE]["param_groups"]):
        here = [names[id(p)] for p in opt.round_robin_bit16_groups[g]]
        assert _saved_order(shards, g) == here, f"group {g}: another parameter order"
        size = opt.single_partition_of_fp32_groups[g].numel()  # P', end padding included
        lo, hi = rank * size, (rank + 1) * size
        pid = group["params"][0]
        sharded = sharded_keys(first, g)  # Adam's moments; "step" is the same on every rank
        state[pid] = {
            k: _padded(cut(parts(shards, g, k), lo, hi), size) if k in sharded else v
            for k, v in first[BASE]["state"][pid].items()
        }
        master.append(_padded(cut(parts(shards, g, None), lo, hi), size))
    mine = {
        **first,
        BASE: {"state": state, "param_groups": first[BASE]["param_groups"]},
        FP32: master,
        "group_paddings": list(opt.groups_padding),
        "partition_count": list(opt.partition_count),
        "param_alignment_paddings": opt.round_robin_bit16_padding,
    }
    opt.load_state_dict([mine] * world, load_optimizer_states=True, load_from_fp32_weights=True)


def parts(shards: list[dict], g: int, key: str | None) -> list[torch.Tensor]:
    """Each rank's partition of group g (`key` of Adam's state, or None: the master
    weights), end padding stripped."""
    if key is None:
        return [s[FP32][g] for s in shards]
    return [_group(s, g)[key][: s[FP32][g].numel()] for s in shards]


def _group(shard: dict, g: int) -> dict:
    return shard[BASE]["state"][shard[BASE]["param_groups"][g]["params"][0]]


def sharded_keys(shard: dict, g: int) -> list[str]:
    """Keys of group g's optimizer state that are partitions of flat_N (not scalars)."""
    return [k for k, v in _group(shard, g).items() if torch.is_tensor(v) and v.dim() > 0]


def cut(parts: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """Positions [lo, hi) of the concatenation of `parts` (clipped at its end)."""
    pieces, start = [], 0
    for t in parts:
        a, b = max(lo, start), min(hi, start + t.numel())
        if a < b:
            pieces.append(t[a - start : b - start])
        start += t.numel()
    return torch.cat(pieces) if pieces else parts[0].new_zeros(0)


def _padded(t: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(size - t.numel())]) if t.numel() < size else t.clone()


def _saved_order(shards: list[dict], g: int) -> list[str]:
    """Parameter names of group g in flat order, from the shards' param_slice_mappings."""
    seen: list[str] = []
    for s in shards:
        for name in s["param_slice_mappings"][g]:
            if not seen or seen[-1] != name:
                seen.append(name)
    return seen
