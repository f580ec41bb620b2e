"""What an export starts from: a training step directory, a checkpoint root (its latest
complete step) or an exported SGLang directory; the recipe and DeepSpeed weights of a
training step (specforge_dspark/training/checkpoint.py wrote them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specforge_dspark.config.recipe import Recipe, recipe_from_dict
from specforge_dspark.export import ExportError
from specforge_dspark.training import checkpoint
from specforge_dspark.training.safe_load import safe_load, verify_step


def resolve_checkpoint(path: Path) -> tuple[str, Path]:
    """("training", step dir) | ("export", dir) | ("unknown", path); refuses incomplete
    training checkpoints and roots without a complete one."""
    if not path.is_dir():
        raise ExportError(f"--checkpoint {path}: no such directory")
    if is_training_step(path):
        if not checkpoint.is_complete(path):
            raise ExportError(
                f"--checkpoint {path}: incomplete checkpoint (no {checkpoint.MARKER} marker: "
                "the save was interrupted or is still running); export a complete one"
            )
        return "training", path
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return "export", path
    if checkpoint.list_checkpoints(path):
        latest = checkpoint.latest_complete(path)
        if latest is None:
            raise ExportError(f"--checkpoint {path}: no complete step-N checkpoint in it")
        return "training", latest
    return "unknown", path


def is_training_step(path: Path) -> bool:
    """Whether `path` looks like a training step directory, complete or not."""
    return (
        (path / "train_state.json").exists()
        or (path / checkpoint.MARKER).exists()
        or any(path.glob("*_model_states.pt"))
        or any(path.glob("*_optim_states.pt"))
    )


def checkpoint_kind(ckpt_dir: str | Path) -> str:
    """The drafter kind of a training checkpoint (its recipe) or SGLang export (its
    `architectures`, drafters/registry.py), "dspark" when neither says."""
    from specforge_dspark.drafters.registry import kind_of_dir

    kind, resolved = resolve_checkpoint(Path(ckpt_dir))
    if kind == "export":
        return kind_of_dir(resolved)
    state_file = resolved / "train_state.json"
    if kind == "training" and state_file.is_file():
        raw = json.loads(state_file.read_text()).get("recipe") or {}
        return (raw.get("draft") or {}).get("kind", "dspark")
    return "dspark"


def step_recipe(step: Path) -> Recipe:
    """The recipe a training step directory was saved with (its train_state.json)."""
    state_file = step / "train_state.json"
    if not state_file.is_file():
        raise ExportError(f"{step}: {state_file.name} is missing")
    state = json.loads(state_file.read_text())
    if "recipe" not in state:
        raise ExportError(f"{state_file}: no 'recipe' entry")
    return recipe_from_dict(state["recipe"], source=str(state_file))


def deepspeed_weights(step: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """The fp32 master weights when ZeRO shards hold them, else the engine's module; every
    file of `step` passes the safe loader first (training/safe_load.py)."""
    verify_step(step)
    if zero_stage >= 1 and any(step.glob("*zero_pp_rank_*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(step.parent), tag=step.name))
    model_states = step / "mp_rank_00_model_states.pt"
    if not model_states.is_file():
        raise ExportError(
            f"{step}: no {model_states.name} and no ZeRO optimizer shards (zero_stage "
            f"{zero_stage}); not a DeepSpeed checkpoint this exporter can read"
        )
    saved = safe_load(model_states, map_location="cpu")
    if "module" not in saved:
        raise ExportError(f"{model_states}: no 'module' entry (the draft's state_dict)")
    return {k: v.float() for k, v in saved["module"].items()}
