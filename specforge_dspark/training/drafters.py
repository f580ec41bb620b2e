"""The drafters of one run: the recipe's own and its companions (config/companions.py),
trained from one feature stream (train.py runs every micro-batch through each in turn).

Each drafter has its own DeepSpeed engine (weights, optimizer, LR schedule), folders,
non-finite guard, metric window and TrainState. The data cursor (step, micro step, epoch,
samples, tokens) is the run's: each companion's TrainState follows the main one's
(`follow`), so every drafter's checkpoint is a complete checkpoint of that drafter alone.

Checkpoints: every drafter saves at every save step, and older ones are pruned only once
all have saved (`save_all`), so a kill between two drafters' saves leaves an earlier step
complete in every root; `--resume auto` takes the latest step complete in all of them
(`resolve_resume`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specforge_dspark.config.recipe import Recipe, resolved_dirs
from specforge_dspark.training import checkpoint
from specforge_dspark.training.ckpt_files import is_complete, list_checkpoints, remove

CURSOR = ("step", "micro_step", "epoch", "epoch_samples", "grad_accum", "tokens")
"""TrainState fields that are the run's, not a drafter's."""


@dataclass
class Drafter:
    name: str
    """"" for the recipe's own drafter, else its companion name."""
    recipe: Recipe
    dirs: dict[str, Path]
    engine: Any = None
    state: Any = None
    """Its TrainState (the run's own for the main drafter; a follower for a companion)."""
    guard: Any = None
    """NonFiniteGuard, window (StepWindow), tracker and evals (EvalPool): set by train.py."""
    window: Any = None
    tracker: Any = None
    evals: Any = None

    @property
    def label(self) -> str:
        return self.name or "main"


def construct_draft(recipe: Recipe) -> torch.nn.Module:
    """The draft network of `recipe`, fresh or from draft.init_from. Seeded by train.seed
    right before, so that each drafter of a run starts from the weights a single-drafter
    job of it would."""
    from specforge_dspark.drafters.registry import KINDS, new_draft

    torch.manual_seed(recipe.train.seed)
    d = recipe.draft
    if d.init_from and d.kind != "dspark":  # the DFlash kinds
        kind = KINDS[d.kind]
        draft = kind.network.from_pretrained(d.init_from)
        want = kind.config.from_recipe(d)
        if hasattr(want, "output_multiplier"):  # written by the exporter, not the recipe
            want.output_multiplier = draft.config.output_multiplier
        if draft.config != want:
            raise ValueError(f"draft.init_from {d.init_from}: config differs")
        return draft
    if d.init_from:  # same slot, tap, layer ids, mask and vocab as this run
        from specforge_dspark.drafters.conventions import check_against, served_conventions
        from specforge_dspark.drafters.dspark import DSparkDraft

        check_against(served_conventions(d.init_from), d.init_from, recipe)
        return DSparkDraft.from_pretrained(d.init_from)
    draft = new_draft(d)
    if d.norm_from_target:
        from specforge_dspark.objective.frozen_head import load_final_norm

        weight, want = load_final_norm(recipe.target.path), draft.norm.weight
        if weight.shape != want.shape:
            raise ValueError(f"draft.norm_from_target: the target's final norm has shape "
                             f"{tuple(weight.shape)}, the draft's {tuple(want.shape)}")  # fmt: skip
        with torch.no_grad():
            draft.norm.weight.copy_(weight)
    return draft


def companion_recipes(recipe: Recipe) -> list[tuple[str, Recipe]]:
    from specforge_dspark.config.companions import companion_recipe

    return [(c.name, companion_recipe(recipe, i)) for i, c in enumerate(recipe.companions)]


def checkpoint_roots(recipe: Recipe) -> list[Path]:
    """Every drafter's checkpoint folder, the recipe's own first."""
    rest = [resolved_dirs(r)["checkpoint"] for _, r in companion_recipes(recipe)]
    return [resolved_dirs(recipe)["checkpoint"], *rest]


def resolve_resume(arg: str | None, roots: list[Path]) -> Path | None:
    """checkpoint.resolve_resume over several drafters' roots: `auto` is the latest step
    complete in every root; a step directory of the first root needs the same step
    complete in the others. Returns the first root's step directory (or None)."""
    if len(roots) == 1 or not arg or arg == "none":
        return checkpoint.resolve_resume(arg, roots[0])
    if arg == "auto":
        common = set.intersection(*(_complete_steps(r) for r in roots))
        return checkpoint.step_dir(roots[0], max(common)) if common else None
    path = checkpoint.resolve_resume(arg, roots[0])
    for root in roots[1:]:
        other = checkpoint.step_dir(root, int(path.name.split("-")[1]))
        if not is_complete(other):
            raise checkpoint.ResumeError(
                f"--resume {arg}: the companion drafter's {other} is missing or incomplete; "
                "resume from a step every drafter saved (--resume auto finds the latest)"
            )
    return path


def _complete_steps(root: Path) -> set[int]:
    return {s for s, p in list_checkpoints(root) if is_complete(p)}


def follow(state, main) -> None:
    """Set a companion's TrainState to the run's data cursor."""
    for key in CURSOR:
        setattr(state, key, getattr(main, key))


def load_companion(engine, recipe: Recipe, step_path: Path, main, fingerprint: dict):
    """Collective: a companion's weights, optimizer and state at the main resume step."""
    root = resolved_dirs(recipe)["checkpoint"]
    state = checkpoint.load(engine, checkpoint.step_dir(root, main.step), recipe, fingerprint)
    follow(state, main)
    return state


def save_all(run, drafters: list[Drafter]) -> Path:
    """Collective: every drafter's checkpoint of this step (with its metric window); then,
    with several drafters, the steps beyond checkpoint.keep_last pruned from every root.
    Returns the main drafter's step directory."""
    keep = run.recipe.checkpoint.keep_last
    one = len(drafters) == 1
    paths = []
    for d in drafters:  # keep_last 0: nothing pruned until every drafter has saved
        d.window.save_into(d.state)
        root, fp = d.dirs["checkpoint"], run.fingerprint
        paths.append(checkpoint.save(d.engine, root, d.state, d.recipe, keep if one else 0, fp))
    if not one and run.rank == 0:
        prune_common([d.dirs["checkpoint"] for d in drafters], keep, run.state.step)
    return paths[0]


def prune_common(roots: list[Path], keep: int, step: int) -> None:
    """Keep the newest `keep` steps (up to `step`) complete in every root; steps past
    `step` (saved before a resume from an earlier common step) are left alone."""
    common = set.intersection(*(_complete_steps(r) for r in roots))
    kept = set(sorted(s for s in common if s <= step)[-keep:])
    for root in roots:
        for s, p in list_checkpoints(root):
            if s <= step and s not in kept:
                remove(p)
