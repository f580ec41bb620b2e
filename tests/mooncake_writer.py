"""A writer process for tests/test_mooncake.py: runs slot_writer's calls against a
trainer's slot named by a Mooncake location, from another loopback address.

argv[1]: the location; argv[2]: JSON list of calls, each {"op": "write" | "fail", "ticket",
"nonce", "row0", "rows", "seed", "message"}, and "location" where it is another one; rows
are torch.randn(rows, D + H) under `seed` (D, H argv[3:5]). argv[5], when given: the
version this environment's Mooncake distribution reports.
"""

import importlib.metadata
import json
import sys

import torch

if len(sys.argv) > 5:
    importlib.metadata.version = lambda name: sys.argv[5]

from specforge_dspark.transport.slot_writer import fail, write_features

location, calls = sys.argv[1], json.loads(sys.argv[2])
D, H = int(sys.argv[3]), int(sys.argv[4])
for c in calls:
    where = c.get("location", location)
    if c["op"] == "fail":
        fail(where, c["ticket"], c["nonce"], c["message"])
        continue
    rows = torch.randn(c["rows"], D + H, generator=torch.Generator().manual_seed(c["seed"]))
    write_features(where, c["ticket"], c["nonce"], c["row0"], rows[:, :D], rows[:, D:])
