"""Ragged rows: a request's sequences back to back ([T, ...], T = the sum of their
lengths), as slots hold them (shm.py), and right-padded copies for training.
Standard library and torch only (the slot writer runs it in every engine's server)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch


def starts(lengths: Sequence[int]) -> list[int]:
    """Row offset of each sequence of a ragged request: o_b = n_0 + ... + n_{b-1}."""
    return list(accumulate((int(n) for n in lengths), initial=0))[:-1]


def pad_rows(rows_T, lengths: Sequence[int], S: int, pin: bool = False) -> torch.Tensor:
    """Ragged rows [T, ...] as right-padded sequences [B, S, ...] (zeros on padding): a
    view of `rows_T` when every sequence has S rows, else a copy (page-locked with `pin`)."""
    B = len(lengths)
    if all(int(n) == S for n in lengths):
        return rows_T[: B * S].view(B, S, *rows_T.shape[1:])
    out = torch.zeros((B, S, *rows_T.shape[1:]), dtype=rows_T.dtype, pin_memory=pin)
    for b, (o, n) in enumerate(zip(starts(lengths), lengths, strict=True)):
        out[b, :n] = rows_T[o : o + n]
    return out
