"""`python -m specforge_dspark.cli.server_command --recipe R.yaml [overrides]`: the command
that starts a target server for this recipe on another machine (a capture node of a
disaggregated pool, docs/production.md), exactly as the trainer would start it itself:
SGLang's launcher with the capture flags (engines/sglang.py `launch_args`) and the
environment our plugin reads. Run it there, in SGLang's own environment with this package
installed (`pip install --no-deps -e .`), and list the servers' URLs in
`target.sglang.urls`. It listens with the API key in SFDSPARK_API_KEY (through
engines/keyed_launch.py: on no command line), the key the trainers hold in the variable
`target.sglang.api_key_env` names."""

from __future__ import annotations

import shlex
import sys

from specforge_dspark.config.command_line import command_parser


def main(argv: list[str] | None = None) -> int:
    from specforge_dspark.config.recipe import RecipeError, load_recipe
    from specforge_dspark.engines.api_key import KEY_ENV
    from specforge_dspark.engines.sglang import KEYED_LAUNCH, is_cpu_engine, launch_args
    from specforge_dspark.transport import mooncake

    ap = command_parser(
        "specforge_dspark.cli.server_command",
        __doc__.split("\n\n")[0],
        "python -m specforge_dspark.cli.server_command --recipe recipes/inkling_nvfp4.yaml",
    )
    ap.add_argument("--recipe", required=True, help="recipe YAML (see recipes/)")
    ap.add_argument("--host", default="0.0.0.0", help="the address the server listens on")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, e.g. target.sglang.port=30001")
    args = ap.parse_intermixed_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        if recipe.target.backend != "sglang":
            raise ValueError(f"target.backend is {recipe.target.backend}: this prints SGLang's")
        recipe.target.sglang.host = args.host
        cmd = ["python", "-m", KEYED_LAUNCH, "sglang.launch_server", *launch_args(recipe)]
    except (RecipeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    holder = recipe.target.sglang.api_key_env or "<target.sglang.api_key_env>"
    env = [f"# {KEY_ENV}=<the API key the trainers hold in ${holder}>"]
    if recipe.target.transport == "mooncake":
        env.append(f"# {mooncake.HOST_ENV}=<this node's address toward the trainers>")
        if recipe.target.mooncake.protocol == "rdma":
            env.append(f"# {mooncake.DEVICE_ENV}=<this node's RDMA devices, e.g. mlx5_0>")
    if is_cpu_engine(recipe):
        env.append("# target.device is cpu: the trainer starts CPU-engine servers itself")
    print("\n".join([*env, shlex.join(cmd)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
