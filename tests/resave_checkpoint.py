"""Load a checkpoint on this world size and save it again at once, untrained: what a
resume holds right after re-partitioning (test_resume_world_size.py).

    torchrun --nproc_per_node W -m tests.resave_checkpoint RECIPE CKPT OUT [key=value ...]

writes OUT/ckpt/step-<N> for the step of CKPT.
"""

from __future__ import annotations

import sys

import train
from specforge_dspark.config.recipe import load_recipe
from specforge_dspark.training import checkpoint


def main(argv: list[str]) -> int:
    recipe_path, ckpt, out, *overrides = argv
    recipe = load_recipe(recipe_path, [*overrides, f"train.output_dir={out}"])
    run = train.build(recipe, ckpt)
    checkpoint.save(run.engine, run.dirs["checkpoint"], run.state, run.recipe, 1, run.fingerprint)
    run.stream.close()  # build started the target; nothing here asks it for features
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
