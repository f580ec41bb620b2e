"""Faults injected from the test side into a training run's processes.

A drill sets one or more of the variables below and starts `torchrun ... train.py` with
`environment()`, which puts this folder first on PYTHONPATH; `sitecustomize.py` then calls
`install()` at every process start. When a product module named in `_HOOKS` is imported,
its functions are wrapped; nothing of the product reads these variables. Each injected
fault prints a `[drill] ...` line on stderr when it lands, so that a drill can assert that
it lived through the fault it asked for.

    SPECFORGE_KILL_DURING_SAVE=N        SIGKILL every rank while saving step N, after its
                                        own files are written and before the marker.
    SPECFORGE_CKPT_FSIZE=N:BYTES[@R]    while saving step N, rank R (every rank when @R is
                                        left out) may write no file over BYTES (RLIMIT_FSIZE,
                                        SIGXFSZ ignored: a write fails with EFBIG).
    SPECFORGE_INJECT_NAN=loss:5,features:7,grad:9-,loss:3@1
                                        a NaN loss at optimizer step 5, NaN features in every
                                        sample of micro-batch 7, NaN gradients from step 9 on,
                                        a NaN loss at step 3 on rank 1. Steps and micro-batches
                                        count from 1; "N-" means N onwards, "N-M" N to M; the
                                        rank defaults to 0.
    SPECFORGE_TRAINED_IDS=<dir>         append each micro-batch's sample ids to
                                        <dir>/rank<r>.jsonl in training order, with
                                        `trained` false for a skipped update.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import json
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
KILL = "SPECFORGE_KILL_DURING_SAVE"
FSIZE = "SPECFORGE_CKPT_FSIZE"
NAN = "SPECFORGE_INJECT_NAN"
IDS = "SPECFORGE_TRAINED_IDS"
VARIABLES = (KILL, FSIZE, NAN, IDS)
_ITEM = re.compile(r"^(loss|features|grad):(\d+)(-(\d*))?(@(\d+))?$")


def environment(base: dict[str, str]) -> dict[str, str]:
    """`base` with this folder first on PYTHONPATH (the drills' processes load it)."""
    path = os.pathsep.join(p for p in (str(HERE), base.get("PYTHONPATH")) if p)
    return {**base, "PYTHONPATH": path}


def report(what: str) -> None:
    print(f"[drill] {what}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- install


def install() -> None:
    """Wrap the product functions the set variables need, once their module is imported."""
    if not any(os.environ.get(v) for v in VARIABLES):
        return
    sys.meta_path.insert(0, _AfterImport(_HOOKS))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds a hooked module like the path finder would, and runs its hook right after the
    module's own code."""

    def __init__(self, hooks):
        self.hooks = hooks

    def find_spec(self, name, path, target=None):
        hook = self.hooks.get(name)
        spec = hook and importlib.machinery.PathFinder.find_spec(name, path)
        if not spec:
            return None
        exec_module = spec.loader.exec_module

        def run(module):
            exec_module(module)
            hook(module)

        spec.loader.exec_module = run
        return spec


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


# --------------------------------------------------------------------------- checkpoints


def _patch_checkpoint(ckpt) -> None:
    """Kill while saving (wraps the file writer), limit file sizes (wraps `save`)."""
    if os.environ.get(KILL):
        step_name = f"step-{int(os.environ[KILL])}"
        write = ckpt.atomic_write

        def write_then_die(path: Path, data: bytes) -> None:
            write(path, data)
            if path.parent.name == step_name and path.name.startswith("rank"):
                report(f"rank {_rank()}: SIGKILL while saving {step_name}, before its marker")
                os.kill(os.getpid(), signal.SIGKILL)

        ckpt.atomic_write = write_then_die
    m = re.match(r"^(\d+):(\d+)(@(\d+))?$", os.environ.get(FSIZE, ""))
    if os.environ.get(FSIZE) and m is None:
        raise ValueError(f"{FSIZE}: cannot parse {os.environ[FSIZE]!r} (N:BYTES[@RANK])")
    if m is not None:
        save = ckpt.save
        step, limit, only = int(m.group(1)), int(m.group(2)), m.group(4)

        def limited_save(engine, root, state, *args, **kwargs):
            rank = _rank()
            if state.step != step or only not in (None, str(rank)):
                return save(engine, root, state, *args, **kwargs)
            import resource

            old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
            report(f"rank {rank}: files limited to {limit} bytes while saving step {step}")
            try:
                return save(engine, root, state, *args, **kwargs)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
                signal.signal(signal.SIGXFSZ, old_handler)

        ckpt.save = limited_save


# --------------------------------------------------------------------------- non-finite


@dataclass
class Injection:
    """Parsed SPECFORGE_INJECT_NAN for one rank: kind -> [(first, last)] (last 0: open)."""

    ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    @staticmethod
    def parse(spec: str, rank: int) -> Injection:
        out = Injection()
        for item in filter(None, (s.strip() for s in spec.split(","))):
            m = _ITEM.match(item)
            if m is None:
                raise ValueError(f"{NAN}: cannot parse {item!r} (kind:N[-[M]][@rank])")
            first = int(m.group(2))
            last = first if m.group(3) is None else int(m.group(4) or 0)
            if int(m.group(6) or 0) == rank:
                out.ranges.setdefault(m.group(1), []).append((first, last))
        return out

    def hits(self, kind: str, n: int) -> bool:
        return any(a <= n and (b == 0 or n <= b) for a, b in self.ranges.get(kind, []))


def _nan_grad():
    import torch

    class NanGrad(torch.autograd.Function):
        """Identity forward, NaN gradient backward."""

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return torch.full_like(g, float("nan"))

    return NanGrad


def _patch_nonfinite(nonfinite) -> None:
    """NaN features (wraps `screen`), NaN loss and gradients (wrap `check`), and the record
    of trained sample ids (wraps `check`, which sees every trained micro-batch once)."""
    guard = nonfinite.NonFiniteGuard
    spec = os.environ.get(NAN, "").strip()
    if spec:
        Injection.parse(spec, 0)  # a typo fails at start-up, not silently
        screen, check, nan_grad = guard.screen, guard.check, _nan_grad()

        def poisoned_screen(self, feats, micro_step: int, group=None):
            if Injection.parse(spec, self.rank).hits("features", micro_step + 1):
                aux = feats.aux_hidden.clone()
                aux[:, 0, 0] = float("nan")
                feats = dataclasses.replace(feats, aux_hidden=aux)
                report(f"rank {self.rank}: NaN features in micro-batch {micro_step + 1}")
            return screen(self, feats, micro_step, group)

        def poisoned_check(self, loss, sample_ids, micro_step: int, boundary: bool):
            inj, step = Injection.parse(spec, self.rank), micro_step // self.grad_accum + 1
            if inj.hits("loss", step):
                loss = loss * float("nan")
                report(f"rank {self.rank}: NaN loss at step {step}")
            out = check(self, loss, sample_ids, micro_step, boundary)
            if out is not None and inj.hits("grad", step):
                report(f"rank {self.rank}: NaN gradient at step {step}")
                out = nan_grad.apply(out)
            return out

        guard.screen, guard.check = poisoned_screen, poisoned_check
    if os.environ.get(IDS):
        where, inner = Path(os.environ[IDS]), guard.check

        def recorded_check(self, loss, sample_ids, micro_step: int, boundary: bool):
            out = inner(self, loss, sample_ids, micro_step, boundary)
            record = {"micro_step": micro_step + 1, "sample_ids": list(sample_ids)}
            with open(where / f"rank{self.rank}.jsonl", "a") as f:
                f.write(json.dumps({**record, "trained": out is not None}) + "\n")
            return out

        guard.check = recorded_check


_HOOKS = {
    "specforge_dspark.training.checkpoint": _patch_checkpoint,
    "specforge_dspark.training.nonfinite": _patch_nonfinite,
}
