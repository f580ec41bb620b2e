"""The SGLang directory layout both drafter kinds are saved in and loaded from:
config.json + model.safetensors (dspark.py for DSpark, dflash.py for DFlash)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def config_value(value: Any) -> Any:
    """A config field as written to config.json (a list is copied, not shared)."""
    return list(value) if isinstance(value, list) else value


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
