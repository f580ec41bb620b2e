"""`python -m specforge_dspark.cli.bench NAME|all [args]`: the names in bench/__init__.py."""

import sys

from specforge_dspark.cli.bench import main

sys.exit(main())
