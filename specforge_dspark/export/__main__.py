"""`python -m specforge_dspark.export`: see specforge_dspark/export/core.py."""

import sys

from specforge_dspark.export.core import main

sys.exit(main())
