"""`python -m specforge_dspark.bench objective|step|stream|pack|capture|prepare|all [args]`."""

import sys

from specforge_dspark.bench import main

sys.exit(main())
