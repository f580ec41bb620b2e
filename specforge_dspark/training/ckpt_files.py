"""Checkpoint step directories on disk: complete-or-absent, written so that a failure on
any rank removes the partial save, prunes nothing and says what was needed (checkpoint.py
decides what goes in them)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


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


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message names the path and the bytes needed."""


def fresh_dir(path: Path) -> None:
    """No stale partial save of the same step, and the root exists (so that DeepSpeed's
    own first write is a file inside it, past its collectives' first barrier)."""
    if path.exists():
        remove(path)
    path.parent.mkdir(parents=True, exist_ok=True)


def attempt(fn, *args, **kwargs) -> Exception | None:
    """Run one write; its error (torch's writer raises RuntimeError) is returned, not
    raised, so that the rank still reaches the collectives the others are in."""
    try:
        fn(*args, **kwargs)
    except (OSError, RuntimeError) as e:
        return e
    return None


def check_written(failed: Exception | None, engine, root: Path, path: Path) -> None:
    """Collective: if a write failed on any rank, remove the partial `path` and raise
    CheckpointWriteError everywhere (the failing ranks with their details)."""
    if not _any_rank(failed is not None):
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        attempt(remove, path)  # best effort: the missing marker already voids it
    barrier()
    need, basis = bytes_needed(engine, root)
    free = shutil.disk_usage(root).free if root.is_dir() else 0
    prev = latest_complete(root)
    what = (
        f"rank {rank}: {_describe(failed)}"
        if failed is not None
        else "another rank (see its error)"
    )
    raise CheckpointWriteError(
        f"checkpoint {path}: writing failed on {what}. It needs about {need:,} bytes "
        f"({basis}); {free:,} bytes free in {root}{_likely_cause(need, free)}. The partial "
        f"{path.name} was removed and nothing was pruned: "
        + (
            f"{prev} is complete, --resume auto continues from it. "
            if prev
            else "no earlier checkpoint. "
        )
        + "Free space, fix the permissions, or set checkpoint.dir to another disk."
    ) from failed


def _likely_cause(need: int, free: int) -> str:
    """torch's writer reports a short write without its errno: name what we can see."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if free < need:
        return " (not enough free space)"
    if limit != resource.RLIM_INFINITY and limit < need:
        return f" (this process may write no file over {limit:,} bytes: ulimit -f)"
    return ""


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        where = f" ({e.filename})" if e.filename else ""
        return f"{e.strerror} [errno {e.errno}]{where}"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def bytes_needed(engine, root: Path) -> tuple[int, str]:
    """About how many bytes one checkpoint takes: the size of the latest complete one,
    else the model's weights plus fp32 master weights and two Adam moments."""
    prev = latest_complete(root)
    if prev is not None:
        return sum(
            f.stat().st_size for f in prev.rglob("*") if f.is_file()
        ), f"the size of {prev.name}"
    params = list(engine.module.parameters())
    n = sum(p.numel() for p in params)
    weights = sum(p.numel() * p.element_size() for p in params)
    return weights + 12 * n, "weights + fp32 master weights and Adam moments, estimated"


def _any_rank(flag: bool) -> bool:
    """Collective (also a barrier): whether `flag` is set on any rank."""
    if not dist.is_initialized():
        return flag
    cuda = dist.get_backend() == "nccl"
    t = torch.tensor([float(flag)], device=f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; drop partial saves older than them."""
    for leftover in root.glob(".deleting-step-*"):  # a prune a crash interrupted
        shutil.rmtree(leftover, ignore_errors=True)
    ckpts = list_checkpoints(root)
    complete = [s for s, p in ckpts if is_complete(p)]
    keep = set(complete[-keep_last:])
    newest = complete[-1] if complete else -1
    for s, p in ckpts:
        if s not in keep and (is_complete(p) or s < newest):
            remove(p)


def remove(path: Path) -> None:
    """Delete a step directory so that no reader ever sees it half gone: it is first
    renamed out of the step-N namespace (atomic), then deleted. A crash in between
    leaves a `.deleting-*` folder, which nothing reads and the next prune removes."""
    doomed = path.with_name(f".deleting-{path.name}-{os.getpid()}")
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def to_bytes(obj: Any) -> bytes:
    import io

    bio = io.BytesIO()
    torch.save(obj, bio)
    return bio.getvalue()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
