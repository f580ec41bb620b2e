"""Drafter kinds: one network module per kind (dspark, dflash), their shared layers and io,
and the registry (kind -> config, network, loss, SGLang architecture)."""
