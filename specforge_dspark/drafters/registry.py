"""The drafter kinds (`draft.kind`): one `DrafterKind` line each in `KINDS`.

A new kind is a network module beside dspark.py / dflash.py (config dataclass with
`from_recipe` / `from_dict` / `to_dict`; network with `from_pretrained` /
`save_pretrained`, `context`, `context_kv`, `decode`, `masks`, `num_drafts`,
`apply_heads` and `propose`, which is all that objective/loss.py and
decoding/spec_decode.py call) and one line here; its loss is objective/loss.py's
`compute_loss` unless the kind needs its own. Nothing under drafters/ or objective/
imports this module.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from specforge_dspark.drafters.dflash import ARCHITECTURE as DFLASH_ARCH
from specforge_dspark.drafters.dflash import DFlashConfig, DFlashDraft
from specforge_dspark.drafters.dflash2 import ARCHITECTURE as DFLASH2_ARCH
from specforge_dspark.drafters.dflash2 import DFlash2Config, DFlash2Draft
from specforge_dspark.drafters.dspark import ARCHITECTURE as DSPARK_ARCH
from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft
from specforge_dspark.drafters.layers import normal_init_
from specforge_dspark.objective.loss import compute_loss
from specforge_dspark.objective.metrics import LossOutput
from specforge_dspark.objective.selector_loss import selector_term

if TYPE_CHECKING:
    from specforge_dspark.config.recipe import DraftRecipe


@dataclass(frozen=True)
class DrafterKind:
    """Everything the trainer, the exporter and the evaluators need to know of one kind."""

    config: type
    """Config dataclass: `from_recipe(DraftRecipe)`, `from_dict(config.json)`, `to_dict()`."""
    network: type[nn.Module]
    """Network built from the config; `from_pretrained(path)` loads an exported one."""
    loss: Callable[..., LossOutput]
    """`compute_loss`'s signature: (draft, head, ids, mask, aux, last, obj, generator, group,
    position_ids_BS)."""
    architecture: str
    """The config.json `architectures` entry SGLang serves this kind as."""
    algorithm: str
    """SGLang's `--speculative-algorithm` that serves it."""


KINDS: dict[str, DrafterKind] = {
    "dspark": DrafterKind(DSparkConfig, DSparkDraft, compute_loss, DSPARK_ARCH, "DSPARK"),
    "dflash": DrafterKind(DFlashConfig, DFlashDraft, compute_loss, DFLASH_ARCH, "DFLASH"),
    "dflash2": DrafterKind(
        DFlash2Config,
        DFlash2Draft,
        partial(compute_loss, extra=selector_term),
        DFLASH2_ARCH,
        "DFLASH",
    ),
}
DEFAULT_KIND = "dspark"
"""The kind of an exported directory whose `architectures` names no registered kind."""


def _kind(kind: str) -> DrafterKind:
    if kind not in KINDS:
        raise ValueError(f"draft.kind must be one of {sorted(KINDS)}, got {kind!r}")
    return KINDS[kind]


def new_draft(draft: DraftRecipe) -> nn.Module:
    """A freshly initialised drafter of `draft.kind` (builds on the current default device),
    with `draft.init`'s weights."""
    k = _kind(draft.kind)
    network = k.network(k.config.from_recipe(draft))
    if draft.init == "normal":
        normal_init_(network, draft.init_std)
    elif draft.init == "normal_backbone":
        for name, child in network.named_children():
            if name != "markov_head":
                normal_init_(child, draft.init_std)
    return network


def kind_of_dir(path: str | Path) -> str:
    """The kind of an exported SGLang-layout drafter, by its config.json `architectures`."""
    architectures = json.loads((Path(path) / "config.json").read_text()).get("architectures")
    found = [name for name, k in KINDS.items() if k.architecture in (architectures or [])]
    return found[0] if found else DEFAULT_KIND


def load_draft(path: str | Path) -> nn.Module:
    """An exported SGLang-layout drafter of the kind its `architectures` names."""
    return KINDS[kind_of_dir(path)].network.from_pretrained(path)


def loss_fn(kind: str) -> Callable[..., LossOutput]:
    """The loss of `kind` (`compute_loss`'s signature)."""
    return _kind(kind).loss
