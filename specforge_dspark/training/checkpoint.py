"""Training checkpoints: DeepSpeed's own files plus our state, complete-or-absent.

Layout of one checkpoint, `<checkpoint.dir>/step-<N>/`:
    mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt   DeepSpeed (weights, sharded
                                                                 optimizer, lr scheduler)
    rank<r>_state.pt      per rank: data cursor and torch / numpy / python RNG states
    train_state.json      rank 0: step, micro step, epoch, world size, grad_accum, format
                          version, the full recipe and its hash, and the run's fingerprint
    COMPLETE              written last, after every rank has finished writing

A directory without COMPLETE does not count: `--resume auto` skips it, and a crash in
the middle of a save leaves the previous checkpoint untouched, and a save that fails
(disk full, permissions, I/O) raises CheckpointWriteError on every rank, naming the path
and the bytes needed, after removing its partial directory and pruning nothing.

The fingerprint (fingerprint.py) pins what the recipe alone does not: `features` (the
target's files, quantization, dtype and aux tap convention: what the features ARE,
whichever backend serves them) and `data` (the content of the prepared training rows). A
resume that changes either is refused, naming the field.

A checkpoint saved on W ranks resumes on W' others (repartition.py): the ZeRO optimizer
state is re-partitioned, train.grad_accum becomes the one that keeps the global batch, and
the data cursor (samples of the epoch trained, data_order.py) continues the same epoch.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from specforge_dspark.config.recipe import Recipe
from specforge_dspark.training.ckpt_files import (
    MARKER,
    CheckpointWriteError,
    atomic_write,
    attempt,
    barrier,
    check_written,
    fresh_dir,
    is_complete,
    latest_complete,
    list_checkpoints,
    prune,
    step_dir,
    to_bytes,
)
from specforge_dspark.training.repartition import (
    ResumeLayout,
    load_zero_partitions,
    resume_layout,
)
from specforge_dspark.training.safe_load import safe_load, verify_step

__all__ = [  # what callers read from here; the step-directory helpers live in ckpt_files.py
    "CheckpointWriteError",
    "ResumeError",
    "TrainState",
    "check_compatible",
    "check_saved",
    "is_complete",
    "latest_complete",
    "list_checkpoints",
    "load",
    "resolve_resume",
    "save",
    "step_dir",
]

FORMAT_VERSION = 2  # 2: train_state.json holds the fingerprint

# Recipe keys (dotted prefixes) that may differ on resume: they change where things are
# written, how fast features arrive or what is logged, never the training math.
MAY_CHANGE_ON_RESUME = (
    "train.log_interval",
    "train.eval_interval",
    "train.output_dir",
    "train.max_nonfinite_steps",
    "dist.sequence_parallel",  # the same update on any split of a sequence's positions
    "train.preflight_samples",
    "checkpoint.",
    "tracking.",
    "export.",
    "objective.decode_chunk_size",  # the same loss and gradients, chunked or recomputed
    "objective.recompute",
    "target.prefetch",
    "target.timeout_s",
    "target.max_restarts",
    "target.restart_backoff_s",
    "target.device",
    "target.backend",
    "target.offline_dir",
    "target.sglang.",
    "target.vllm.",
    "data.num_proc",
    "data.cache_dir",
    "data.regenerate.",
    "dist.backend",
    "dist.timeout_s",
    "dist.deterministic",
)


class ResumeError(RuntimeError):
    """The checkpoint cannot continue this run; the message names the field."""


@dataclass
class TrainState:
    """Where training stands; `micro_step` is the count of micro-batches each rank consumed."""

    step: int = 0
    micro_step: int = 0
    epoch: int = 0
    epoch_samples: int = -1
    """Samples of this epoch's order trained, all ranks together (data_order.py); -1 in
    checkpoints older than it (derived from micro_step: `data_order.restore_cursor`)."""
    grad_accum: int = 0
    """The train.grad_accum the run steps with: the recipe's, unless a resume on another
    world size kept the global batch with another (repartition.py); 0 in older checkpoints."""
    tokens: int = 0
    nonfinite_steps: int = 0
    """Optimizer steps skipped for a non-finite loss or gradient (nonfinite.py)."""
    nonfinite_samples: int = 0
    """Samples not trained on for non-finite target features."""
    log_window: list[dict[str, float]] = field(default_factory=list)
    """Metrics of the micro-steps since the last logged step (the same on every rank: the
    objective pools them): carried across a stop, so that the first step logged after a
    resume averages over the same micro-steps as in an uninterrupted run."""
    log_tokens: int = 0
    """`tokens` at the last logged step (tokens_per_s counts from there)."""


def resolve_resume(arg: str | None, root: Path) -> Path | None:
    """`auto` -> latest complete under root (or None); a path -> that checkpoint."""
    if not arg or arg == "none":
        return None
    if arg == "auto":
        return latest_complete(root)
    path = Path(arg)
    if not path.is_dir():
        raise ResumeError(f"--resume {arg}: no such checkpoint directory")
    if not is_complete(path):
        raise ResumeError(f"--resume {arg}: checkpoint is incomplete (no {MARKER} marker)")
    return path


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and not key.endswith(("server_args", "chat_template_kwargs")):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def check_compatible(
    saved: dict[str, Any],
    recipe: Recipe,
    world_size: int,
    path: Path,
    fingerprint: dict[str, Any] | None = None,
) -> ResumeLayout:
    """Refuse a resume that would not continue the same training; names the field.
    Returns the layout of the global batch on `world_size` ranks: another world size is
    re-partitioned, and train.grad_accum may differ from the saved one only to keep the
    saved global batch (`repartition.resume_layout`).

    `fingerprint`: this run's {"features": ..., "data": ...} (`features_fingerprint`,
    `data_fingerprint`); only the sections it holds are compared."""
    if saved.get("format_version") != FORMAT_VERSION:
        raise ResumeError(
            f"{path}: checkpoint format_version {saved.get('format_version')} != "
            f"{FORMAT_VERSION} of this code; it cannot be resumed exactly"
        )
    train = saved["recipe"]["train"]
    saved_sp = saved["recipe"]["dist"].get("sequence_parallel", 1)
    sp = recipe.dist.sequence_parallel
    try:  # the data cursor follows the data-parallel ranks; ZeRO's partitions every rank
        layout = resume_layout(
            saved["world_size"] // saved_sp,
            saved.get("grad_accum") or train["grad_accum"],
            train["micro_batch_size"],
            world_size // sp,
            recipe.dist.zero_stage,
            saved["world_size"],
            world_size,
        )
    except ValueError as e:
        raise ResumeError(f"{path}: {e}") from None
    old, new = _flatten(saved["recipe"]), _flatten(recipe.to_dict())
    for k, v in _flatten(Recipe().to_dict()).items():  # a key added since, at its default
        if k not in old and new.get(k) == v:
            old[k] = v
    changed = [
        k
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
        and not k.startswith(MAY_CHANGE_ON_RESUME)
        and not (k == "train.grad_accum" and new[k] == layout.grad_accum)  # batch kept
    ]
    if changed:
        detail = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise ResumeError(
            f"{path}: the recipe changed in a way that alters training ({detail}). "
            "Resume with the original values or start a new run (another train.output_dir)."
        )
    _check_fingerprint(saved.get("fingerprint") or {}, fingerprint or {}, path)
    return layout


def _check_fingerprint(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    old = _flatten({k: saved.get(k) for k in current})
    new = _flatten(current)
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if changed:
        detail = "; ".join(f"{k} changed: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise ResumeError(
            f"{path}: the target's features or the training data differ from this "
            f"checkpoint's ({detail}). Resume with the original target and data or start a "
            "new run (another train.output_dir)."
        )


def check_saved(
    path: Path, recipe: Recipe, world_size: int, fingerprint: dict[str, Any] | None = None
) -> ResumeLayout:
    """`check_compatible` against the checkpoint at `path`."""
    meta_file = path / "train_state.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResumeError(f"{meta_file}: unreadable checkpoint metadata ({e})") from None
    return check_compatible(meta, recipe, world_size, path, fingerprint)


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }  # cuda: the generator of this rank's own device only (restore_cuda_rng)


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    restore_cuda_rng(s.get("cuda"))


def restore_cuda_rng(saved: torch.Tensor | list[torch.Tensor] | None) -> None:
    """Restore this rank's CUDA generator from what its rank file holds: the state of the
    device it ran on, or (format 2 checkpoints before this change) one state per device
    then visible, of which the entry of this rank's own device is taken (modulo the
    saved count). A resume where fewer GPUs are visible than at save never indexes a
    device that is not there; on a host without CUDA the saved state is unused."""
    if saved is None or not torch.cuda.is_available():
        return
    device = torch.cuda.current_device()
    if isinstance(saved, list | tuple):
        saved = saved[device % len(saved)]
    torch.cuda.set_rng_state(saved, device)


def save(
    engine,
    root: Path,
    state: TrainState,
    recipe: Recipe,
    keep_last: int,
    fingerprint: dict[str, Any],
) -> Path:
    """Collective: every rank calls it. Returns the step directory. `fingerprint`: see
    `check_compatible`.

    A write that fails on any rank (disk full, permissions, I/O error) raises
    CheckpointWriteError on every rank, naming the path and the bytes needed, once the
    partial directory is removed; nothing is pruned, so the previous checkpoint stays
    complete and `--resume auto` continues from it. Every rank passes the same
    collectives whichever rank fails, so none is left waiting."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    path = step_dir(root, state.step)
    failed = attempt(fresh_dir, path) if rank == 0 else None
    check_written(failed, engine, root, path)
    failed = attempt(engine.save_checkpoint, str(root), tag=path.name, save_latest=False)
    if failed is not None:
        barrier()  # the barrier DeepSpeed's save ends with, where the others wait
    else:
        rank_state = {"train_state": asdict(state), "rng": rng_state()}
        rank_file = path / f"rank{rank:05d}_state.pt"
        failed = attempt(atomic_write, rank_file, to_bytes(rank_state))
    check_written(failed, engine, root, path)
    if rank == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "world_size": world,
            "recipe_hash": recipe.section_hash(),
            "recipe": recipe.to_dict(),
            "fingerprint": fingerprint,
            **asdict(state),
        }
        failed = attempt(
            atomic_write, path / "train_state.json", json.dumps(meta, indent=1).encode()
        )
        failed = failed or attempt(atomic_write, path / MARKER, b"")
    check_written(failed, engine, root, path)
    if rank == 0:
        prune(root, keep_last)
    barrier()
    return path


def load(engine, path: Path, recipe: Recipe, fingerprint: dict[str, Any]) -> TrainState:
    """Collective: restore weights, optimizer, scheduler, RNG and data cursor from `path`
    (after `check_saved` with this run's `fingerprint`).

    Saved on another world size: the ZeRO optimizer state is re-partitioned
    (repartition.py), and rank r takes the RNG states and rank-local counters (tokens) of
    saved rank r mod W; they drive no training math (anchors are seeded per seed, rank
    and micro step), so the equality that holds across the switch is the optimizer state
    and the samples still to train, not the later losses of an uninterrupted run."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = check_saved(path, recipe, world, fingerprint)
    verify_step(path)  # DeepSpeed's loader below would run code a file holds
    load_path, _ = engine.load_checkpoint(
        str(path.parent),
        tag=path.name,
        load_optimizer_states=not layout.changed,
        load_lr_scheduler_states=True,
    )
    if load_path is None:
        raise ResumeError(f"{path}: DeepSpeed could not load this checkpoint")
    if layout.changed:
        load_zero_partitions(engine, path)
    rank_file = path / f"rank{rank % layout.saved_ranks:05d}_state.pt"
    if not rank_file.is_file():
        raise ResumeError(f"{path}: missing {rank_file.name}")
    rank_state = safe_load(rank_file)
    set_rng_state(rank_state["rng"])
    return TrainState(**rank_state["train_state"])
