"""The closed loop from the serving engine's traffic back into the drafter: serve and
record, mine, train, gate, swap (specforge_dspark/loop/round.py), round after round, with
SGLang as the judge. Every phase is resumable: run the same command again after a kill."""

from __future__ import annotations

import sys

from specforge_dspark.config.command_line import command_parser
from specforge_dspark.loop.round import PHASES, Loop


def main(argv: list[str] | None = None) -> int:
    parser = command_parser(
        "specforge_dspark.cli.loop",
        __doc__,
        "python -m specforge_dspark.cli.loop --recipe recipes/tiny_cpu_loop.yaml --rounds 2",
    )
    parser.add_argument("--recipe", required=True, help="recipe YAML with a `loop:` section")
    parser.add_argument("--rounds", type=int, default=1, help="rounds to run (0: until killed)")
    parser.add_argument("--stop-after", choices=PHASES, help="stop after this phase of a round")
    parser.add_argument("--nproc", type=int, default=2, help="training ranks (torchrun)")
    parser.add_argument(
        "overrides", nargs="*", help="recipe overrides, e.g. loop.steps_per_round=200"
    )
    args = parser.parse_args(argv)
    from specforge_dspark.config.recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loop = Loop(recipe, args.overrides, args.nproc)
    try:
        done = 0
        while args.rounds == 0 or done < args.rounds:
            summary = loop.run_round(args.stop_after)
            if summary is None:
                return 0
            g = summary["gate"]
            print(f"loop: round {summary['round']} done in {summary['seconds']}: "
                  f"{'promoted' if g['promote'] else 'kept'} ({g['why']}); version "
                  f"{summary['serving_after']} serves", flush=True)  # fmt: skip
            done += 1
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
