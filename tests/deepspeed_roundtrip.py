"""Save a real DeepSpeed checkpoint of a tiny model with checkpoint.save and resume it
with checkpoint.load into a fresh engine, in one gloo process (test_safe_load.py):

    python -m tests.deepspeed_roundtrip ROOT PORT ZERO_STAGE PRECISION

exits 0 once the resumed weights and optimizer moments equal the saved ones.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from specforge_dspark.config.recipe import recipe_from_dict
from specforge_dspark.training import checkpoint
from specforge_dspark.training.distributed import deepspeed_config, lr_lambda


def engine(recipe, seed: int):
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(recipe, 10))
    config = deepspeed_config(recipe, torch.device("cpu"), 1)
    return deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config)[0]


def main(argv: list[str]) -> int:
    root, port, stage, precision = Path(argv[0]), argv[1], int(argv[2]), argv[3]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    torch.distributed.init_process_group("gloo")
    recipe = recipe_from_dict({"dist": {"zero_stage": stage, "precision": precision}})
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    saved = engine(recipe, 0)
    saved.backward(saved(torch.randn(2, 8, dtype=dtype)).sum())
    saved.step()
    fingerprint = {"features": {}, "data": {}}
    path = checkpoint.save(saved, root, checkpoint.TrainState(step=1), recipe, 1, fingerprint)
    resumed = engine(recipe, 1)
    state = checkpoint.load(resumed, path, recipe, fingerprint)
    assert state.step == 1, state
    for a, b in zip(saved.module.parameters(), resumed.module.parameters(), strict=True):
        assert torch.equal(a, b)
    a, b = (moments(e) for e in (saved, resumed))
    assert a and len(a) == len(b) and all(map(torch.equal, a, b)), (a, b)
    return 0


def moments(engine) -> list[torch.Tensor]:
    """Adam's first moments of the torch optimizer DeepSpeed wraps (ZeRO) or holds."""
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return [s["exp_avg"] for s in opt.state_dict()["state"].values()]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
