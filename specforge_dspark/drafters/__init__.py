"""Drafter kinds: one module per kind (dspark, dflash), their shared layers and io,
and the registry (kind -> network, loss, export)."""
