"""The frozen target token embedding and LM head, read by tensor name from the target files.

Only these two tensors are read (`safetensors.safe_open`, single file or sharded index),
never the whole model: for Inkling they are 2 x 201024 x 6144 of a much larger checkpoint.

Conventions, checked against the installed SGLang 0.5.23 and transformers 5.19:
- Noise embedding (what the draft block [x_a, MASK, ...] is embedded with): SGLang's DSpark
  worker uses `target_model.get_input_embeddings()` (`dspark_draft.py`
  `DraftBlockProposer.propose`, and `attach_shared_modules` through
  `dspark_worker_v2.py` `_resolve_target_embed_tokens`). For Inkling the served class is
  `InklingForConditionalGeneration` (`sglang/srt/models/inkling.py`, its EntryClass), whose
  `get_input_embeddings()` returns `self.llm.embed_tokens`: the RAW table, without
  `embed_norm` (only the inner `InklingCausalLLM.get_input_embeddings`, which the worker
  does not call, folds the norm in). transformers' `InklingForCausalLM` differs: its
  input embedding is an `InklingNormedEmbedding` that applies `embed_norm`. We match the
  serving engine: `embed(ids)` returns raw rows and `embed_norm` is never read.
- muP: `logits = lm_head(h / logits_mup_width_multiplier)`, divided exactly once, as
  transformers' `InklingForCausalLM.forward` and SGLang's `compute_base_logits` do.
  SGLang's DFLASH drafts take the argmax of the UNdivided `h @ W.T` instead
  (`dflash_worker_v2.py:189`, `:1690`): the same argmax for a positive multiplier, so one
  convention serves both kinds (drafters/dflash.py, "muP").
- Teacher logits (`teacher_logits`) are what SGLang's Inkling serves: its config sets
  `enable_lm_head_output_fp32`, so `LogitsProcessor._compute_lm_head` multiplies the bf16
  hidden (already divided by muP) by the bf16 head with a float32 OUTPUT
  (`torch.mm(..., out_dtype=torch.float32)` on CUDA), and `_get_logits` then applies
  `final_logit_softcapping` (cap * tanh(z / cap), in float32; unset, 0 or negative = off)
  to the logits cropped to the logical vocabulary (elementwise, so the crop order does not
  matter). transformers' Inkling applies no softcap; a target config without the key
  gets none either.
- Draft base logits (`logits`) are what SGLang's DSpark draft computes:
  `project_through_lm_head` (`models/dspark.py`), a plain matmul in the head's dtype, no
  softcap.
- Logical vocabulary: the LM head may have padded rows the target never emits.
  `unpadded_vocab_size` (transformers' Inkling config; SGLang's Inkling LogitsProcessor
  crops to it) when present, else the tokenizer's size when smaller, else all rows.
  `logits(h)` returns all rows; callers crop to `logical_vocab`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

EMBED_NAMES = (
    "model.embed_tokens.weight",  # HF causal LM
    "model.language_model.embed_tokens.weight",  # HF multimodal wrappers
    "model.llm.embed.weight",  # Inkling raw
    "model.llm.embed_tokens.weight",
    "llm.embed.weight",
)
HEAD_NAMES = (
    "lm_head.weight",
    "model.language_model.lm_head.weight",
    "model.llm.unembed.weight",  # Inkling raw
    "model.llm.lm_head.weight",
    "llm.unembed.weight",
)

NORM_NAMES = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "model.llm.norm.weight",  # Inkling raw
    "llm.norm.weight",
)


class FrozenHead(nn.Module):
    """Frozen target embedding `[V_rows, H]` and LM head `[V_rows, H]` (buffers, no grad)."""

    def __init__(
        self,
        embed_VH: torch.Tensor,
        lm_head_VH: torch.Tensor,
        logical_vocab: int,
        mup_multiplier: float = 1.0,
        logit_softcap: float | None = None,
        head_format: str | None = None,
    ) -> None:
        super().__init__()
        # A served head in a quantized format (engines/quant_targets.py): its input goes
        # through the format per token row, as the engine's kernel quantizes activations.
        self.head_format = head_format
        # Buffers, not parameters: never in an optimizer, never in a checkpoint.
        self.register_buffer("embed_weight", embed_VH, persistent=False)
        self.register_buffer("lm_head_weight", lm_head_VH, persistent=False)
        self.logical_vocab = int(logical_vocab)
        self.vocab_rows = int(lm_head_VH.shape[0])
        self.hidden_size = int(lm_head_VH.shape[1])
        self.mup_multiplier = float(mup_multiplier)
        # SGLang's LogitsProcessor: an unset, zero or negative cap means no softcap.
        self.logit_softcap = float(logit_softcap) if logit_softcap and logit_softcap > 0 else None
        self.requires_grad_(False)
        self.eval()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw embedding rows `[..., H]` (no embed_norm: what SGLang's DSpark feeds the draft)."""
        return F.embedding(ids, self.embed_weight)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft base logits `lm_head(h / mup)` over all `vocab_rows` columns `[..., V_rows]`,
        in the head's dtype (SGLang's DSpark `project_through_lm_head`; SGLang's DFLASH
        takes the argmax of the undivided product, the same tokens: module docstring)."""
        return F.linear(self._head_input(h), self.lm_head_weight)

    def teacher_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The target's logits `[..., V_rows]` in (at least) float32, as SGLang's Inkling
        serves them: `lm_head(h / mup)` with float32 output, then the softcap if set."""
        z = _float32_out_linear(self._head_input(h), self.lm_head_weight)
        if self.logit_softcap is not None:
            z = self.logit_softcap * torch.tanh(z / self.logit_softcap)
        return z

    def _head_input(self, h: torch.Tensor) -> torch.Tensor:
        """`h / mup` (in h's dtype, as SGLang divides the hidden) in the head's dtype."""
        if self.mup_multiplier != 1.0:
            h = h / self.mup_multiplier
        h = h.to(self.lm_head_weight.dtype)
        if self.head_format is not None:
            from specforge_dspark.engines.quant_targets import activation_round_trip

            h = activation_round_trip(self.head_format, h)
        return h


def _float32_out_linear(x: torch.Tensor, w_VH: torch.Tensor) -> torch.Tensor:
    """`x @ w.T` accumulated and returned in float32 (or wider): the low-precision inputs'
    products are never rounded back to bf16. On CUDA `torch.mm(out_dtype=)` (SGLang's
    kernel, no widened copy of the head); elsewhere the inputs are widened (exactly) first."""
    if w_VH.dtype not in (torch.bfloat16, torch.float16):
        return F.linear(x, w_VH)
    if x.is_cuda:
        z = torch.mm(x.reshape(-1, x.shape[-1]), w_VH.T, out_dtype=torch.float32)
        return z.view(*x.shape[:-1], w_VH.shape[0])
    return F.linear(x.float(), w_VH.float())


def load_frozen_head(
    target_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> FrozenHead:
    """Read the target's embedding and LM head by name; see the module docstring."""
    root = Path(target_path)
    config = _read_json(root / "config.json")
    files = _weight_files(root)
    embed_name = _first_present(EMBED_NAMES, files)
    if embed_name is None:
        raise ValueError(f"{root}: no token embedding found; tried {list(EMBED_NAMES)}")
    tied = bool(config_value(config, "tie_word_embeddings"))
    head_name = None if tied else _first_present(HEAD_NAMES, files)
    embed_shape = _checked_shape(files[embed_name], embed_name, config)
    if head_name is not None:
        head_shape = _checked_shape(files[head_name], head_name, config)
        if head_shape[1] != embed_shape[1]:
            raise ValueError(
                f"{files[head_name].name}: {head_name} has shape {head_shape}, but "
                f"{embed_name} has hidden size {embed_shape[1]}"
            )
    embed = _read(files[embed_name], embed_name, device, dtype)
    head = embed if head_name is None else _read(files[head_name], head_name, device, dtype)
    return FrozenHead(
        embed,
        head,
        logical_vocab(root, config, head.shape[0]),
        mup_multiplier(root),
        config_value(config, "final_logit_softcapping"),
        _head_format(config, head_name),
    )


def load_final_norm(target_path: str | Path) -> torch.Tensor:
    """The target's final RMSNorm weight `[H]` (fp32): the scale of the LM head's input.
    Targets whose norms are zero-centred (Gemma's `1 + weight`) are refused."""
    root = Path(target_path)
    model_type = str(config_value(_read_json(root / "config.json"), "model_type") or "")
    if model_type.startswith("gemma"):
        raise ValueError(f"{root}: {model_type}'s norms scale by 1 + weight; not supported")
    files = _weight_files(root)
    name = _first_present(NORM_NAMES, files)
    if name is None:
        raise ValueError(f"{root}: no final norm found; tried {list(NORM_NAMES)}")
    return _read(files[name], name, "cpu", torch.float32)


def _head_format(config: dict[str, Any], head_name: str | None) -> str | None:
    """The format of a quantized copy's LM head (engines/quant_targets.py), if it is one."""
    from specforge_dspark.engines.quant_targets import MARKER

    spec = config.get(MARKER) or {}
    quantized = head_name is not None and head_name in spec.get("weights", ())
    return spec["format"] if quantized and spec.get("activations") else None


def mup_multiplier(target_path: str | Path) -> float:
    """The target's `logits_mup_width_multiplier` (1 where its config has none)."""
    mult = config_value(
        _read_json(Path(target_path) / "config.json"), "logits_mup_width_multiplier"
    )
    return 1.0 if mult is None else float(mult)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def config_value(config: dict[str, Any], key: str) -> Any:
    """A text-model setting: at the config root, else in `text_config`."""
    if config.get(key) is not None:
        return config[key]
    return (config.get("text_config") or {}).get(key)


def _weight_files(root: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    single = root / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{root}: neither model.safetensors nor model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _first_present(names: tuple[str, ...], files: dict[str, Path]) -> str | None:
    return next((n for n in names if n in files), None)


def _checked_shape(file: Path, name: str, config: dict[str, Any]) -> list[int]:
    """The tensor's shape, checked against config hidden_size / vocab_size when present."""
    with safe_open(str(file), framework="pt") as f:
        shape = list(f.get_slice(name).get_shape())
    hidden, vocab = config_value(config, "hidden_size"), config_value(config, "vocab_size")
    if len(shape) != 2 or (hidden is not None and shape[1] != hidden):
        raise ValueError(f"{file.name}: {name} has shape {shape}, expected [vocab, {hidden}]")
    if vocab is not None and shape[0] != vocab:
        raise ValueError(f"{file.name}: {name} has {shape[0]} rows, config vocab_size is {vocab}")
    return shape


def _read(file: Path, name: str, device: str | torch.device, dtype: torch.dtype) -> torch.Tensor:
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(name).to(device=device, dtype=dtype)


def logical_vocab(root: Path, config: dict[str, Any], rows: int) -> int:
    """Token ids the target can emit (module docstring: Logical vocabulary), <= `rows`."""
    unpadded = config_value(config, "unpadded_vocab_size")
    if unpadded is not None:
        if not 0 < unpadded <= rows:
            raise ValueError(
                f"{root}/config.json: unpadded_vocab_size {unpadded} not in (0, {rows}]"
            )
        return int(unpadded)
    tokenizer = _read_json(root / "tokenizer.json")
    vocab = (tokenizer.get("model") or {}).get("vocab") or {}
    # BPE/WordPiece vocabularies map token -> id; Unigram lists [piece, score] by id.
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t["id"] for t in tokenizer.get("added_tokens", [])]
    return min(rows, max(ids) + 1) if ids else rows
