"""`python -m specforge_dspark.engines.keyed_launch <module> <args>`: run `<module>` as
`python -m <module> <args> --api-key <key>` would, the key taken from the environment
variable SFDSPARK_API_KEY (and removed from it), so that it is on no process's command
line (api_key.py). Runs in the engine's own environment, where this package is installed
for its plugin."""

import os
import runpy
import sys

from specforge_dspark.engines.api_key import KEY_ENV


def main() -> None:
    module, *args = sys.argv[1:]
    key = os.environ.pop(KEY_ENV, "")
    if not key:
        sys.exit(f"keyed_launch: {KEY_ENV} is not set")
    sys.argv = [module, *args, "--api-key", key]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
