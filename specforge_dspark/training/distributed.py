"""Process group, DeepSpeed configuration and the LR schedule of a training run.

torchrun's environment (or a single process) gives rank and world size; gloo on CPU,
NCCL on GPU. DeepSpeed steps the draft with torch's AdamW (no JIT-compiled optimizer).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from datetime import timedelta

import torch

from specforge_dspark.config.recipe import Recipe
from specforge_dspark.config.validate import dist_timeout_s


def init_distributed(recipe: Recipe) -> tuple[int, int, torch.device]:
    """torchrun's env (or a single process); gloo on CPU, NCCL on GPU. Collectives time
    out after config.validate.dist_timeout_s; with several ranks a gloo group for
    `wait_for_every_rank` is made here too (group creation is collective)."""
    import deepspeed
    import torch.distributed as dist

    skip_deepspeed_shm_build()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    cuda = torch.cuda.is_available() and recipe.dist.backend != "gloo"
    backend = recipe.dist.backend if recipe.dist.backend != "auto" else ("nccl" if cuda else "gloo")
    local = int(os.environ["LOCAL_RANK"])
    if recipe.dist.deterministic:  # before the first cuBLAS call
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if cuda:
        torch.cuda.set_device(local)
    deepspeed.init_distributed(
        dist_backend=backend, timeout=timedelta(seconds=dist_timeout_s(recipe))
    )
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    global _STARTUP_GROUP
    if dist.get_world_size() > 1:
        wait_s = startup_timeout_s(recipe) + dist_timeout_s(recipe)
        _STARTUP_GROUP = dist.new_group(backend="gloo", timeout=timedelta(seconds=wait_s))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device


def check_world(recipe: Recipe, world: int) -> int:
    """dist.sequence_parallel, once checked to divide `world` (ValueError naming both)."""
    P = recipe.dist.sequence_parallel
    if world % P:
        raise ValueError(
            f"dist.sequence_parallel={P} does not divide the world size {world}: every "
            f"sequence needs {P} ranks; launch a multiple of {P} ranks"
        )
    return P


def sequence_shard(recipe: Recipe, rank: int, world: int):
    """Collective when dist.sequence_parallel P > 1: the groups of P consecutive ranks that
    share each sequence (every rank creates every group), and this rank's place in its own
    (`objective.sequence_parallel.SeqShard`); None when P is 1. ValueError when P does not
    divide the world size."""
    import torch.distributed as dist

    from specforge_dspark.objective.sequence_parallel import SeqShard

    P = check_world(recipe, world)
    if P == 1:
        return None
    groups = [dist.new_group(list(range(g, g + P))) for g in range(0, world, P)]
    return SeqShard(groups[rank // P], rank % P, P)


_STARTUP_GROUP = None
"""The gloo group of `wait_for_every_rank` (None: one rank, or not initialised)."""


def startup_timeout_s(recipe: Recipe) -> float:
    """How long a rank may wait for its node's target server to answer at start-up."""
    t = recipe.target
    if t.backend == "sglang":
        return t.sglang.startup_timeout_s
    if t.backend == "vllm":
        return t.vllm.startup_timeout_s
    return 0.0


def wait_for_every_rank() -> None:
    """Barrier after each rank's target server answered: every node's server may take up
    to its startup_timeout_s, longer than the process-group timeout, so the first training
    collective must not be where a fast node waits for a slow one. This barrier's group
    times out at startup_timeout_s + the process-group timeout."""
    import torch.distributed as dist

    if _STARTUP_GROUP is not None:
        dist.barrier(group=_STARTUP_GROUP)


def skip_deepspeed_shm_build() -> None:
    """DeepSpeed JIT-compiles a CPU shared-memory comm op (minutes) that gloo never needs.

    `deepspeed.comm.torch` is shadowed by torch as an attribute of `deepspeed.comm`, so
    the module is patched through sys.modules.
    """
    mod = importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    del mod


def deepspeed_config(recipe: Recipe, device: torch.device, grad_accum: int = 0) -> dict:
    """`grad_accum`: the run's, when a resume on another world size changed it (else 0:
    train.grad_accum)."""
    bf16 = recipe.dist.precision == "bf16" or (
        recipe.dist.precision == "auto" and device.type == "cuda"
    )
    return {
        "train_micro_batch_size_per_gpu": recipe.train.micro_batch_size,
        "gradient_accumulation_steps": grad_accum or recipe.train.grad_accum,
        "gradient_clipping": recipe.optim.grad_clip,
        "zero_optimization": {"stage": recipe.dist.zero_stage},
        # skip a step whose gradient norm is non-finite (nonfinite.py; fp32 ZeRO always does)
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }


def lr_lambda(recipe: Recipe, total_steps: int):
    o = recipe.optim
    warm = int(round(o.warmup_ratio * total_steps))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if o.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f
