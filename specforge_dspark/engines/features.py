"""The engine seam's record: what every target backend hands the trainer.

Legend: B sequences in a batch, S padded length, H target hidden size, m aux layers.
Batches are right-padded; padded positions carry loss_mask 0 and zero features.

Aux tap: what "aux layer k" is. The engine that serves the drafter defines it (a drafter
trained on one tap and served on another sees shifted features), so the hf backend, the
offline capture and the evaluation harness all take SGLang 0.5.23's tap through `AuxTap`,
and `tap_convention` names it for metadata. Paths are under sglang/srt/.

  convention     model_type                     aux layer k               SGLang source
  layer_output   the default: qwen3, llama...   decoder layer k's output  models/qwen3.py:803-805
                                                = HF hidden_states[k+1]   (before layer k+1)
  pre_mlp_sconv  inkling_text, inkling_mm_model r + m, see below          models/inkling.py:826-837

Inkling decoder layer k (transformers InklingDecoderLayer) on input h, where
sconv(x) = x + conv(x), conv the causal depthwise conv1d of that short convolution (SGLang's
ShortConvolution likewise: use_residual=True, models/inkling_common/sconv.py:64):
  r   = h + attn_sconv(self_attn(input_layernorm(h)))   the MLP's residual
  m   = mlp(post_attention_layernorm(r))                MLP or MoE output
  out = r + mlp_sconv(m) = r + m + conv(m)              = hidden_states[k+1]
  tap = r + m                                           = out - conv(m)
SGLang defers layer k's MLP short convolution into layer k+1's input read: the FFN exit
records m with a pending `ShortConvUpdate` (models/inkling.py:473-479, applied as
sconv(m) + residual by layer_boundary/residual/short_conv.py:71-81). The tap is
`complete_output` (m with its sum completed, residual/batch.py:109-111, stream.py:205-207)
plus `written_residual` (r, which the FFN prepare wrote after applying the attention's
short convolution: residual/batch.py:103-106, stage.py:131, short_conv.py:155-161).
Without use_sconv SGLang builds no mlp_sconv (models/inkling.py:430-438), the update is a
plain add and the tap is the layer output: a config with `use_sconv: false` is
layer_output. transformers' Inkling has no such flag and always builds one.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from specforge_dspark.engines.api_key import auth_headers
from specforge_dspark.engines.fp8_rows import dequantize
from specforge_dspark.engines.pinning import note_read

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
    being aux_hidden[..., i*H:(i+1)*H] * aux_scale[..., i] (engines/fp8_rows.py), and
    `to(device)` dequantizes them into last_hidden's dtype where they land; train on
    the result. None: `aux_hidden` holds the features."""

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
        list(f.sample_ids), ids, mask, lengths, aux, last, copy_done=done, position_ids=pos
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


def read_target_config(target_path: str | Path) -> dict[str, Any]:
    """`<target.path>/config.json` as a dict."""
    cfg_path = Path(target_path) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"target.path: no config.json at {cfg_path}")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"target.path: {cfg_path} is not valid JSON: {e}") from None


def read_target_dims(target_path: str | Path, layer_ids: list[int]) -> TargetDims:
    """H and layer count from `<target.path>/config.json` (text_config when nested)."""
    cfg_path = Path(target_path) / "config.json"
    cfg = read_target_config(target_path)
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


TapConvention = Literal["layer_output", "pre_mlp_sconv"]
"""The aux tap of a target (module docstring); record it beside features you store."""

PRE_MLP_SCONV_MODEL_TYPES = frozenset({"inkling_text", "inkling_mm_model"})


def _get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def tap_convention(config: Any) -> TapConvention:
    """The aux tap SGLang takes for a target, from its transformers config or the dict of
    its config.json (the text config when nested)."""
    text = _get(config, "text_config") or config
    types = {_get(config, "model_type"), _get(text, "model_type")}
    if types & PRE_MLP_SCONV_MODEL_TYPES and _get(text, "use_sconv", True) is not False:
        return "pre_mlp_sconv"
    return "layer_output"


class AuxTap:
    """Forward hooks that take the aux taps of `layer_ids` from a transformers model.

    Enter it around one forward of `model` (its decoder, or the model with its head;
    prefill or cached decode alike); `taps()` then returns, in `layer_ids` order, each
    layer's tap `[B, S, H]` for the S tokens of that forward. Hooks live only inside the
    `with`, so the model runs untouched elsewhere. A hook reads only its own forward's
    activations, so cached decoding needs nothing more.
    """

    def __init__(self, model: torch.nn.Module, layer_ids: list[int]):
        self.convention = tap_convention(model.config)
        layers = model.get_decoder().layers
        self.layers = [layers[k] for k in layer_ids]
        if self.convention == "pre_mlp_sconv":
            lacking = [k for k in layer_ids if not _has_mlp_sconv(layers[k])]
            if lacking:
                raise ValueError(
                    f"target: the config asks for the pre_mlp_sconv tap, but decoder layers "
                    f"{lacking} have no mlp_sconv / post_attention_layernorm"
                )
        self._taps: list[torch.Tensor | None] = []
        self._residuals: list[torch.Tensor | None] = []
        self._handles: list[Any] = []

    def __enter__(self) -> AuxTap:
        self._taps = [None] * len(self.layers)
        self._residuals = [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            if self.convention == "pre_mlp_sconv":
                self._hook_pre_mlp_sconv(i, layer)
            else:
                self._hook_layer_output(i, layer)
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._residuals = [], []

    def taps(self) -> list[torch.Tensor]:
        """Each aux layer's tap `[B, S, H]` from the forward run inside the `with`, handed
        over once: the tap keeps no reference (they can be large on a GPU)."""
        taps, self._taps = self._taps, []
        if not taps or any(t is None for t in taps):
            raise RuntimeError("AuxTap: no forward reached every aux layer inside the `with`")
        return taps  # type: ignore[return-value]

    def _hook_layer_output(self, i: int, layer: torch.nn.Module) -> None:
        def keep_output(_module, _args, out):
            self._taps[i] = out[0] if isinstance(out, tuple) else out

        self._handles.append(layer.register_forward_hook(keep_output))

    def _hook_pre_mlp_sconv(self, i: int, layer: torch.nn.Module) -> None:
        # r is what post_attention_layernorm reads (the layer adds it back after its MLP),
        # m what mlp_sconv reads; r + m is SGLang's `value + residual`, one add per layer
        def keep_residual(_module, args):
            self._residuals[i] = args[0]

        def keep_tap(_module, args):
            self._taps[i] = self._residuals[i] + args[0]

        norm, sconv = layer.post_attention_layernorm, layer.mlp_sconv
        self._handles.append(norm.register_forward_pre_hook(keep_residual))
        self._handles.append(sconv.register_forward_pre_hook(keep_tap))


def _has_mlp_sconv(layer: torch.nn.Module) -> bool:
    return (
        getattr(layer, "mlp_sconv", None) is not None
        and getattr(layer, "post_attention_layernorm", None) is not None
    )


def post_json(url: str, body: bytes, timeout_s: float, fut: Future, key: str | None = None) -> None:
    """POST a JSON `body` to a live server's `url` (with API key `key`); its JSON reply, or
    the failure, lands in `fut`: TargetLost when the server cannot be reached (refused,
    reset, socket timeout), RuntimeError for an HTTP error (401: a wrong or missing key)
    or a reply that is not JSON. The trainer's own deadline fires first; `timeout_s` only
    frees the thread."""
    headers = {"Content-Type": "application/json", **auth_headers(key)}
    req = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            fut.set_result(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        fut.set_exception(RuntimeError(f"HTTP {e.code}: {detail}"))
    except (OSError, http.client.HTTPException) as e:
        fut.set_exception(TargetLost(f"{type(e).__name__}: {e}"))
    except Exception as e:  # bad JSON
        fut.set_exception(RuntimeError(f"{type(e).__name__}: {e}"))
