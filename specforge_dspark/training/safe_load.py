"""Reading checkpoint files without running code from them.

A `.pt` file is a pickle, and unpickling may call any function its author named (a
`__reduce__` that writes files, starts processes). Every checkpoint file we read goes
through `safe_load`: torch's restricted unpickler (`weights_only=True`), which builds
tensors, containers and plain values only, plus the few classes DeepSpeed's and our own
files hold beside them (`checkpoint_globals`, found by saving real ZeRO-0/1/2 checkpoints
in fp32 and bf16). A file that names anything else is refused, naming the file and the
global, before anything of it runs.

DeepSpeed reads its own files with `torch.load(weights_only=False)` (its checkpoint engine,
zero_to_fp32) and takes no load function of ours, so a resume or an export first passes
every `.pt` file of the step directory through `verify_step`: memory-mapped, only each
file's pickle is read, not its tensor data.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch


def checkpoint_globals() -> list[Any]:
    """What checkpoint files may hold beside tensors and plain values (module docstring);
    DeepSpeed is imported here, not by every importer of this module."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [
        LossScaler,  # ZeRO-1/2 optimizer shards (fp32 and bf16 alike)
        ZeroStageEnum,
        fragment_address,  # the shards' param_slice_mappings
        np.ndarray,  # our rank files: numpy's RNG state
        np.dtype,
        type(np.dtype(np.uint32)),  # numpy 2's dtype class of the MT19937 key
        np.empty(0).__reduce__()[0],  # numpy's array reconstructor (named apart in numpy 1, 2)
    ]


class UnsafeCheckpoint(ValueError):
    """A checkpoint file that would run code (or build objects no checkpoint holds) when
    loaded; the message names the file."""


def safe_load(path: str | Path, **kwargs: Any) -> Any:
    """`torch.load(path, weights_only=True, **kwargs)` allowing `checkpoint_globals()`;
    UnsafeCheckpoint naming `path` and what it holds when the file names anything else."""
    with torch.serialization.safe_globals(checkpoint_globals()):
        try:
            return torch.load(path, weights_only=True, **kwargs)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL (\S+)|but got (<[^>]*>)", str(e))
            what = (found.group(1) or found.group(2)) if found else str(e).splitlines()[0]
            raise UnsafeCheckpoint(
                f"{path}: refused to load: it holds {what}, which no checkpoint of ours or "
                "DeepSpeed's holds (loading it could run code from the file); use a "
                "checkpoint written by this trainer"
            ) from None


def verify_step(step: Path) -> None:
    """Every `.pt` file of checkpoint directory `step` through `safe_load` (memory-mapped
    where the file is torch's zip format), before DeepSpeed's own loader reads them."""
    for file in sorted(step.glob("*.pt")):
        safe_load(file, map_location="cpu", mmap=zipfile.is_zipfile(file))
