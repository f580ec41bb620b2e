"""The engine seam's record: what every target backend hands the trainer, and how a batch
reaches a backend (`PaddedBatch`, `pad_batch`). Legend: B sequences in a batch, S padded
length, H target hidden size, m aux layers. Batches are right-padded; padded positions
carry loss_mask 0 and zero features. "Aux layer k" of a target: engines/tap.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specforge_dspark.transport.fp8_rows import dequantize
from specforge_dspark.transport.pinning import note_read

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TargetLost(RuntimeError):
    """The engine's worker process died; the message names it. An engine with a
    `restart()` can be brought back (FeatureStream does, within target.max_restarts)."""


class TargetGone(TargetLost):
    """The target is lost and will not come back (an attached SGLang server that did not
    answer again in time): `restart()` raises it, FeatureStream does not try again."""


class TargetRefused(RuntimeError):
    """The target never served once: its server exited or hung before its first answer
    (bad arguments, out of memory while loading) or its first request wrote no features.
    A retry would be refused again: the run ends `refused` (training/run_status.py)."""


@dataclass
class Sample:
    """One tokenised training sequence (the data pipeline's objects duck-type this)."""

    sample_id: int
    input_ids: list[int] | torch.Tensor  # [S]
    loss_mask: list[int] | torch.Tensor  # [S]


@dataclass
class TargetFeatures:
    """Frozen-target features for one batch, in the order the batch was given.

    `aux_hidden_BSD` concatenates the aux taps of decoder layers `target_layer_ids`
    (before the final norm; the tap convention is in the module docstring), D = m*H.
    `last_hidden_BSH` is the final hidden state after the final norm, exactly what the
    LM head consumes (before any muP logits division, which the trainer's frozen head
    applies).
    Tensors from a live stream may be views into a shared-memory slot that is reused
    once the iterator advances (a batch of equal lengths; otherwise they are a padded
    copy of the slot's ragged rows, shm.SlotViews.padded): `.clone()` what you keep
    longer than one step.
    """

    sample_ids: list[int]
    input_ids: torch.Tensor  # [B, S] int64, right-padded with 0
    loss_mask: torch.Tensor  # [B, S] int64, 0 on padding
    lengths: torch.Tensor  # [B] int64, unpadded lengths
    aux_hidden: torch.Tensor  # [B, S, m*H]
    last_hidden: torch.Tensor  # [B, S, H]
    copy_done: torch.cuda.Event | None = None  # set by `to` on a host -> GPU copy
    position_ids: torch.Tensor | None = None
    """[B, S] int64 for packed rows (training/packing.py: several conversations per row,
    positions restarting at 0 in each; `sample_ids` then lists them all, row by row);
    None: one sequence per row, positions 0 .. S-1."""
    aux_scale: torch.Tensor | None = None
    """[B, S, m] float32 when the aux rows crossed as fp8 (target.transport_dtype
    fp8_e4m3): `aux_hidden` then holds their float8_e4m3fn codes, aux layer i of a row
    being aux_hidden[..., i*H:(i+1)*H] * aux_scale[..., i] (transport/fp8_rows.py), and
    `to(device)` dequantizes them into last_hidden's dtype where they land; train on
    the result. None: `aux_hidden` holds the features."""
    row0: int | None = None
    """The position of the feature rows' first row when they are a window of the batch's
    positions (PaddedBatch.window: aux and last `[B, W, ...]`, rows past a sequence zero);
    None: rows from position 0, `[B, S, ...]`."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TargetFeatures:
        """These features on `device`, fp8 aux rows dequantized there (`aux_scale`). Host
        -> GPU (CUDA present) is asynchronous whatever `non_blocking` says: the copies
        (of the fp8 codes and scales, not of dequantized rows) and the dequantization run
        on a side stream, the current stream waits on their event (the result's
        `copy_done`) and the pinned slot they read is not rewritten before they are done
        (pinning.note_read). Otherwise `Tensor.to` as asked, then the dequantization."""
        if (
            torch.device(device).type == "cuda"
            and self.aux_hidden.device.type == "cpu"
            and torch.cuda.is_available()
        ):
            return _to_gpu(self, torch.device(device))
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        last = move(self.last_hidden)
        return TargetFeatures(
            list(self.sample_ids),
            move(self.input_ids),
            move(self.loss_mask),
            move(self.lengths),
            _features(move(self.aux_hidden), self.aux_scale, last.dtype),
            last,
            position_ids=None if self.position_ids is None else move(self.position_ids),
            row0=self.row0,
        )


def _features(aux_BSD: torch.Tensor, scale_BSL: torch.Tensor | None, dtype) -> torch.Tensor:
    """aux rows [B, S, D] as features: dequantized into `dtype` on aux's device when they
    are fp8 codes with scales [B, S, m] (moved there), else as they are."""
    if scale_BSL is None:
        return aux_BSD
    scale = scale_BSL.to(aux_BSD.device).flatten(0, 1)
    return dequantize(aux_BSD.flatten(0, 1), scale, dtype).view(aux_BSD.shape)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _to_gpu(f: TargetFeatures, device: torch.device) -> TargetFeatures:
    """Host -> GPU copy of `f` on a side stream (TargetFeatures.to), fp8 aux rows
    dequantized there after it; from a pinned slot the copy does not block the host, and
    it overlaps the GPU work already queued."""
    main = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.get(main.device)
    if side is None:
        side = _SIDE_STREAMS[main.device] = torch.cuda.Stream(main.device)
    host = [f.input_ids, f.loss_mask, f.lengths, f.aux_hidden, f.last_hidden]
    if f.aux_scale is not None:
        host.append(f.aux_scale)
    with torch.cuda.stream(side):
        moved = [t.to(main.device, non_blocking=True) for t in host]
        ids, mask, lengths, aux, last = moved[:5]
        aux = _features(aux, moved[5] if len(moved) > 5 else None, last.dtype)
    for t in (ids, mask, lengths, aux, last):
        t.record_stream(main)  # allocated on the side stream, used on the main one
    done = side.record_event()
    main.wait_event(done)
    note_read(host, done)
    pos = None if f.position_ids is None else f.position_ids.to(main.device)
    return TargetFeatures(
        list(f.sample_ids),
        ids,
        mask,
        lengths,
        aux,
        last,
        copy_done=done,
        position_ids=pos,
        row0=f.row0,
    )


@dataclass
class PaddedBatch:
    """A batch of samples right-padded to the longest one (what a backend receives)."""

    sample_ids: list[int]
    input_ids: torch.Tensor  # [B, S] int64
    loss_mask: torch.Tensor  # [B, S] int64
    lengths: torch.Tensor  # [B] int64
    window: tuple[int, int] | None = None
    """(first position lo, rows W): the engine hands back only positions [lo, lo + W) of
    each sequence (dist.sequence_parallel: a rank's slice and its halo), the features then
    `[B, W, ...]` with TargetFeatures.row0 = lo. None: every position. An engine without
    windows (offline) may return every position: row0 then says which."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    def window_rows(self) -> list[int]:
        """The rows each sequence has in the window ([B]; its length without one)."""
        return window_rows(self.lengths.tolist(), self.window)


def window_rows(lengths: list[int], window: tuple[int, int] | None) -> list[int]:
    """How many of positions [lo, lo + W) each sequence of `lengths` has (every one of
    its positions when `window` is None)."""
    if window is None:
        return [int(n) for n in lengths]
    lo, W = window
    return [max(0, min(int(n), lo + W) - lo) for n in lengths]


def _as_long(x: Any, what: str, sample_id: int) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.long)
    if t.dim() != 1:
        raise ValueError(f"sample {sample_id}: {what} must be 1-D, got shape {tuple(t.shape)}")
    return t


def field(sample: Any, name: str) -> Any:
    """`sample.name`, or `sample[name]` for mapping rows (a datasets.Dataset's rows)."""
    return sample[name] if isinstance(sample, dict) else getattr(sample, name)


def pad_batch(samples: list[Any]) -> PaddedBatch:
    """Right-pad `samples` (sample_id, input_ids, loss_mask as attributes or keys)."""
    if not samples:
        raise ValueError("feature stream: got an empty batch (a batch needs >= 1 sample)")
    ids, masks, sids = [], [], []
    for s in samples:
        sid = int(field(s, "sample_id"))
        x = _as_long(field(s, "input_ids"), "input_ids", sid)
        m = _as_long(field(s, "loss_mask"), "loss_mask", sid)
        if x.numel() == 0:
            raise ValueError(f"sample {sid}: input_ids is empty")
        if m.shape != x.shape:
            raise ValueError(
                f"sample {sid}: loss_mask has {m.numel()} entries for {x.numel()} input_ids"
            )
        ids.append(x)
        masks.append(m)
        sids.append(sid)
    lengths = torch.tensor([x.numel() for x in ids], dtype=torch.long)
    S = int(lengths.max())
    ids_BS = torch.zeros(len(ids), S, dtype=torch.long)
    mask_BS = torch.zeros(len(ids), S, dtype=torch.long)
    for b, (x, m) in enumerate(zip(ids, masks, strict=True)):
        ids_BS[b, : x.numel()] = x
        mask_BS[b, : m.numel()] = m
    return PaddedBatch(sids, ids_BS, mask_BS, lengths)
