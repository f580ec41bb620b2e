"""Training checkpoints: DeepSpeed's own files plus our state, complete-or-absent.

Layout of one checkpoint, `<checkpoint.dir>/step-<N>/`:
    mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt   DeepSpeed (weights, sharded
                                                                 optimizer, lr scheduler)
    rank<r>_state.pt      per rank: data cursor and torch / numpy / python RNG states
    train_state.json      rank 0: step, micro step, epoch, world size, format version,
                          the full recipe and its hash
    COMPLETE              written last, after every rank has finished writing

A directory without COMPLETE does not count: `--resume auto` skips it, and a crash in
the middle of a save leaves the previous checkpoint untouched.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from specforge_dspark.recipe import Recipe

FORMAT_VERSION = 1
MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")

# Recipe keys (dotted prefixes) that may differ on resume: they change where things are
# written, how fast features arrive or what is logged, never the training math.
MAY_CHANGE_ON_RESUME = (
    "train.log_interval",
    "train.eval_interval",
    "train.output_dir",
    "checkpoint.",
    "tracking.",
    "export.",
    "target.prefetch",
    "target.timeout_s",
    "target.device",
    "target.backend",
    "target.offline_dir",
    "target.sglang.",
    "data.num_proc",
    "data.cache_dir",
    "data.regenerate.",
    "dist.backend",
)


class ResumeError(RuntimeError):
    """The checkpoint cannot continue this run; the message names the field."""


@dataclass
class TrainState:
    """Where training stands; `micro_step` is the global count of micro-batches consumed."""

    step: int = 0
    micro_step: int = 0
    epoch: int = 0
    tokens: int = 0


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every step directory under root, complete or not, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_complete(root: Path) -> Path | None:
    complete = [p for _, p in list_checkpoints(root) if is_complete(p)]
    return complete[-1] if complete else None


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


def check_compatible(saved: dict[str, Any], recipe: Recipe, world_size: int, path: Path) -> None:
    """Refuse a resume that would not continue the same training; names the field."""
    if saved.get("format_version") != FORMAT_VERSION:
        raise ResumeError(
            f"{path}: checkpoint format_version {saved.get('format_version')} != "
            f"{FORMAT_VERSION} of this code; it cannot be resumed exactly"
        )
    if saved.get("world_size") != world_size:
        raise ResumeError(
            f"{path}: saved with world_size {saved.get('world_size')}, resuming with "
            f"{world_size}; the data order and optimizer shards depend on it"
        )
    old, new = _flatten(saved["recipe"]), _flatten(recipe.to_dict())
    changed = [
        k
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and not k.startswith(MAY_CHANGE_ON_RESUME)
    ]
    if changed:
        detail = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise ResumeError(
            f"{path}: the recipe changed in a way that alters training ({detail}). "
            "Resume with the original values or start a new run (another train.output_dir)."
        )


def check_saved(path: Path, recipe: Recipe, world_size: int) -> None:
    """`check_compatible` against the checkpoint at `path`."""
    meta_file = path / "train_state.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResumeError(f"{meta_file}: unreadable checkpoint metadata ({e})") from None
    check_compatible(meta, recipe, world_size, path)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save(engine, root: Path, state: TrainState, recipe: Recipe, keep_last: int) -> Path:
    """Collective: every rank calls it. Returns the step directory."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    path = step_dir(root, state.step)
    if rank == 0 and path.exists():  # a stale partial save of the same step
        shutil.rmtree(path)
    _barrier()
    engine.save_checkpoint(str(root), tag=path.name, save_latest=False)
    rank_state = {"train_state": asdict(state), "rng": rng_state()}
    buf = _to_bytes(rank_state)
    _atomic_write(path / f"rank{rank:05d}_state.pt", buf)
    _fault_drill(state.step)
    _barrier()
    if rank == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "world_size": world,
            "recipe_hash": recipe.section_hash(),
            "recipe": recipe.to_dict(),
            **asdict(state),
        }
        _atomic_write(path / "train_state.json", json.dumps(meta, indent=1).encode())
        _atomic_write(path / MARKER, b"")
        prune(root, keep_last)
    _barrier()
    return path


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; drop partial saves older than them."""
    ckpts = list_checkpoints(root)
    complete = [s for s, p in ckpts if is_complete(p)]
    keep = set(complete[-keep_last:])
    newest = complete[-1] if complete else -1
    for s, p in ckpts:
        if s not in keep and (is_complete(p) or s < newest):
            shutil.rmtree(p, ignore_errors=True)


def load(engine, path: Path, recipe: Recipe) -> TrainState:
    """Collective: restore weights, optimizer, scheduler, RNG and data cursor from `path`."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_saved(path, recipe, world)
    load_path, _ = engine.load_checkpoint(
        str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if load_path is None:
        raise ResumeError(f"{path}: DeepSpeed could not load this checkpoint")
    rank_file = path / f"rank{rank:05d}_state.pt"
    if not rank_file.is_file():
        raise ResumeError(f"{path}: missing {rank_file.name}")
    rank_state = torch.load(rank_file, weights_only=False)
    set_rng_state(rank_state["rng"])
    return TrainState(**rank_state["train_state"])


def _fault_drill(step: int) -> None:
    """SPECFORGE_KILL_DURING_SAVE=N: SIGKILL this process while saving step N, after the
    weights are written and before the marker (a preemption drill for tests and operators)."""
    if os.environ.get("SPECFORGE_KILL_DURING_SAVE") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def _to_bytes(obj: Any) -> bytes:
    import io

    bio = io.BytesIO()
    torch.save(obj, bio)
    return bio.getvalue()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
