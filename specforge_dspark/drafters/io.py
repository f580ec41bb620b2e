"""The SGLang directory layout both drafter kinds are saved in and loaded from:
config.json + model.safetensors (dspark.py for DSpark, dflash.py for DFlash), and the
decoder fields their config dataclasses share: checked once, read and written once.

The shared fields (and their config.json names) are those of SGLang's Qwen3-style draft
decoder: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
head_dim, intermediate_size, hidden_act, rms_norm_eps, rope_theta and rope_scaling (both
written as `rope_parameters`), max_position_embeddings, vocab_size, block_size,
target_layer_ids, num_target_layers, mask_token_id, layer_types; each kind adds its own
and its own checks.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specforge_dspark.config.rope import (
    rope_parameters,
    rope_scaling_problems,
    scaling_from_parameters,
)

DECODER_SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "num_target_layers",
)
"""Shared fields that must be > 0."""
REQUIRED = object()
"""`get` default of a config.json key that must be present."""


# --------------------------------------------------------------------------- config


def check_decoder_fields(cfg: Any, sizes: tuple[str, ...] = DECODER_SIZES) -> None:
    """Normalise and check the shared decoder fields of a config dataclass (in its
    `__post_init__`): target_layer_ids become ints, an empty layer_types becomes all
    "full_attention"; a bad value raises ValueError naming `<ClassName>.<field>`.
    `sizes`: the fields that must be > 0, in the order they are checked."""
    name = type(cfg).__name__
    cfg.target_layer_ids = [int(i) for i in cfg.target_layer_ids]
    cfg.layer_types = list(cfg.layer_types) or ["full_attention"] * cfg.num_hidden_layers
    for key in sizes:
        if getattr(cfg, key) <= 0:
            raise ValueError(f"{name}.{key} must be > 0, got {getattr(cfg, key)}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"{name}.num_attention_heads ({cfg.num_attention_heads}) must be a "
            f"multiple of num_key_value_heads ({cfg.num_key_value_heads}) (GQA)"
        )
    if cfg.head_dim % 2:
        raise ValueError(f"{name}.head_dim must be even (RoPE), got {cfg.head_dim}")
    if cfg.hidden_act != "silu":
        raise ValueError(f"{name}.hidden_act must be 'silu', got {cfg.hidden_act!r}")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise ValueError(
            f"{name}.mask_token_id ({cfg.mask_token_id}) must be in "
            f"[0, vocab_size={cfg.vocab_size})"
        )
    if not cfg.target_layer_ids:
        raise ValueError(f"{name}.target_layer_ids must name at least one layer")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < cfg.num_target_layers]
    if bad:
        raise ValueError(
            f"{name}.target_layer_ids {bad} outside [0, num_target_layers={cfg.num_target_layers})"
        )
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ValueError(
            f"{name}.layer_types has {len(cfg.layer_types)} entries, "
            f"num_hidden_layers is {cfg.num_hidden_layers}"
        )


def from_attributes(cls: type, source: Any) -> Any:
    """`cls(...)` from the attributes of `source` named like its fields (a
    `recipe.DraftRecipe`); fields `source` lacks keep their defaults."""
    names = [f.name for f in dataclasses.fields(cls)]
    return cls(**{n: getattr(source, n) for n in names if hasattr(source, n)})


def config_reader(d: dict[str, Any], nested: dict[str, Any], *, root_wins: bool) -> Callable:
    """`get(key, default=REQUIRED)` over a config.json `d` and its nested section(s).

    root_wins (DSpark: SGLang builds its heads from the root): the root value, else the
    nested one, a disagreement warned about. Otherwise (DFlash, as SGLang's
    `parse_dflash_draft_config`): the nested key if present, else the root. A missing
    (or null) key returns `default`, or raises ValueError when it is REQUIRED.
    """
    where = "root and dflash_config" if root_wins else "dflash_config and root"

    def get(key: str, default: Any = REQUIRED) -> Any:
        if root_wins:
            root, inner = d.get(key), nested.get(key)
            if root is not None and inner is not None and root != inner:
                warnings.warn(
                    f"config.json: {key} is {root!r} at the root but {inner!r} in "
                    "dflash_config; using the root value",
                    stacklevel=3,
                )
            value = root if root is not None else inner
        else:
            value = nested.get(key, d.get(key))
        if value is None and default is REQUIRED:
            raise ValueError(f"config.json: {key} is missing ({where})")
        return default if value is None else value

    return get


DOMINO = "domino"
"""The one projector_type SGLang 0.5.23 builds differently (a prefix GRU + embed_proj)."""


def read_decoder_fields(
    d: dict[str, Any],
    get: Callable,
    supported: dict[str, tuple],
    owner: str,
    block_size: int,
) -> dict[str, Any]:
    """The shared decoder fields of a config.json `d` (read with `config_reader`'s `get`),
    with SGLang's defaults: num_key_value_heads = num_attention_heads, head_dim =
    hidden_size / num_attention_heads, rope_theta from `rope_parameters` then `rope_theta`
    then 10000, rope_scaling the rest of `rope_parameters`, num_target_layers =
    max(target_layer_ids) + 1, `block_size` given.

    A setting in `supported` (key -> the values `owner` implements; absent or null is
    always fine) with another value, a RoPE scaling the draft does not reproduce
    (config/rope.py), or the Domino
    projector raises ValueError. SGLang reads every other `projector_type` (SpecForge's
    exports write "dspark") as the plain fc projector, and so do we.
    """
    if get("projector_type", None) == DOMINO:  # any other value is SGLang's plain projector
        raise ValueError(
            f"config.json: projector_type={DOMINO!r} is not supported by {owner}: SGLang "
            "0.5.23 builds a Domino projector for it (speculative/dflash_utils.py:734, "
            "models/dflash.py:987: a prefix GRU and embed_proj) that this drafter does not have"
        )
    for key, allowed in supported.items():
        value = get(key, None)
        if value is not None and value not in allowed:
            raise ValueError(f"config.json: {key}={value!r} is not supported by {owner}")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    problems = rope_scaling_problems(rope, "config.json rope_parameters")
    if problems:
        raise ValueError("; ".join(problems))
    heads, hidden = int(get("num_attention_heads")), int(get("hidden_size"))
    layer_ids = [int(i) for i in get("target_layer_ids")]
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(get("num_hidden_layers")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("num_key_value_heads", heads)),
        "head_dim": int(get("head_dim", hidden // heads)),
        "intermediate_size": int(get("intermediate_size")),
        "hidden_act": str(get("hidden_act", "silu")),
        "rms_norm_eps": float(get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope.get("rope_theta") or get("rope_theta", 10000.0)),
        "rope_scaling": scaling_from_parameters(rope),
        "max_position_embeddings": int(get("max_position_embeddings", 32768)),
        "vocab_size": int(get("vocab_size")),
        "block_size": int(get("block_size", block_size)),
        "target_layer_ids": layer_ids,
        "num_target_layers": int(get("num_target_layers", max(layer_ids) + 1)),
        "mask_token_id": int(get("mask_token_id")),
        "layer_types": list(get("layer_types", [])),
    }


def config_value(value: Any) -> Any:
    """A config field as written to config.json (a list is copied, not shared)."""
    return list(value) if isinstance(value, list) else value


def sglang_config(
    cfg: Any,
    architecture: str,
    draft_keys: tuple[str, ...],
    *,
    omit: tuple[str, ...] = (),
    after_fields: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The config.json dict of a config dataclass, in this key order: `architectures`,
    `model_type`, every field not in `draft_keys` or `omit` (declaration order),
    `after_fields`, the fixed RoPE / bias / tie settings, `settings`, then `draft_keys`
    at the root and again in `dflash_config`."""
    draft = {k: config_value(getattr(cfg, k)) for k in draft_keys}
    fields = {
        f.name: config_value(getattr(cfg, f.name))
        for f in dataclasses.fields(cfg)
        if f.name not in draft_keys and f.name not in omit and f.name != "rope_scaling"
    }
    return {
        "architectures": [architecture],
        "model_type": "qwen3",
        **fields,
        **(after_fields or {}),
        "rope_parameters": rope_parameters(cfg.rope_theta, cfg.rope_scaling),
        "attention_bias": False,
        "tie_word_embeddings": False,
        **(settings or {}),
        **draft,
        "dflash_config": dict(draft),
    }


# --------------------------------------------------------------------------- files


def save_layout(
    module: torch.nn.Module, config: dict, path: str | Path, dtype: torch.dtype
) -> None:
    """Write `module`'s tensors in `dtype` and `config` (plus its dtype) under `path`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {**config, "dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def load_checked(
    model: torch.nn.Module,
    path: str | Path,
    skip: tuple[str, ...],
    device: str | torch.device,
    dtype: torch.dtype,
) -> torch.nn.Module:
    """Load path/model.safetensors into `model` (built on meta) as SGLang's loaders do: a
    leading "model." is stripped and names starting with `skip` are ignored; any other
    unknown name, wrong shape or missing tensor raises ValueError naming it."""
    from safetensors.torch import load_file

    file = Path(path) / "model.safetensors"
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state = {}
    for name, tensor in load_file(str(file)).items():
        name = name.removeprefix("model.")
        if name.startswith(skip):
            continue
        if name not in expected:
            raise ValueError(f"{file}: unexpected tensor {name}")
        if tensor.shape != expected[name]:
            raise ValueError(
                f"{file}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name])}"
            )
        state[name] = tensor.to(device, dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{file}: missing tensors {missing}")
    model.load_state_dict(state, assign=True)
    return model


def context_features(fc: torch.nn.Linear, norm: torch.nn.Module, aux_BSD: torch.Tensor):
    """Shared context features `[B, S, H]` = norm(fc(aux)), D = m*H."""
    if aux_BSD.shape[-1] != fc.in_features:
        raise ValueError(
            f"aux_hidden has {aux_BSD.shape[-1]} features, expected "
            f"{fc.in_features} = len(target_layer_ids) * hidden_size"
        )
    return norm(fc(aux_BSD.to(fc.weight.dtype)))
