"""`python -m specforge_dspark.tiny`: build a tiny target (see tiny/target.py)."""

from specforge_dspark.tiny.target import main

raise SystemExit(main())
