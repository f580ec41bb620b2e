"""Quantized copies of a target, served by our hf backend with the format's arithmetic
(engines/quant_formats.py), where no engine on this CPU runs NVFP4 or FP8 kernels.

`write_quantized_copy` rounds the weights of the decoder's linear layers through the format
(the embedding, the LM head, norms and any weight whose input dimension is not whole NVFP4
blocks stay as they are, as Model Optimizer leaves them; `head=True` rounds the LM head
too, and training's teacher then reads the served head: objective/frozen_head.py) and
names the format in
config.json (`quantization_emulation`). `apply_emulation`, applied by `load_causal_lm`
wherever our code loads a target with transformers (the hf backend, the evaluation
harness, its batched references, regeneration), puts those layers'
inputs through the format too, as the served W4A4 / W8A8 kernels quantize activations:
dynamic scales per token row (NVFP4: a per-row global scale where the engine uses a
calibrated static one; the block scales are dynamic in both).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from specforge_dspark.engines.quant_formats import NVFP4_BLOCK, fp8_round_trip, nvfp4_round_trip

MARKER = "quantization_emulation"
FORMATS = ("nvfp4", "fp8")
_KEEP = ("embed", "norm")  # names of weights never quantized
_HEAD = ("lm_head", "unembed")  # the LM head: quantized only when asked (`head=True`)


def _round_trip(fmt: str, x: torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """Weights: one NVFP4 global scale per tensor; activations (`per_row`): one per token
    row. FP8: a scale per row for both."""
    if fmt == "nvfp4":
        return nvfp4_round_trip(x, per_row)
    return fp8_round_trip(x, per_row=True)


def activation_round_trip(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """A quantized layer's input as the served kernel sees it: each token row through the
    format, in x's dtype."""
    return _round_trip(fmt, x, per_row=True).to(x.dtype)


def _quantizable(name: str, t: torch.Tensor, fmt: str, head: bool) -> bool:
    if not name.endswith(".weight") or t.dim() != 2 or any(k in name for k in _KEEP):
        return False
    if any(k in name for k in _HEAD) and not head:
        return False
    return fmt != "nvfp4" or t.shape[1] % NVFP4_BLOCK == 0


def write_quantized_copy(src: str | Path, out: str | Path, fmt: str, head: bool = False) -> Path:
    """`src` (a transformers checkpoint, one model.safetensors) copied to `out` with its
    decoder's linear weights through `fmt`, and its LM head too with `head` (where the
    deployment serves a quantized head; a tied head, the embedding, is refused); returns
    `out`."""
    from safetensors.torch import load_file, save_file

    if fmt not in FORMATS:
        raise ValueError(f"quantized copy: format must be one of {FORMATS}, got {fmt!r}")
    src, out = Path(src), Path(out)
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: a quantized copy needs one model.safetensors")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    if head and json.loads((src / "config.json").read_text()).get("tie_word_embeddings"):
        raise ValueError(f"{src}: tie_word_embeddings: its LM head is the embedding; a "
                         "quantized head would quantize the embedding too")  # fmt: skip
    state = load_file(weights)
    done = sorted(n for n, t in state.items() if _quantizable(n, t, fmt, head))
    for n in done:
        state[n] = _round_trip(fmt, state[n]).to(state[n].dtype)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    config[MARKER] = {"format": fmt, "weights": done, "activations": True, "source": str(src)}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def apply_emulation(model: torch.nn.Module, path: str | Path) -> list[str]:
    """For a copy written by `write_quantized_copy`: the inputs of its quantized linear
    layers go through the format on every forward. Returns the hooked module names (none
    for any other checkpoint)."""
    config_path = Path(path) / "config.json"
    spec = json.loads(config_path.read_text()).get(MARKER) if config_path.is_file() else None
    if not spec or not spec.get("activations"):
        return []
    fmt = spec["format"]
    modules = dict(model.named_modules())
    hooked = []
    for weight in spec["weights"]:
        name = weight.removesuffix(".weight")
        module = modules.get(name) or modules.get(name.removeprefix("model."))
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(
                lambda _m, args, fmt=fmt: (activation_round_trip(fmt, args[0]),)
            )
            hooked.append(name)
    return hooked


def load_causal_lm(path: str | Path, **kwargs) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)`, with a quantized copy's
    activations put through its format (`apply_emulation`): every target our code loads
    with transformers comes through here."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    apply_emulation(model, path)
    return model
