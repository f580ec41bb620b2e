"""Drafter kinds: one network module per kind (dspark, dflash, dflash2), their shared
layers and io, the registry (kind -> config, network, loss, SGLang architecture), and the
conventions record every export of a drafter carries (conventions.py).

Imports: config, engines, objective
"""
