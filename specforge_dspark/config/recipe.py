"""Typed training recipes: one dataclass per YAML section, loaded strictly.

A recipe is a YAML file whose top-level keys are the sections below. Every key is
checked: an unknown key fails with its dotted path and the closest valid key, wrong
types and cross-field problems are collected and reported together in one
`RecipeError`. Defaults live here and nowhere else. Command-line overrides
(`objective.num_anchors=256`) go through the same checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from specforge_dspark.config.servers import RegenerateRecipe, SGLangServer, VLLMServer
from specforge_dspark.config.strict_load import apply_override, build_dataclass


class RecipeError(ValueError):
    """A recipe problem a user can fix; the message lists every problem found."""


# --------------------------------------------------------------------------- sections


@dataclass
class TargetRecipe:
    """The frozen target model that produces the features."""

    path: str = ""
    """Local directory of the target checkpoint (config.json, safetensors, tokenizer)."""
    backend: Literal["hf", "sglang", "vllm", "offline"] = "hf"
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    """Device of the hf worker: "cpu", "cuda" (the rank's local GPU) or "cuda:N"."""
    prefetch: int = 2
    """Requests kept in flight per trainer rank."""
    batch_size: int = 1
    """Sequences per target request."""
    timeout_s: float = 300.0
    """A request not answered within this time counts as a hung worker or server."""
    max_restarts: int = 3
    """A dead or hung hf worker or SGLang server (started by the run) is restarted and
    its in-flight requests re-sent, at most this many times in a row (a request answered
    in between resets the count); past that the run fails naming it. 0 = fail at once."""
    restart_backoff_s: float = 1.0
    """Wait before the k-th restart in a row: restart_backoff_s * 2**(k-1) seconds."""
    offline_dir: str = ""
    """Feature shards written by `python -m specforge_dspark.cli.capture` (backend offline)."""
    tiny_arch: Literal["", "inkling", "qwen3"] = ""
    """Embedded CPU recipes: build (or reuse, by build key) the tiny target of this
    architecture at target.path before training (specforge_dspark.tiny.target)."""
    sglang: SGLangServer = field(default_factory=SGLangServer)
    vllm: VLLMServer = field(default_factory=VLLMServer)


@dataclass
class DraftRecipe:
    """The draft network; names follow the SGLang DSpark / DFlash config.json."""

    kind: Literal["dspark", "dflash"] = "dspark"
    """dspark: SGLang DSPARK / vLLM speculators (G drafts per block, Markov + confidence
    heads); dflash: SGLang DFLASH (G-1 drafts from rows 1..G-1, no heads; the markov_* and
    confidence fields are not used)."""
    hidden_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    hidden_act: Literal["silu"] = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    vocab_size: int = 1024
    """Rows of the target LM head (padded vocabulary)."""
    block_size: int = 7
    target_layer_ids: list[int] = field(default_factory=lambda: [0, 2])
    num_target_layers: int = 4
    mask_token_id: int = 0
    markov_rank: int = 64
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    layer_types: list[Literal["full_attention", "sliding_attention"]] = field(default_factory=list)
    """One attention type per draft layer; empty = all full_attention (DSpark: only that)."""
    sliding_window: int = 0
    """Keys a sliding_attention query sees, itself included (HF `sliding_window`)."""
    init_from: str = ""
    """Optional exported drafter directory to start from."""


@dataclass
class DataRecipe:
    """Training conversations and how they become token ids and loss masks."""

    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    format: Literal["auto", "sharegpt", "messages", "pairs"] = "auto"
    prompt_field: str = "question"
    response_field: str = "answer"
    system_prompt: str = ""
    max_length: int = 4096
    pack: bool = False
    """Train several conversations per sequence of at most max_length tokens (each its own
    target request; attention never crosses a conversation: training/packing.py)."""
    max_rows: int = 0
    """Use at most this many rows per file (0 = all)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    cache_dir: str = ".cache/prepared"
    num_proc: int = 1
    regenerate: RegenerateRecipe = field(default_factory=RegenerateRecipe)


@dataclass
class ObjectiveRecipe:
    """0.1 CE + 0.9 L1 + 1.0 BCE over sampled anchor blocks (DSPARK_SPEC.md section 3)."""

    num_anchors: int = 512
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    bce_weight: float = 1.0
    gamma: float = 4.0
    """Position weight exp(-k / gamma) (loss_decay_gamma)."""
    chunk_size: int = 128
    """Blocks per chunk of vocab-sized work; 0 = all blocks at once."""
    decode_chunk_size: int = 128
    """Blocks per decoder chunk (over context K/V computed once); 0 = all blocks at once."""
    recompute: Literal["auto", "on", "off"] = "auto"
    """on: checkpoint each decoder chunk; off: keep them all; auto: by training/memory.py."""


@dataclass
class OptimRecipe:
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    scheduler: Literal["cosine", "constant"] = "cosine"
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0


@dataclass
class ServedEvalRecipe:
    """Served accept length during training (train.served_eval)."""

    num_prompts: int = 0
    """Held-out prompts decoded in all, split over the ranks (0 = off)."""
    workloads: list[str] = field(default_factory=lambda: ["gsm8k"])
    """Built-in evaluation workloads or name=path:field (decoding/prompts.py); first turns."""
    max_new_tokens: int = 64
    max_seconds: float = 300.0
    """Per rank and evaluation: prompts not started by then are skipped (and counted)."""


@dataclass
class TrainRecipe:
    seed: int = 0
    epochs: int = 10
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = run all epochs)."""
    micro_batch_size: int = 1
    grad_accum: int = 1
    log_interval: int = 10
    eval_interval: int = 0
    """Run the teacher-forced metrics on data.eval_files every N steps (0 = never)."""
    output_dir: str = "runs/default"
    max_nonfinite_steps: int = 10
    """An optimizer step whose loss or gradient is non-finite (on any rank) is skipped: no
    weight, optimizer or LR-scheduler change. This many skipped steps in a row stop the
    run, saving the last good state."""
    preflight_samples: int = 4
    """Before its first step every rank checks its engine's features on this many data
    rows (greedy argmax and log-prob, batch and split invariance, width, dtype, tap, and
    per-layer difference to an in-process hf reference: specforge_dspark/cli/preflight.py,
    also `python -m specforge_dspark.cli.preflight`); a failed check stops the run naming
    it. 0 = off."""
    served_eval: ServedEvalRecipe = field(default_factory=lambda: ServedEvalRecipe())
    """Real speculative decoding with the hf target every eval_interval steps and at the
    end (eval/accept_length); see specforge_dspark/training/served_eval.py."""


@dataclass
class DistRecipe:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    zero_stage: int = 2
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 on GPU, fp32 on CPU."""
    deterministic: bool = False
    """torch's deterministic kernels (warn where none exists): bitwise-repeatable CUDA runs
    and resumes at some speed cost. CPU runs are bitwise repeatable without it."""
    timeout_s: float = 1800.0
    """Process-group timeout: a collective waiting longer fails the run. Start-up waits
    on the target servers separately (their startup_timeout_s; distributed.py)."""


@dataclass
class CheckpointRecipe:
    dir: str = ""
    """Defaults to <train.output_dir>/ckpt."""
    save_interval: int = 1000
    keep_last: int = 3


@dataclass
class TrackingRecipe:
    enabled: bool = True
    project: str = "specforge_dspark"
    run_name: str = ""
    """Defaults to the recipe file's stem."""
    dir: str = ""
    """trackio database folder; defaults to $TRACKIO_DIR or <train.output_dir>/trackio."""


@dataclass
class ExportRecipe:
    formats: list[Literal["sglang", "speculators"]] = field(
        default_factory=lambda: ["sglang", "speculators"]
    )
    dir: str = ""
    """Defaults to <train.output_dir>/export."""
    verifier_name: str = ""
    """Name of the target recorded in the speculators config (defaults to target.path)."""
    speculators_vocab: Literal["full", "reduced"] = "full"
    """speculators (vLLM) draft vocabulary: "full" = every LM-head row, no t2d/d2t (what
    training covers); "reduced" = the logical vocabulary with t2d/d2t and a stored LM
    head, for vLLM builds that cannot serve a full padded-vocab draft as the identity."""
    calibrate_prompts: int = 0
    """> 0: after the final export, fit per-position confidence temperatures (sequential
    temperature scaling, decoding/calibration.py) by speculative decoding on this many
    held-out prompts per workload and write EXPORT/sglang/sts_calibration.json, which
    SGLang loads with --speculative-dspark-confidence-sts-path (draft.kind dspark)."""
    calibrate_workloads: list[str] = field(default_factory=lambda: ["gsm8k", "mt_bench"])


@dataclass
class Recipe:
    target: TargetRecipe = field(default_factory=TargetRecipe)
    draft: DraftRecipe = field(default_factory=DraftRecipe)
    data: DataRecipe = field(default_factory=DataRecipe)
    objective: ObjectiveRecipe = field(default_factory=ObjectiveRecipe)
    optim: OptimRecipe = field(default_factory=OptimRecipe)
    train: TrainRecipe = field(default_factory=TrainRecipe)
    dist: DistRecipe = field(default_factory=DistRecipe)
    checkpoint: CheckpointRecipe = field(default_factory=CheckpointRecipe)
    tracking: TrackingRecipe = field(default_factory=TrackingRecipe)
    export: ExportRecipe = field(default_factory=ExportRecipe)
    source: str = field(default="", compare=False, metadata={"key": False})
    """The file this recipe was loaded from (not a YAML key)."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source")
        return out

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections (all when none given)."""
        d = self.to_dict()
        keep = {k: d[k] for k in (sections or d.keys())}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- loading


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load `path`, apply `key.sub=value` overrides, validate; raise RecipeError."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: top level must be a mapping of sections")
    errors: list[str] = []
    for item in overrides or []:
        apply_override(raw, item, errors)
    recipe = build_dataclass(Recipe, raw, "", errors)
    errors += _cross_checks(recipe, errors)
    if errors:
        raise RecipeError(_format(path, errors))
    recipe.source = str(path)
    return recipe


def recipe_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Recipe:
    """Build and validate a recipe from a plain dict (tests, tools)."""
    errors: list[str] = []
    recipe = build_dataclass(Recipe, raw, "", errors)
    errors += _cross_checks(recipe, errors)
    if errors:
        raise RecipeError(_format(Path(source), errors))
    recipe.source = source
    return recipe


def _cross_checks(recipe: Recipe, errors: list[str]) -> list[str]:
    """Cross-field problems, leaving out keys that already failed their type check."""
    bad = {m.split(":")[0].split()[-1].split("[")[0] for m in errors}
    return [m for m in validate(recipe) if not any(b and b in m for b in bad)]


def _format(path: Path, errors: list[str]) -> str:
    lines = [f"recipe {path} has {len(errors)} problem(s):"]
    lines += [f"  - {e}" for e in errors]
    return "\n".join(lines)


# --------------------------------------------------------------------------- checks


def validate(r: Recipe) -> list[str]:
    """Cross-field checks; returns a list of problems naming the recipe keys."""
    e: list[str] = []
    d, o = r.draft, r.objective

    def need(cond: bool, msg: str) -> None:
        if not cond:
            e.append(msg)

    need(d.hidden_size > 0, f"draft.hidden_size must be > 0, got {d.hidden_size}")
    need(d.num_hidden_layers >= 1, "draft.num_hidden_layers must be >= 1")
    need(d.num_attention_heads >= 1, "draft.num_attention_heads must be >= 1")
    need(
        d.num_key_value_heads >= 1 and d.num_attention_heads % max(d.num_key_value_heads, 1) == 0,
        f"draft.num_attention_heads ({d.num_attention_heads}) must be a multiple of "
        f"draft.num_key_value_heads ({d.num_key_value_heads})",
    )
    need(d.head_dim > 0 and d.head_dim % 2 == 0, "draft.head_dim must be even and > 0 (RoPE)")
    need(d.intermediate_size > 0, "draft.intermediate_size must be > 0")
    need(d.block_size >= 2, f"draft.block_size must be >= 2, got {d.block_size}")
    need(d.vocab_size > 0, "draft.vocab_size must be > 0")
    need(
        0 <= d.mask_token_id < d.vocab_size,
        f"draft.mask_token_id ({d.mask_token_id}) must be in [0, draft.vocab_size={d.vocab_size})",
    )
    need(d.markov_rank > 0, f"draft.markov_rank must be > 0, got {d.markov_rank}")
    need(len(d.target_layer_ids) >= 1, "draft.target_layer_ids must name at least one layer")
    for i, k in enumerate(d.target_layer_ids):
        need(
            0 <= k <= d.num_target_layers - 2,
            f"draft.target_layer_ids[{i}]={k} is outside the target's layers: aux layers "
            f"must be in [0, draft.num_target_layers-2={d.num_target_layers - 2}] "
            "(the last layer's output cannot be captured)",
        )
    dupes = sorted({k for k in d.target_layer_ids if d.target_layer_ids.count(k) > 1})
    need(not dupes, f"draft.target_layer_ids repeats layer(s) {dupes}")
    need(
        dupes or d.target_layer_ids == sorted(d.target_layer_ids),
        f"draft.target_layer_ids must be ascending (SGLang captures them in order), got "
        f"{d.target_layer_ids}",
    )
    need(
        not d.layer_types or len(d.layer_types) == d.num_hidden_layers,
        f"draft.layer_types has {len(d.layer_types)} entries, draft.num_hidden_layers is "
        f"{d.num_hidden_layers}",
    )
    sliding = "sliding_attention" in d.layer_types
    if d.kind == "dspark":
        need(not sliding, "draft.layer_types: sliding_attention needs draft.kind: dflash")
    else:
        need(
            not sliding or d.sliding_window >= d.block_size,
            f"draft.sliding_window ({d.sliding_window}) must be >= draft.block_size "
            f"({d.block_size}) for sliding_attention layers",
        )
        need(
            o.bce_weight == 0,
            "objective.bce_weight must be 0 for draft.kind: dflash (it has no confidence head)",
        )
    need(d.sliding_window >= 0, "draft.sliding_window must be >= 0")
    need(d.rms_norm_eps > 0, "draft.rms_norm_eps must be > 0")
    need(d.rope_theta > 0, "draft.rope_theta must be > 0")

    need(o.num_anchors >= 1, f"objective.num_anchors must be >= 1, got {o.num_anchors}")
    for name in ("ce_weight", "l1_weight", "bce_weight"):
        w = getattr(o, name)
        need(w >= 0, f"objective.{name} must be >= 0, got {w}")
    need(
        o.ce_weight + o.l1_weight + o.bce_weight > 0,
        "objective: at least one of ce_weight, l1_weight, bce_weight must be > 0",
    )
    need(o.gamma > 0, f"objective.gamma must be > 0, got {o.gamma}")
    need(o.chunk_size >= 0, f"objective.chunk_size must be >= 0, got {o.chunk_size}")
    need(o.decode_chunk_size >= 0, "objective.decode_chunk_size must be >= 0")

    p = r.optim
    need(p.lr > 0, f"optim.lr must be > 0, got {p.lr}")
    need(0 <= p.warmup_ratio < 1, f"optim.warmup_ratio must be in [0, 1), got {p.warmup_ratio}")
    need(0 <= p.min_lr_ratio <= 1, "optim.min_lr_ratio must be in [0, 1]")
    need(p.grad_clip >= 0, "optim.grad_clip must be >= 0 (0 disables clipping)")
    need(len(p.betas) == 2 and all(0 <= b < 1 for b in p.betas), "optim.betas: two in [0, 1)")
    need(p.weight_decay >= 0, "optim.weight_decay must be >= 0")

    t = r.train
    need(t.epochs >= 1 or t.max_steps >= 1, "train: set train.epochs >= 1 or train.max_steps >= 1")
    need(t.max_steps >= 0, "train.max_steps must be >= 0")
    need(t.micro_batch_size >= 1, "train.micro_batch_size must be >= 1")
    need(t.grad_accum >= 1, "train.grad_accum must be >= 1")
    need(t.log_interval >= 1, "train.log_interval must be >= 1")
    need(t.eval_interval >= 0, "train.eval_interval must be >= 0")
    need(t.preflight_samples >= 0, "train.preflight_samples must be >= 0 (0 = off)")
    need(r.export.calibrate_prompts >= 0, "export.calibrate_prompts must be >= 0")
    need(
        r.export.calibrate_prompts == 0
        or (
            r.draft.kind == "dspark"
            and r.draft.enable_confidence_head
            and "sglang" in r.export.formats
        ),
        "export.calibrate_prompts > 0 needs draft.kind dspark with a confidence head and the "
        "sglang export format",
    )
    se = t.served_eval
    need(se.num_prompts >= 0, "train.served_eval.num_prompts must be >= 0")
    need(se.max_new_tokens >= 1, "train.served_eval.max_new_tokens must be >= 1")
    need(se.max_seconds > 0, "train.served_eval.max_seconds must be > 0")
    need(
        se.num_prompts == 0 or bool(se.workloads),
        "train.served_eval.workloads: give at least one workload",
    )
    need(
        t.max_nonfinite_steps >= 1,
        f"train.max_nonfinite_steps must be >= 1, got {t.max_nonfinite_steps}",
    )
    need(
        t.eval_interval == 0 or bool(r.data.eval_files),
        "train.eval_interval > 0 needs data.eval_files (set one or set the interval to 0)",
    )

    need(
        r.dist.zero_stage in (0, 1, 2),
        f"dist.zero_stage must be 0, 1 or 2, got {r.dist.zero_stage}: ZeRO-3 partitions "
        "parameters that the Markov head and the fused vocab loss read directly",
    )
    need(r.dist.timeout_s > 0, f"dist.timeout_s must be > 0, got {r.dist.timeout_s}")
    need(r.checkpoint.save_interval >= 1, "checkpoint.save_interval must be >= 1")
    need(r.checkpoint.keep_last >= 1, "checkpoint.keep_last must be >= 1")
    need(len(r.export.formats) == len(set(r.export.formats)), "export.formats has duplicates")
    need(
        d.markov_head_type == "vanilla" or "speculators" not in r.export.formats,
        f"export.formats: vLLM's DSpark (the speculators format) has only the vanilla Markov "
        f"head, draft.markov_head_type is {d.markov_head_type}: drop speculators",
    )

    g = r.target
    need(g.prefetch >= 1, f"target.prefetch must be >= 1, got {g.prefetch}")
    need(g.batch_size >= 1, "target.batch_size must be >= 1")
    need(g.timeout_s > 0, "target.timeout_s must be > 0")
    need(g.max_restarts >= 0, f"target.max_restarts must be >= 0, got {g.max_restarts}")
    need(g.restart_backoff_s >= 0, "target.restart_backoff_s must be >= 0")
    need(
        g.backend != "offline" or bool(g.offline_dir),
        "target.offline_dir must be set when target.backend is offline",
    )
    need(r.data.max_length >= d.block_size + 1, "data.max_length must exceed draft.block_size")
    need(r.data.max_rows >= 0, "data.max_rows must be >= 0")
    need(r.data.regenerate.concurrency >= 1, "data.regenerate.concurrency must be >= 1")
    return e


# --------------------------------------------------------------------------- paths


def resolved_dirs(r: Recipe) -> dict[str, Path]:
    """Output folders with their documented defaults filled in."""
    out = Path(r.train.output_dir)
    return {
        "output": out,
        "checkpoint": Path(r.checkpoint.dir) if r.checkpoint.dir else out / "ckpt",
        "export": Path(r.export.dir) if r.export.dir else out / "export",
        "trackio": Path(r.tracking.dir) if r.tracking.dir else out / "trackio",
    }
