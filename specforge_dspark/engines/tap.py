"""What a target is to the trainer: its sizes, its aux layer ids, and its aux tap, what
"aux layer k" is. The engine that serves the drafter defines it (a drafter
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

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch


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
