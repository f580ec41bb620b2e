"""`python -m specforge_dspark.cli.preflight --recipe R.yaml [--rows 4] [--reference auto]`:
check what the target engine hands the trainer (training/preflight.py lists the checks)."""

from __future__ import annotations

import sys

import torch

from specforge_dspark.config.command_line import command_parser
from specforge_dspark.training.preflight import PreflightError, preflight


def main(argv: list[str] | None = None) -> int:
    from specforge_dspark.cli.capture import prepared_samples
    from specforge_dspark.config.recipe import RecipeError, load_recipe
    from specforge_dspark.objective.frozen_head import load_frozen_head
    from specforge_dspark.training.stream import FeatureStream

    ap = command_parser(
        "specforge_dspark.cli.preflight",
        "Check the features the target engine hands the trainer.",
        "python -m specforge_dspark.cli.preflight --recipe recipes/tiny_cpu_sglang.yaml --rows 4",
    )
    ap.add_argument("--recipe", required=True, help="recipe YAML (see recipes/)")
    ap.add_argument(
        "--rows", type=int, default=0, help="rows to check (0: train.preflight_samples, else 4)"
    )
    ap.add_argument("--reference", choices=["auto", "hf", "none"], default="auto")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, e.g. target.backend=hf")
    args = ap.parse_intermixed_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        samples = args.rows or recipe.train.preflight_samples or 4
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
