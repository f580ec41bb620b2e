"""The engine seam's record: what every target backend hands the trainer.

Legend: B sequences in a batch, S padded length, H target hidden size, m aux layers.
Batches are right-padded; padded positions carry loss_mask 0 and zero features.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Sample:
    """One tokenised training sequence (the data pipeline's objects duck-type this)."""

    sample_id: int
    input_ids: list[int] | torch.Tensor  # [S]
    loss_mask: list[int] | torch.Tensor  # [S]


@dataclass
class TargetFeatures:
    """Frozen-target features for one batch, in the order the batch was given.

    `aux_hidden_BSD` concatenates the outputs of decoder layers `target_layer_ids`
    (HF `hidden_states[k+1]`, before the final norm), D = m*H. `last_hidden_BSH` is
    the final hidden state after the final norm, exactly what the LM head consumes
    (before any muP logits division, which the trainer's frozen head applies).
    Tensors from a live stream are views into a shared-memory slot that is reused
    once the iterator advances: `.clone()` what you keep longer than one step.
    """

    sample_ids: list[int]
    input_ids: torch.Tensor  # [B, S] int64, right-padded with 0
    loss_mask: torch.Tensor  # [B, S] int64, 0 on padding
    lengths: torch.Tensor  # [B] int64, unpadded lengths
    aux_hidden: torch.Tensor  # [B, S, m*H]
    last_hidden: torch.Tensor  # [B, S, H]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TargetFeatures:
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return TargetFeatures(
            list(self.sample_ids),
            move(self.input_ids),
            move(self.loss_mask),
            move(self.lengths),
            move(self.aux_hidden),
            move(self.last_hidden),
        )


@dataclass
class PaddedBatch:
    """A batch of samples right-padded to the longest one (what a backend receives)."""

    sample_ids: list[int]
    input_ids: torch.Tensor  # [B, S] int64
    loss_mask: torch.Tensor  # [B, S] int64
    lengths: torch.Tensor  # [B] int64

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]


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


@dataclass(frozen=True)
class TargetDims:
    """Sizes the stream needs before the target answers: H, layer count, aux layers."""

    hidden_size: int
    num_layers: int
    layer_ids: tuple[int, ...]

    @property
    def aux_width(self) -> int:
        return self.hidden_size * len(self.layer_ids)


def read_target_dims(target_path: str | Path, layer_ids: list[int]) -> TargetDims:
    """H and layer count from `<target.path>/config.json` (text_config when nested)."""
    cfg_path = Path(target_path) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"target.path: no config.json at {cfg_path}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"target.path: {cfg_path} is not valid JSON: {e}") from None
    text = cfg.get("text_config") or cfg
    hidden, layers = text.get("hidden_size"), text.get("num_hidden_layers")
    if not isinstance(hidden, int) or not isinstance(layers, int):
        raise ValueError(f"target.path: {cfg_path} lacks hidden_size / num_hidden_layers")
    check_layer_ids(layer_ids, layers)
    return TargetDims(hidden, layers, tuple(layer_ids))


def check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    """Aux layers must be distinct, ascending, and not the last layer (engines refuse)."""
    if not layer_ids:
        raise ValueError("draft.target_layer_ids must name at least one layer")
    if list(layer_ids) != sorted(set(layer_ids)):
        raise ValueError(
            f"draft.target_layer_ids must be strictly ascending (SGLang's capture refuses "
            f"repeats and unsorted ids), got {list(layer_ids)}"
        )
    if layer_ids[0] < 0 or layer_ids[-1] > num_layers - 2:
        raise ValueError(
            f"draft.target_layer_ids {list(layer_ids)} must lie in [0, {num_layers - 2}] for "
            f"a target with {num_layers} layers (the last layer's output cannot be captured)"
        )
