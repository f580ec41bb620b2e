"""Serving export: a trained DSpark draft as an SGLang or a vLLM (`speculators`) checkpoint.

    python -m specforge_dspark.export --checkpoint RUN/ckpt/step-N --format sglang --out DIR
    python -m specforge_dspark.export --checkpoint DIR --format speculators --out DIR \
        [--speculators-vocab full|reduced]

`--checkpoint` is a training step directory (`step-N/` with DeepSpeed's files,
train_state.json and the COMPLETE marker), a checkpoint root holding step directories
(the latest complete one is used), or an exported SGLang directory (re-export). Both
layouts are one directory with `config.json` + `model.safetensors`, floating tensors bf16.
DSPARK_SPEC.md section 6 is the contract; the installed serving code decided the details.

SGLang 0.5.23 (`--speculative-algorithm DSPARK`; `models/dspark.py`, `models/dflash.py`,
`speculative/dspark_components/dspark_config.py`): `DSparkDraft.save_pretrained`, i.e.
`DSparkConfig.to_dict()` (architectures ["Qwen3DSparkModel"], model_type "qwen3", DSpark
keys at the root and in dflash_config) and the draft's own tensor names. `load_weights`
packs q/k/v_proj into `qkv_proj` and gate/up_proj into `gate_up_proj` itself. SGLang
divides `h` by the target's muP multiplier itself (`compute_base_logits`), so this layout
stores the trained weights unchanged.

speculators 0.9.0 (`speculators.models.dspark`: `DSparkSpeculatorConfig`,
`DSparkDraftModel`, loaded by `SpeculatorModel.from_pretrained`; paths below are under
site-packages/speculators/):
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
  embedding is never stored: the loader reads it from the verifier by name.
- vocabulary, `export.speculators_vocab` / `--speculators-vocab`:
  "full" (default; what the published Inkling-Small DSpark drafter ships, and what we
  train: the draft softmax covers every LM-head row, as SGLang serves it):
  `draft_vocab_size` = LM-head rows, no `t2d`/`d2t`, `markov_w2` uncropped, no
  `lm_head.weight`. speculators then treats the draft as full-vocab
  (`use_draft_vocab = draft_vocab_size != verifier_vocab_size`, model.py:48; no t2d/d2t
  buffers, model.py:51-55) and takes the LM head from the verifier itself: it reads
  the verifier's `lm_head.weight` (model.py:156-166) and OVERWRITES the draft's
  `lm_head` with it on every load (`overwrite_lm_head=not self.use_draft_vocab`,
  models/dflash/core.py:171-176; model.py:182-185, called from `from_pretrained`,
  model.py:396-398), and never saves one (models/dflash/core.py:158-160). A stored
  `lm_head.weight` = head / mult would therefore be discarded on load.
  speculators has no muP setting (no `mup`/`logit_scale` anywhere in the package): its
  base logits are `lm_head(norm(x))` (models/dflash/core.py:468-469), and that same
  normed `hidden` feeds the Markov head (gated/rnn) and the confidence head
  (models/dspark/core.py:169-196). So the multiplier is folded into the draft's final
  norm: `norm.weight / mult` (then `h' = h / mult` and `lm_head(h') = lm_head(h / mult)`,
  our base logits), and every head that reads `h` gets its `h` input columns multiplied
  by `mult` so it sees `h` again: `confidence_head.proj.weight[:, :H]`,
  `markov_head.gate_proj.weight[:, :H]` (gated: input [h ; W1[prev]]),
  `markov_head.joint_proj.weight[:, 2R:2R+H]` (rnn: input [s ; W1[prev] ; h]). Both
  products are exact in bf16 for a power-of-two multiplier (Inkling's tiny target: 4);
  otherwise each adds one rounding, the size of the bf16 export rounding itself. vLLM's
  DSpark (upstream `vllm/model_executor/models/qwen3_dspark.py`, read from the public
  source, not installed here) computes the same: without a stored `lm_head` it aliases
  the target's LM head module (`load_dspark_model`), maps a draft vocab >= the target's
  as the identity (no d2t), and scales base logits AND Markov bias by the draft config's
  `logit_scale` (default 1.0, which we leave unset), never by the target's muP
  multiplier, so the folded norm is what makes its logits ours.
  "reduced" (for vLLM builds without the identity map for a full padded-vocab draft;
  needs padded rows): `draft_vocab_size` = logical vocab, `t2d` (bool [rows], True for
  the first `logical` ids), `d2t` (zeros [logical]: target id = draft id + d2t),
  `lm_head.weight` = target LM head rows [:logical] / mult (speculators keeps a reduced
  head in the checkpoint, models/dflash/core.py:147-160), `markov_w2` cropped to its first
  `logical` rows. Its draft logits are ours on the logical columns; padded ids can never
  be proposed.

Conventions record (both layouts): config.json key `"specforge_dspark"` (SGLang's
parser reads DSpark keys by name, `dspark_config.py` `parse_dspark_draft_config`, and
transformers keeps unknown keys as attributes; speculators' config allows extra keys,
config.py:252) holds what a server must agree with: `format_version`
(CONVENTIONS_VERSION), `sample_from_anchor` + `slot_convention`, `tap_convention`
(`engines.features.tap_convention` of the target's config.json), `layer_id_convention`
with `target_layer_ids` / `aux_hidden_state_layer_ids` / `num_target_layers`,
`mask_token_id`, `logical_vocab`, `vocab_rows` (LM-head rows), `mup_multiplier`, and how
the multiplier is applied (`mup_folded_into`: null = by the server, "norm.weight",
"lm_head.weight"); the speculators layout adds `speculators_vocab`. Target facts are
null when exported without a target. Re-exporting a directory, or `check_conventions`
on a directory a run starts from, refuses (ExportError naming the field and both
values) a record that disagrees with the recipe / target at hand; null is not checked.
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

from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft
from specforge_dspark.engines.features import tap_convention
from specforge_dspark.frozen_head import _config_value, _logical_vocab, load_frozen_head
from specforge_dspark.recipe import Recipe, recipe_from_dict, resolved_dirs
from specforge_dspark.training import checkpoint

FORMATS = ("sglang", "speculators")
SPECULATORS_VOCABS = ("full", "reduced")
SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose loader this layout was checked against."""
CONVENTIONS_KEY = "specforge_dspark"
CONVENTIONS_VERSION = 1
"""Version of the conventions record; a record of another version is refused."""
SLOT_CONVENTION = "slot k of the block anchored at position a predicts token a+k+1"
LAYER_ID_CONVENTION = (
    "target_layer_ids: decoder layer k output (0-based); "
    "aux_hidden_state_layer_ids: k+1 (hidden-states index, 0 = embeddings)"
)
CHECKED = (
    "format_version",
    "sample_from_anchor",
    "slot_convention",
    "tap_convention",
    "layer_id_convention",
    "target_layer_ids",
    "num_target_layers",
    "mask_token_id",
    "logical_vocab",
    "vocab_rows",
    "mup_multiplier",
)
"""Conventions compared between a record and the recipe / target at hand."""


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
    speculators_vocab: str = "full",
    known: dict[str, Any] | None = None,
) -> Path:
    """Write one serving layout of a draft to `out_dir` (replaced whole); returns it.

    `cfg` may be None when a `DSparkDraft` is given. speculators needs `target_path` (the
    target directory: LM head, vocab and muP multiplier); `verifier_name` (what vLLM loads
    as the verifier) defaults to its absolute path; `speculators_vocab` is "full" or
    "reduced" (module docstring). `known`: conventions already recorded for this draft
    (checked against the target; they fill in what the target does not say). `dtype`
    other than bf16 is for tests.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; expected one of {list(FORMATS)}")
    if speculators_vocab not in SPECULATORS_VOCABS:
        raise ExportError(
            f"export.speculators_vocab (--speculators-vocab) is {speculators_vocab!r}; "
            f"expected one of {list(SPECULATORS_VOCABS)}"
        )
    draft = _as_draft(draft_or_state_dict, cfg)
    record = conventions(draft.config, target_path)
    if known:
        _check(known, record, "the conventions recorded for this draft", f"target {target_path}")
        record |= {k: known[k] for k, v in record.items() if v is None and k in known}
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        staging = Path(tmp) / "out"
        if fmt == "sglang":
            draft.save_pretrained(staging, dtype=dtype)
            config_file = staging / "config.json"
            config = json.loads(config_file.read_text())
            config[CONVENTIONS_KEY] = {**record, "mup_folded_into": None}
            config_file.write_text(json.dumps(config, indent=2) + "\n")
        else:
            if target_path is None:
                raise ExportError(
                    "the speculators format needs the target directory (target_path / --target)"
                )
            tensors, config = speculators_layout(
                draft, target_path, verifier_name, dtype, speculators_vocab
            )
            config[CONVENTIONS_KEY] = {**record, **config[CONVENTIONS_KEY]}
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
    speculators_vocab: str | None = None,
) -> Path:
    """Export a training checkpoint (or an exported SGLang directory) as `fmt`.

    For a training checkpoint the target, verifier name and speculators vocabulary default
    to the recipe's `target.path`, `export.verifier_name` and `export.speculators_vocab`
    (else "full"). The conventions the checkpoint records must agree with the target.
    A DFlash checkpoint (recipe `draft.kind: dflash`) goes to `export_dflash`.
    """
    from specforge_dspark.export import dflash as export_dflash

    if export_dflash.checkpoint_kind(ckpt_dir) == "dflash":
        return export_dflash.export_dflash_checkpoint(ckpt_dir, fmt, out_dir, target_path)
    cfg, weights, recipe = read_checkpoint(ckpt_dir)
    if recipe is not None:
        target_path = target_path or recipe.target.path or None
        verifier_name = verifier_name or recipe.export.verifier_name or None
        speculators_vocab = speculators_vocab or recipe.export.speculators_vocab
    known = recorded_conventions(ckpt_dir)
    try:
        return export_draft(
            weights,
            cfg,
            out_dir,
            fmt,
            verifier_name,
            target_path,
            speculators_vocab=speculators_vocab or "full",
            known=known,
        )
    except ExportError as e:
        raise ExportError(f"--checkpoint {ckpt_dir}: {e}") from None


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
            speculators_vocab=recipe.export.speculators_vocab,
        )
        for fmt in recipe.export.formats
    ]


# --------------------------------------------------------------------------- conventions


def conventions(cfg: DSparkConfig, target_path: str | Path | None = None) -> dict[str, Any]:
    """The conventions record (module docstring) of a draft served against a target; the
    target's facts (tap, logical vocab, muP multiplier) are None without `target_path`.
    Reads the target's config.json (and tokenizer.json), never its weights."""
    record: dict[str, Any] = {
        "format_version": CONVENTIONS_VERSION,
        "sample_from_anchor": True,
        "slot_convention": SLOT_CONVENTION,
        "tap_convention": None,
        "layer_id_convention": LAYER_ID_CONVENTION,
        "target_layer_ids": list(cfg.target_layer_ids),
        "aux_hidden_state_layer_ids": [k + 1 for k in cfg.target_layer_ids],
        "num_target_layers": cfg.num_target_layers,
        "mask_token_id": cfg.mask_token_id,
        "logical_vocab": None,
        "vocab_rows": cfg.vocab_size,
        "mup_multiplier": None,
    }
    if target_path:
        record |= _target_conventions(Path(target_path), cfg.vocab_size)
    return record


def _target_conventions(root: Path, vocab_rows: int | None) -> dict[str, Any]:
    """tap, logical vocab and muP multiplier of a target, from its config.json (and
    tokenizer.json); refuses a target whose LM-head rows are not `vocab_rows`."""
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ExportError(f"target {root}: no config.json")
    config = json.loads(config_file.read_text())
    rows = int(_config_value(config, "vocab_size") or vocab_rows)
    if vocab_rows is not None and rows != vocab_rows:
        raise ExportError(
            f"vocab_rows: the target {root} has {rows} LM-head rows (config.json "
            f"vocab_size), the draft has {vocab_rows}"
        )
    mult = _config_value(config, "logits_mup_width_multiplier")
    return {
        "tap_convention": tap_convention(config),
        "logical_vocab": _logical_vocab(root, config, rows),
        "mup_multiplier": 1.0 if mult is None else float(mult),
    }


def recorded_conventions(path: str | Path) -> dict[str, Any]:
    """The conventions a drafter directory or training checkpoint records, as far as it
    records them (absent = unknown). An export's `specforge_dspark` record, with the draft
    fields its config root serves; a training checkpoint's recipe draft, with the tap of
    its features fingerprint. {} for anything else."""
    kind, resolved = _resolve(Path(path))
    if kind == "training":
        state_file = resolved / "train_state.json"
        state = json.loads(state_file.read_text()) if state_file.is_file() else {}
        if "recipe" not in state:
            return {}
        recipe = recipe_from_dict(state["recipe"], source=str(state_file))
        record = conventions(DSparkConfig.from_recipe(recipe.draft))
        features = (state.get("fingerprint") or {}).get("features") or {}
        return record | {"tap_convention": features.get("tap_convention")}
    if kind != "export":
        return {}
    config = json.loads((resolved / "config.json").read_text())
    if "speculators_model_type" in config:
        aux = config.get("aux_hidden_state_layer_ids")
        served = {
            "mask_token_id": config.get("mask_token_id"),
            "target_layer_ids": None if aux is None else [k - 1 for k in aux],
            "vocab_rows": (config.get("transformer_layer_config") or {}).get("vocab_size"),
        }
    else:  # the draft fields SGLang serves, from the config root
        cfg = DSparkConfig.from_dict(config)
        served = {
            "target_layer_ids": cfg.target_layer_ids,
            "num_target_layers": cfg.num_target_layers,
            "mask_token_id": cfg.mask_token_id,
            "vocab_rows": cfg.vocab_size,
        }
    served["sample_from_anchor"] = config.get("sample_from_anchor", True)
    return (config.get(CONVENTIONS_KEY) or {}) | {k: v for k, v in served.items() if v is not None}


def check_conventions(
    path: str | Path, recipe: Recipe | None = None, target_path: str | Path | None = None
) -> None:
    """Refuse (ExportError naming the field and both values) a drafter directory or
    training checkpoint whose recorded conventions disagree with `recipe` (its draft: slot,
    layer ids, mask token, LM-head rows; its target: tap, logical vocab, muP) or, without
    a recipe, with the target at `target_path` (default: the recipe's `target.path`).
    Call it before loading a drafter to train on (`draft.init_from`) or to evaluate.
    """
    recorded = recorded_conventions(path)
    target = target_path or (recipe.target.path if recipe is not None else None) or None
    if recipe is not None:
        want = conventions(DSparkConfig.from_recipe(recipe.draft), target)
        here = f"recipe {recipe.source or '<dict>'}"
    else:
        want = (
            {} if target is None else _target_conventions(Path(target), recorded.get("vocab_rows"))
        )
        here = f"target {target}"
    _check(recorded, want, str(path), here)


def _check(recorded: dict[str, Any], want: dict[str, Any], there: str, here: str) -> None:
    for key in CHECKED:
        got, expected = recorded.get(key), want.get(key)
        if got is not None and expected is not None and got != expected:
            raise ExportError(
                f"conventions: {key} is {got!r} in {there} but {expected!r} for {here}; "
                "it was made for a different target or draft setting"
            )


# --------------------------------------------------------------------------- reading


def read_checkpoint(
    ckpt_dir: str | Path,
) -> tuple[DSparkConfig, dict[str, torch.Tensor], Recipe | None]:
    """(config, fp32 weights, recipe or None) of a training step, a checkpoint root or an
    exported SGLang directory. An incomplete training checkpoint is refused."""
    path = Path(ckpt_dir)
    kind, resolved = _resolve(path)
    if kind == "training":
        return _read_training_step(resolved)
    if kind == "export":
        if "speculators_model_type" in json.loads((resolved / "config.json").read_text()):
            raise ExportError(
                f"--checkpoint {path}: a speculators export cannot be read back (its "
                "norm.weight or lm_head.weight carries the folded muP multiplier); export "
                "the training checkpoint or the SGLang export instead"
            )
        draft = DSparkDraft.from_pretrained(resolved)
        return draft.config, draft.state_dict(), None
    raise ExportError(
        f"--checkpoint {path}: neither a training checkpoint (step-N with train_state.json), "
        "a checkpoint root, nor an exported SGLang directory (config.json + model.safetensors)"
    )


def _resolve(path: Path) -> tuple[str, Path]:
    """("training", step dir) | ("export", dir) | ("unknown", path); refuses incomplete
    training checkpoints and roots without a complete one."""
    if not path.is_dir():
        raise ExportError(f"--checkpoint {path}: no such directory")
    if _is_training_step(path):
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
    vocab: str = "full",
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and config.json of the speculators layout (module docstring); the
    config's `specforge_dspark` entry holds only the layout's own fields."""
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
    if vocab == "reduced" and mult != 1.0 and logical == rows:
        problems.append(
            f"the target has muP multiplier {mult} and no padded LM-head rows: the reduced "
            "vocabulary would be the full one, which carries no LM head; use "
            "--speculators-vocab full (export.speculators_vocab: full)"
        )
    if problems:
        raise ExportError(f"speculators export against {target}: " + "; ".join(problems))

    # fp32 arithmetic, one rounding to the export dtype
    state = {k: v.detach().to("cpu", torch.float32) for k, v in draft.state_dict().items()}
    reduced = vocab == "reduced" and logical < rows
    if reduced:
        state["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][:logical]
        state["lm_head.weight"] = head.lm_head_weight[:logical].float() / mult
        folded = "lm_head.weight"
    elif mult != 1.0:
        _fold_mup_into_norm(state, cfg, mult)
        folded = "norm.weight"
    else:
        folded = None
    tensors = {k: v.to(dtype).contiguous() for k, v in state.items()}
    if reduced:
        tensors["t2d"] = torch.arange(rows) < logical
        tensors["d2t"] = torch.zeros(logical, dtype=torch.long)

    architectures = json.loads((target / "config.json").read_text()).get("architectures") or []
    config = speculators_config(
        cfg,
        draft_vocab_size=logical if reduced else rows,
        target_hidden_size=head.hidden_size,
        verifier=verifier_name or str(target.resolve()),
        verifier_architectures=list(architectures),
        dtype=dtype,
        reduced=reduced,
        folded=folded,
    )
    return tensors, config


def speculators_config(
    cfg: DSparkConfig,
    *,
    draft_vocab_size: int,
    target_hidden_size: int,
    verifier: str,
    verifier_architectures: list[str],
    dtype: torch.dtype = torch.bfloat16,
    reduced: bool = False,
    folded: str | None = None,
) -> dict[str, Any]:
    """The speculators config.json of a draft (what `speculators_layout` writes), from
    shapes alone: no weights are read."""
    return {
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
                "name_or_path": verifier,
                "architectures": list(verifier_architectures),
            },
        },
        "transformer_layer_config": _qwen3_layer_config(cfg),
        "draft_vocab_size": draft_vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": target_hidden_size,
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
        CONVENTIONS_KEY: {
            "speculators_vocab": "reduced" if reduced else "full",
            "mup_folded_into": folded,
        },
    }


def _fold_mup_into_norm(state: dict[str, torch.Tensor], cfg: DSparkConfig, mult: float) -> None:
    """`h' = h / mult` out of the final norm; the heads reading `h` get its columns x mult."""
    H, R = cfg.hidden_size, cfg.markov_rank
    state["norm.weight"] = state["norm.weight"] / mult
    h_columns = {
        "confidence_head.proj.weight": slice(0, H),  # [h ; W1[prev]] or h
        "markov_head.gate_proj.weight": slice(0, H),  # gated: [h ; W1[prev]]
        "markov_head.joint_proj.weight": slice(2 * R, 2 * R + H),  # rnn: [s ; W1[prev] ; h]
    }
    for name, columns in h_columns.items():
        if name in state:
            w = state[name].clone()
            w[:, columns] *= mult
            state[name] = w


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
    parser.add_argument(
        "--speculators-vocab",
        default=None,
        choices=SPECULATORS_VOCABS,
        help="speculators draft vocabulary: full (every LM-head row, no t2d/d2t) or reduced "
        "(logical vocab + t2d/d2t, for vLLM builds without the full-vocab identity map); "
        "default: export.speculators_vocab, else full",
    )
    args = parser.parse_args(argv)
    if args.speculators_vocab and args.format != "speculators":
        print(f"warning: --speculators-vocab is ignored by --format {args.format}", file=sys.stderr)
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.format,
            args.out,
            args.target,
            args.verifier_name,
            args.speculators_vocab,
        )
    except ValueError as e:  # ExportError, RecipeError, bad config.json
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    print(f"{args.format} export written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
