"""The speculators (vLLM) layout of a DSpark draft: speculators 0.9.0
(`speculators.models.dspark`: `DSparkSpeculatorConfig`, `DSparkDraftModel`, loaded by
`SpeculatorModel.from_pretrained`; paths below are under site-packages/speculators/).

- config: `speculators_model_type` "dspark", `speculators_config` (algorithm "dspark", one
  greedy proposal with speculative_tokens = G, the verifier's name and architectures),
  `transformer_layer_config` (Qwen3, vocab_size = LM-head rows, the size of the verifier
  embedding it loads), flat DSpark fields, `sample_from_anchor: true` (slot k predicts
  a+k+1, as SGLang DSPARK and our training).
- `aux_hidden_state_layer_ids = [k + 1 for k in target_layer_ids]`: speculators indexes
  the hidden-states tuple (0 = embeddings), our ids name the layer whose output is used
  (its DFlash converter applies the same +1).
- Markov head: vanilla only. vLLM 0.32's DSpark builds only `DSparkMarkovHead` (markov_w1,
  markov_w2) whatever `markov_head_type` says, so a gated or rnn drafter is refused here
  (it would be served without its gate or recurrence); the sglang format serves them.
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
  our base logits), and the confidence head, which reads `h`, gets its `h` input columns
  multiplied by `mult` so it sees `h` again: `confidence_head.proj.weight[:, :H]`. Both
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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specforge_dspark.config.rope import rope_parameters
from specforge_dspark.drafters.conventions import CONVENTIONS_KEY
from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft
from specforge_dspark.export import ExportError, publish
from specforge_dspark.objective.frozen_head import load_frozen_head

SPECULATORS_VOCABS = ("full", "reduced")
SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose loader this layout was checked against."""


def write_speculators(
    draft: DSparkDraft,
    out_dir: str | Path,
    record: dict[str, Any],
    target_path: str | Path | None,
    verifier_name: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    vocab: str = "full",
) -> Path:
    """Write the speculators layout of `draft` with its conventions `record` to `out_dir`
    (replaced whole, atomically); returns it. Needs the target directory."""

    def write(staging: Path) -> None:
        if target_path is None:
            raise ExportError(
                "the speculators format needs the target directory (target_path / --target)"
            )
        tensors, config = speculators_layout(draft, target_path, verifier_name, dtype, vocab)
        config[CONVENTIONS_KEY] = {**record, **config[CONVENTIONS_KEY]}
        staging.mkdir(parents=True)
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return publish(out_dir, write)


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
    if cfg.markov_head_type != "vanilla":
        problems.append(
            f"draft.markov_head_type is {cfg.markov_head_type!r}: vLLM's DSpark "
            "(model_executor/models/qwen3_dspark.py, DSparkMarkovHead) builds only the vanilla "
            "Markov head and ignores the config's markov_head_type, so it would serve this "
            "drafter without its gate/recurrence; export it in the sglang format"
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
    """`h' = h / mult` out of the final norm; the confidence head, which reads `h`
    ([h ; W1[prev]] or h), gets its `h` columns x mult (the vanilla Markov head reads no
    `h`; gated and rnn heads are refused for this format)."""
    state["norm.weight"] = state["norm.weight"] / mult
    name = "confidence_head.proj.weight"
    if name in state:
        w = state[name].clone()
        w[:, : cfg.hidden_size] *= mult
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
        "rope_parameters": rope_parameters(cfg.rope_theta, cfg.rope_scaling),
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
