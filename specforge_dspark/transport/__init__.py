"""How features travel from a target engine to a trainer rank, whatever the engine: the
record (features.py), shared-memory slots (shm.py) with per-sequence tickets (tickets.py)
and ragged rows (ragged.py), the writer run inside the engine (slot_writer.py), fp8 rows,
page-locked mappings (pinning.py), Mooncake in place of a shared mapping, one request's
trainer side (request.py) and the slots' budget (slot_budget.py). Standard library and
torch only: the slot writer runs in every engine's own environment.

Imports: none
"""
