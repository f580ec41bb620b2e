"""`python -m specforge_dspark.cli.preflight --recipe R.yaml [--samples 4] [--reference auto]`:
check what the target engine hands the trainer (training/preflight.py lists the checks)."""

from __future__ import annotations

import argparse
import sys

import torch

from specforge_dspark.training.preflight import PreflightError, preflight


def main(argv: list[str] | None = None) -> int:
    from specforge_dspark.cli.capture import prepared_samples
    from specforge_dspark.config.recipe import RecipeError, load_recipe
    from specforge_dspark.objective.frozen_head import load_frozen_head
    from specforge_dspark.training.stream import FeatureStream

    ap = argparse.ArgumentParser(
        description="Check the features the target engine hands the trainer."
    )
    ap.add_argument("--recipe", required=True, help="recipe YAML (see recipes/)")
    ap.add_argument(
        "--samples", type=int, default=0, help="rows (default train.preflight_samples or 4)"
    )
    ap.add_argument("--reference", choices=["auto", "hf", "none"], default="auto")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, e.g. target.backend=hf")
    args = ap.parse_intermixed_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        samples = args.samples or recipe.train.preflight_samples or 4
        rows = prepared_samples(recipe)
        dtype = torch.bfloat16 if recipe.target.dtype == "bfloat16" else torch.float32
        head = load_frozen_head(recipe.target.path, dtype=dtype)
        with FeatureStream(recipe) as stream:
            preflight(recipe, stream, rows, head, samples, args.reference)
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (RecipeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
