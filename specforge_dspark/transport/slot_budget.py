"""A trainer rank's feature slots at start-up: their budget, their names, the check that
they fit in /dev/shm, and the sweep of a crashed run's leftovers (slots: shm.py).

Budget (`request_budget`): the most one target request of the run can hold. A request
is one micro-batch (train.micro_batch_size rows; with data.pack that many packs, each
conversation of them its own sequence), a capture batch (target.batch_size rows) or one
eval row, every row or pack at most data.max_length tokens. Slots are ragged (shm.py), so
a request's bytes are its tokens', and a request never holds more than

    tokens = data.max_length x max(train.micro_batch_size, target.batch_size)
    seqs   = max(train.micro_batch_size, target.batch_size, train.preflight_samples),
             or `tokens` with data.pack (a conversation has at least one token)

`make_slots` prints it with the bytes of a slot at that size, checks that the slots of
every rank of the node fit, and gives each slot the budget: a request over it is refused
before anything is written (shm.ShmSlot.prepare), naming these keys.

Job id (`job_id`): slot files are named `<FILE_PREFIX><job>-<pid>-...`, the job a hash of
the host name and the run's output directory (one job per output_dir: lifecycle.py). Two
jobs sharing /dev/shm (docker --ipc=host) have separate process-id namespaces, where a
live process of the other looks dead: the sweep only judges files of its own job, and
unlinks only those it can lock exclusively (a live slot holds a shared flock, shm.py),
so two containers with the same host name and output_dir never sweep each other's.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

from specforge_dspark.transport.fp8_rows import FP8
from specforge_dspark.transport.shm import FILE_PREFIX, SHM_DIR, ShmSlot, SlotBudget, SlotLayout

SHM_HINT = (
    "raise it (docker run --shm-size=<N>g, Kubernetes: an emptyDir with medium: Memory "
    "mounted at /dev/shm) or lower train.micro_batch_size, data.max_length or target.prefetch"
)


def request_budget(recipe) -> SlotBudget:
    """The most one target request of `recipe`'s run can hold (module docstring)."""
    mb, tb, L = recipe.train.micro_batch_size, recipe.target.batch_size, recipe.data.max_length
    rows = max(mb, tb)
    tokens = rows * L
    keys = f"data.max_length={L} x max(train.micro_batch_size={mb}, target.batch_size={tb})"
    if recipe.data.pack:
        return SlotBudget(tokens, tokens, f"{keys}, data.pack")
    return SlotBudget(tokens, max(rows, recipe.train.preflight_samples), keys)


def wire_dtype(recipe) -> torch.dtype:
    """The dtype of a slot's rows: target.transport_dtype fp8_e4m3 (the aux rows fp8 with
    a scale per (row, aux layer), the last hidden rows bfloat16: shm.py), else
    target.dtype."""
    from specforge_dspark.transport.features import DTYPES

    return FP8 if recipe.target.transport_dtype == "fp8_e4m3" else DTYPES[recipe.target.dtype]


def slot_bytes(recipe, aux_width: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of one slot at the run's request budget (its largest size)."""
    budget = request_budget(recipe)
    return SlotLayout.plan(budget.tokens, budget.seqs, aux_width, hidden, dtype).nbytes


def job_id(recipe) -> str:
    """This job's part of its slot names (module docstring): 10 hex digits."""
    where = f"{os.uname().nodename}:{Path(recipe.train.output_dir).resolve()}"
    return hashlib.sha1(where.encode()).hexdigest()[:10]


def make_slots(
    rank: int,
    num_slots: int,
    aux_width: int,
    hidden: int,
    dtype: torch.dtype,
    recipe,
    say=None,
    exposer=None,
) -> list[ShmSlot]:
    """The `num_slots` slots of one trainer rank, each bounded by the run's request
    budget, after checking that those of every rank on this node fit in SHM_DIR at that
    size, so a small /dev/shm fails at start-up with the size it needs instead of with
    SIGBUS mid-run. Rank 0 `say`s the budget (default: a line on stderr, with the
    engine's other start-up messages). `exposer`: shm.ShmSlot's (target.transport)."""
    budget, job = request_budget(recipe), job_id(recipe)
    per_slot = slot_bytes(recipe, aux_width, hidden, dtype)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    need = per_slot * num_slots * local
    free = shutil.disk_usage(SHM_DIR).free + _ours_bytes(job)
    sizes = (
        f"{local} rank(s) x {num_slots} slots x {per_slot / 2**20:.1f} MiB ({per_slot} bytes) "
        f"for {budget.tokens} tokens / {budget.seqs} sequences ({budget.keys}) of aux width "
        f"{aux_width} + hidden {hidden}"
    )
    if need > free:
        raise RuntimeError(
            f"shared memory: feature slots need {need / 2**30:.2f} GiB in {SHM_DIR} "
            f"({sizes}), {free / 2**30:.2f} GiB free: {SHM_HINT}"
        )
    if rank == 0:
        say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        say(f"feature slots: at most {need / 2**30:.2f} GiB in {SHM_DIR} ({sizes}; job {job})")
    return [
        ShmSlot(f"r{rank}s{i}", aux_width, hidden, dtype, budget, job, exposer)
        for i in range(num_slots)
    ]


def _ours_bytes(job: str) -> int:
    """Bytes already held by slots of this process (they are replaced, not added)."""
    total = 0
    for path in SHM_DIR.glob(f"{FILE_PREFIX}{job}-{os.getpid()}-*"):
        try:
            total += path.stat().st_size
        except OSError:
            continue
    return total


def sweep_stale_slots(job: str) -> list[Path]:
    """Unlink slot files of job `job` (same uid) whose creating process is gone, e.g.
    after a SIGKILL, so a crashed run does not keep holding shared memory; returns them.
    Other jobs' files are never judged, and a file another process holds locked (a live
    slot, maybe of a process in another pid namespace) is left alone (module docstring)."""
    swept = []
    for path in SHM_DIR.glob(f"{FILE_PREFIX}{job}-*"):
        try:
            pid = int(path.name[len(FILE_PREFIX) :].split("-", 2)[1])
            if path.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            if _unlink_unlocked(path):
                swept.append(path)
        except (ValueError, IndexError, OSError):
            continue  # not ours to judge: malformed name, vanished, or another user's pid
    return swept


def _unlink_unlocked(path: Path) -> bool:
    """Unlink `path` when no process holds a lock on it (we take it exclusively first)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # locked: a live slot
    else:
        path.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)
