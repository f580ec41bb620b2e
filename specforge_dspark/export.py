"""Serving export: a trained DSpark draft as an SGLang or a vLLM (`speculators`) checkpoint.

    python -m specforge_dspark.export --checkpoint RUN/ckpt/step-N --format sglang --out DIR
    python -m specforge_dspark.export --checkpoint DIR --format speculators --out DIR

`--checkpoint` is a training step directory (`step-N/` with DeepSpeed's files,
train_state.json and the COMPLETE marker), a checkpoint root holding step directories
(the latest complete one is used), or an exported SGLang directory (re-export). Both
layouts are one directory with `config.json` + `model.safetensors`, floating tensors bf16.
DSPARK_SPEC.md section 6 is the contract; the installed serving code decided the details.

SGLang 0.5.23 (`--speculative-algorithm DSPARK`; `models/dspark.py`, `models/dflash.py`,
`speculative/dspark_components/dspark_config.py`): `DSparkDraft.save_pretrained`, i.e.
`DSparkConfig.to_dict()` (architectures ["Qwen3DSparkModel"], model_type "qwen3", DSpark
keys at the root and in dflash_config) and the draft's own tensor names. `load_weights`
packs q/k/v_proj into `qkv_proj` and gate/up_proj into `gate_up_proj` itself.

speculators 0.9.0 (`speculators.models.dspark`: `DSparkSpeculatorConfig`,
`DSparkDraftModel`, loaded by `SpeculatorModel.from_pretrained`):
- config: `speculators_model_type` "dspark", `speculators_config` (algorithm "dspark", one
  greedy proposal with speculative_tokens = G, the verifier's name and architectures),
  `transformer_layer_config` (Qwen3, vocab_size = LM-head rows, the size of the verifier
  embedding it loads), flat DSpark fields, `sample_from_anchor: true` (slot k predicts
  a+k+1, as SGLang DSPARK and our training).
- `aux_hidden_state_layer_ids = [k + 1 for k in target_layer_ids]`: speculators indexes
  the hidden-states tuple (0 = embeddings), our ids name the layer whose output is used
  (its DFlash converter applies the same +1).
- tensor names: the SGLang names unchanged (same module tree: `fc`, `hidden_norm`,
  `layers.*`, `norm`, `markov_head.markov_w{1,2}`, `confidence_head.proj`). The verifier's
  embedding and LM head are NOT stored: the loader reads them from the verifier by name.
- reduced vocabulary, when the target's LM head has padded rows (logical < rows) or a muP
  multiplier: `draft_vocab_size` = logical vocab, `t2d` (bool [rows], True for the first
  `logical` ids), `d2t` (zeros [logical]: target id = draft id + d2t), `lm_head.weight` =
  target LM head rows [:logical] / mult (speculators keeps a reduced head in the checkpoint
  and has no muP setting, so the multiplier is folded in here), `markov_w2` cropped to its
  first `logical` rows. Draft logits are then exactly ours (training uses the logical
  columns only) and padded ids can never be proposed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specforge_dspark import checkpoint
from specforge_dspark.model import DSparkConfig, DSparkDraft
from specforge_dspark.recipe import Recipe, recipe_from_dict, resolved_dirs

FORMATS = ("sglang", "speculators")
SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose loader this layout was checked against."""


class ExportError(ValueError):
    """An export that cannot be made as asked; the message says what to change."""


# --------------------------------------------------------------------------- API


def export_draft(
    draft_or_state_dict: DSparkDraft | dict[str, torch.Tensor],
    cfg: DSparkConfig | None,
    out_dir: str | Path,
    fmt: str,
    verifier_name: str | None = None,
    target_path: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write one serving layout of a draft to `out_dir` (replaced whole); returns it.

    `cfg` may be None when a `DSparkDraft` is given. speculators needs `target_path` (the
    target directory: LM head, vocab and muP multiplier); `verifier_name` (what vLLM loads
    as the verifier) defaults to its absolute path. `dtype` other than bf16 is for tests.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; expected one of {list(FORMATS)}")
    draft = _as_draft(draft_or_state_dict, cfg)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        staging = Path(tmp) / "out"
        if fmt == "sglang":
            draft.save_pretrained(staging, dtype=dtype)
        else:
            if target_path is None:
                raise ExportError(
                    "the speculators format needs the target directory (target_path / --target)"
                )
            tensors, config = speculators_layout(draft, target_path, verifier_name, dtype)
            _write(staging, tensors, config)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    return out


def export_checkpoint(
    ckpt_dir: str | Path,
    fmt: str,
    out_dir: str | Path,
    target_path: str | Path | None = None,
    verifier_name: str | None = None,
) -> Path:
    """Export a training checkpoint (or an exported SGLang directory) as `fmt`.

    For a training checkpoint the target and verifier name default to the recipe's
    `target.path` and `export.verifier_name`.
    """
    cfg, weights, recipe = read_checkpoint(ckpt_dir)
    if recipe is not None:
        target_path = target_path or recipe.target.path or None
        verifier_name = verifier_name or recipe.export.verifier_name or None
    return export_draft(weights, cfg, out_dir, fmt, verifier_name, target_path)


def export_for_recipe(draft: DSparkDraft, recipe: Recipe) -> list[Path]:
    """Every format in `recipe.export.formats`, each under `<export dir>/<format>`.

    Call it on one rank (rank 0) with the unwrapped draft."""
    root = resolved_dirs(recipe)["export"]
    return [
        export_draft(
            draft,
            draft.config,
            root / fmt,
            fmt,
            verifier_name=recipe.export.verifier_name or None,
            target_path=recipe.target.path or None,
        )
        for fmt in recipe.export.formats
    ]


# --------------------------------------------------------------------------- reading


def read_checkpoint(
    ckpt_dir: str | Path,
) -> tuple[DSparkConfig, dict[str, torch.Tensor], Recipe | None]:
    """(config, fp32 weights, recipe or None) of a training step, a checkpoint root or an
    exported SGLang directory. An incomplete training checkpoint is refused."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise ExportError(f"--checkpoint {path}: no such directory")
    if _is_training_step(path):
        if not checkpoint.is_complete(path):
            raise ExportError(
                f"--checkpoint {path}: incomplete checkpoint (no {checkpoint.MARKER} marker: "
                "the save was interrupted or is still running); export a complete one"
            )
        return _read_training_step(path)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        draft = DSparkDraft.from_pretrained(path)
        return draft.config, draft.state_dict(), None
    if checkpoint.list_checkpoints(path):
        latest = checkpoint.latest_complete(path)
        if latest is None:
            raise ExportError(f"--checkpoint {path}: no complete step-N checkpoint in it")
        return _read_training_step(latest)
    raise ExportError(
        f"--checkpoint {path}: neither a training checkpoint (step-N with train_state.json), "
        "a checkpoint root, nor an exported SGLang directory (config.json + model.safetensors)"
    )


def _is_training_step(path: Path) -> bool:
    return (
        (path / "train_state.json").exists()
        or (path / checkpoint.MARKER).exists()
        or any(path.glob("*_model_states.pt"))
        or any(path.glob("*_optim_states.pt"))
    )


def _read_training_step(path: Path) -> tuple[DSparkConfig, dict[str, torch.Tensor], Recipe]:
    state_file = path / "train_state.json"
    if not state_file.is_file():
        raise ExportError(f"{path}: {state_file.name} is missing")
    state = json.loads(state_file.read_text())
    if "recipe" not in state:
        raise ExportError(f"{state_file}: no 'recipe' entry")
    recipe = recipe_from_dict(state["recipe"], source=str(state_file))
    cfg = DSparkConfig.from_recipe(recipe.draft)
    return cfg, _deepspeed_weights(path, recipe.dist.zero_stage), recipe


def _deepspeed_weights(step: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """The fp32 master weights when ZeRO shards hold them, else the engine's module."""
    if zero_stage >= 1 and any(step.glob("*zero_pp_rank_*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(step.parent), tag=step.name))
    model_states = step / "mp_rank_00_model_states.pt"
    if not model_states.is_file():
        raise ExportError(
            f"{step}: no {model_states.name} and no ZeRO optimizer shards (zero_stage "
            f"{zero_stage}); not a DeepSpeed checkpoint this exporter can read"
        )
    # DeepSpeed's own file holds more than tensors (its engine state), hence weights_only=False.
    saved = torch.load(model_states, map_location="cpu", weights_only=False)
    if "module" not in saved:
        raise ExportError(f"{model_states}: no 'module' entry (the draft's state_dict)")
    return {k: v.float() for k, v in saved["module"].items()}


def _as_draft(
    draft_or_state_dict: DSparkDraft | dict[str, torch.Tensor], cfg: DSparkConfig | None
) -> DSparkDraft:
    """The draft itself, or one built on the given weights (names and shapes checked)."""
    if isinstance(draft_or_state_dict, DSparkDraft):
        draft = draft_or_state_dict
        if cfg is not None and cfg != draft.config:
            raise ExportError("the config given differs from the draft's own config")
        with torch.device("meta"):
            want = {k: v.shape for k, v in DSparkDraft(draft.config).state_dict().items()}
        bad = [k for k, v in draft.state_dict().items() if v.shape != want[k]]
        if bad:  # e.g. a ZeRO-3 engine's module: its parameters live in the shards
            raise ExportError(
                f"the draft's tensors {bad[:3]} do not have their full shapes (partitioned "
                "by ZeRO-3?); gather them, or export the saved checkpoint instead"
            )
        return draft
    if cfg is None:
        raise ExportError("exporting a state_dict needs its DSparkConfig")
    with torch.device("meta"):
        draft = DSparkDraft(cfg)
    try:
        draft.load_state_dict(draft_or_state_dict, strict=True, assign=True)
    except RuntimeError as e:
        raise ExportError(f"the weights do not fit the draft config: {e}") from None
    return draft


# --------------------------------------------------------------------------- speculators


def speculators_layout(
    draft: DSparkDraft,
    target_path: str | Path,
    verifier_name: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and config.json of the speculators layout (module docstring)."""
    from specforge_dspark.frozen_head import load_frozen_head

    cfg = draft.config
    target = Path(target_path)
    target_config = _text_config(target)
    head = load_frozen_head(target)
    rows, logical, mult = head.vocab_rows, head.logical_vocab, head.mup_multiplier
    problems = []
    if rows != cfg.vocab_size:
        problems.append(f"the target LM head has {rows} rows, draft.vocab_size is {cfg.vocab_size}")
    if head.hidden_size != cfg.hidden_size:
        problems.append(f"target hidden {head.hidden_size} != draft.hidden_size {cfg.hidden_size}")
    n_layers = target_config.get("num_hidden_layers")
    if n_layers is not None and n_layers != cfg.num_target_layers:
        problems.append(
            f"target has {n_layers} layers, draft.num_target_layers is {cfg.num_target_layers}"
        )
    last = [k for k in cfg.target_layer_ids if k + 1 >= cfg.num_target_layers]
    if last:
        problems.append(f"target_layer_ids {last}: the last layer's output cannot be captured")
    if mult != 1.0 and logical == rows:
        problems.append(
            f"the target has muP multiplier {mult} and no padded LM-head rows: speculators "
            "0.9.0 can only carry the multiplier in a reduced-vocab LM head"
        )
    if problems:
        raise ExportError(f"speculators export against {target}: " + "; ".join(problems))

    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in draft.state_dict().items()}
    reduced = logical < rows
    if reduced:
        w2 = tensors["markov_head.markov_w2.weight"]
        tensors["markov_head.markov_w2.weight"] = w2[:logical].contiguous()
        # fp32 division, one rounding to the export dtype
        lm_head = head.lm_head_weight[:logical].float() / mult
        tensors["lm_head.weight"] = lm_head.to(dtype).contiguous()
        tensors["t2d"] = torch.arange(rows) < logical
        tensors["d2t"] = torch.zeros(logical, dtype=torch.long)

    architectures = json.loads((target / "config.json").read_text()).get("architectures") or []
    config = {
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg.block_size,  # sample_from_anchor: all G slots
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier_name or str(target.resolve()),
                "architectures": list(architectures),
            },
        },
        "transformer_layer_config": _qwen3_layer_config(cfg),
        "draft_vocab_size": logical if reduced else rows,
        "block_size": cfg.block_size,
        "target_hidden_size": head.hidden_size,
        "aux_hidden_state_layer_ids": [k + 1 for k in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": True,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
    }
    return tensors, config


def _qwen3_layer_config(cfg: DSparkConfig) -> dict[str, Any]:
    """The draft decoder as the transformers Qwen3 config speculators builds its layers from."""
    return {
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,  # the verifier embedding rows the loader fills in
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "layer_types": list(cfg.layer_types),
        "tie_word_embeddings": False,
    }


def _text_config(target: Path) -> dict[str, Any]:
    path = target / "config.json"
    if not path.is_file():
        raise ExportError(f"target {target}: no config.json")
    config = json.loads(path.read_text())
    return config.get("text_config") or config


def _write(path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specforge_dspark.export",
        description="Export a DSpark draft checkpoint for SGLang or vLLM (speculators).",
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="step-N checkpoint, a checkpoint root (latest complete), or an SGLang export",
    )
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--out", required=True, help="output directory (replaced)")
    parser.add_argument(
        "--target", default=None, help="target model directory (default: recipe target.path)"
    )
    parser.add_argument(
        "--verifier-name",
        default=None,
        help="verifier recorded in the speculators config (default: export.verifier_name, "
        "else the target's absolute path)",
    )
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(
            args.checkpoint, args.format, args.out, args.target, args.verifier_name
        )
    except ValueError as e:  # ExportError, RecipeError, bad config.json
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    print(f"{args.format} export written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
