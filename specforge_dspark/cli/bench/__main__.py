"""`python -m specforge_dspark.cli.bench objective|step|stream|pack|capture|prepare|all [args]`."""

import sys

from specforge_dspark.cli.bench import main

sys.exit(main())
