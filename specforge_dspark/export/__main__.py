"""`python -m specforge_dspark.export`: see specforge_dspark/export/cli.py."""

import sys

from specforge_dspark.export.cli import main

sys.exit(main())
