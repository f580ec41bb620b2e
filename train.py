"""Train a DSpark drafter by online distillation from a live, frozen target.

    torchrun --nproc_per_node 8 train.py --recipe recipes/inkling_nvfp4.yaml
    torchrun --nproc_per_node 2 train.py --recipe recipes/tiny_cpu.yaml --resume auto
    python train.py --recipe R.yaml --dry-run [section.key=value ...]

main(argv) -> load_recipe -> build -> train. Each rank streams the target's aux hidden
states for its shard of the data (FeatureStream), runs the draft over sampled anchor
blocks, and DeepSpeed (ZeRO) steps the draft; the target's embedding and LM head are
frozen and replicated outside the optimizer. Importing this file does nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specforge_dspark.config.recipe import Recipe, RecipeError, load_recipe, resolved_dirs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True, help="recipe YAML (see recipes/)")
    ap.add_argument("--dry-run", action="store_true", help="validate, build on meta, summarise")
    ap.add_argument(
        "--world-size", type=int, default=1, help="--dry-run: data-parallel ranks to size for"
    )
    ap.add_argument(
        "--resume", default="auto", help="auto (latest complete checkpoint), none, or a step dir"
    )
    ap.add_argument(
        "--stop-at-step", type=int, default=0, help="save and stop at this step (preemption drill)"
    )
    ap.add_argument("overrides", nargs="*", help="recipe overrides, e.g. objective.num_anchors=256")
    return ap.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(recipe, args.world_size)
    from specforge_dspark.engines.features import TargetLost
    from specforge_dspark.training.checkpoint import CheckpointWriteError, ResumeError
    from specforge_dspark.training.lifecycle import RunLockError, write_run_status
    from specforge_dspark.training.nonfinite import NonFiniteError

    where = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    first = int(os.environ.get("RANK", 0)) == 0  # writes run_status.json (lifecycle.py)
    try:
        run = build(recipe, args.resume)
        stopped = train(run, stop_at_step=args.stop_at_step)
    except (ResumeError, RecipeError, RunLockError, ValueError, FileNotFoundError) as e:
        print(f"{where}error: {e}", file=sys.stderr)  # refused before the run started
        return 2
    except (CheckpointWriteError, NonFiniteError, TargetLost, TimeoutError) as e:
        print(f"{where}error: {e}", file=sys.stderr)  # a fault during the run, said plainly
        if first:
            write_run_status(recipe.train.output_dir, "failed", 1, f"{type(e).__name__}: {e}")
        return 1
    if stopped:  # state saved; not a finished run, so not exit status 0
        print(f"{where}stopped early ({stopped}); continue with --resume auto", file=sys.stderr)
        if first:
            write_run_status(recipe.train.output_dir, "stopped", EXIT_STOPPED, stopped)
        return EXIT_STOPPED
    if first:
        write_run_status(recipe.train.output_dir, "finished", 0, f"{run.total_steps} steps")
    return 0


EXIT_STOPPED = 143
"""Exit status of a run stopped early with its state saved (128 + SIGTERM)."""


# --------------------------------------------------------------------------- dry run


def dry_run(recipe: Recipe, world: int = 1) -> int:
    """Build the draft on the meta device and print what a real run would hold."""
    from specforge_dspark.training.memory import dry_run_summary

    print("\n".join(dry_run_summary(recipe, world)))
    return 0


# --------------------------------------------------------------------------- build


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

    @property
    def units(self) -> int:
        """What an epoch orders (data_order.py): rows, or packed sequences."""
        return len(self.dataset) if self.plan is None else len(self.plan)


def build(recipe: Recipe, resume: str | None) -> Run:
    import deepspeed

    from data_pipelines.prepare import prepare_dataset
    from specforge_dspark.drafters.dspark import DSparkDraft
    from specforge_dspark.drafters.registry import new_draft
    from specforge_dspark.objective.frozen_head import load_frozen_head
    from specforge_dspark.training import checkpoint
    from specforge_dspark.training.data_order import restore_cursor, samples_left
    from specforge_dspark.training.distributed import deepspeed_config, init_distributed, lr_lambda
    from specforge_dspark.training.fingerprint import data_fingerprint, features_fingerprint
    from specforge_dspark.training.lifecycle import acquire_run_lock
    from specforge_dspark.training.memory import resolve_recompute
    from specforge_dspark.training.packing import describe_plan, pack_index, pack_plan, row_lengths

    rank, world, device = init_distributed(recipe)
    dirs = resolved_dirs(recipe)
    lock = acquire_run_lock(dirs["output"], rank)  # one job per output_dir
    resume_path = checkpoint.resolve_resume(resume, dirs["checkpoint"])
    layout = None  # how the saved global batch is laid out on this world size
    if resume_path is not None:  # fail fast, before data and engines are built
        layout = checkpoint.check_saved(resume_path, recipe, world)
    if recipe.target.tiny_arch:  # embedded recipes: every rank waits on the build lock
        from specforge_dspark.tiny.target import build as build_tiny_target

        quiet = (lambda *a: None) if rank else print
        build_tiny_target(Path(recipe.target.path), arch=recipe.target.tiny_arch, log=quiet)
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
        if len(eval_set) < world:
            raise ValueError(
                f"data.eval_files: {len(eval_set)} prepared rows, fewer than the {world} ranks"
            )
    t = recipe.train
    grad_accum = layout.grad_accum if layout else t.grad_accum
    micro_per_epoch = units // (world * t.micro_batch_size)
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
    if recipe.draft.init_from and recipe.draft.kind == "dflash":
        from specforge_dspark.drafters.dflash import DFlashConfig, DFlashDraft

        draft = DFlashDraft.from_pretrained(recipe.draft.init_from)
        if draft.config != DFlashConfig.from_recipe(recipe.draft):
            raise ValueError(f"draft.init_from {recipe.draft.init_from}: config differs")
    elif recipe.draft.init_from:  # same slot, tap, layer ids, mask and vocab as this run
        from specforge_dspark.export.conventions import check_conventions

        check_conventions(recipe.draft.init_from, recipe)
        draft = DSparkDraft.from_pretrained(recipe.draft.init_from)
    else:
        draft = new_draft(recipe.draft)
    _check_head_matches(recipe, head)
    say = (lambda *a: None) if rank else print
    recipe = resolve_recompute(recipe, draft, world, device, say=say)  # auto -> on / off
    o = recipe.optim
    opt = torch.optim.AdamW(
        draft.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(recipe, total))
    engine, _, _, _ = deepspeed.initialize(
        model=draft.to(device),
        optimizer=opt,
        lr_scheduler=sched,
        config=deepspeed_config(recipe, device, grad_accum),
    )
    _warn_if_no_skip(engine, recipe, rank)
    state = checkpoint.TrainState(epoch_samples=0, grad_accum=grad_accum)
    if resume_path is not None:
        state = checkpoint.load(engine, resume_path, recipe, fingerprint)
        state.grad_accum = grad_accum
        restore_cursor(state, units, layout.saved_world, world, t.micro_batch_size)
        left = samples_left(state, units, world, t.micro_batch_size)
        said = layout.describe(state.epoch, left, units, t.grad_accum)
        if rank == 0:
            print(f"resumed from {resume_path} at step {state.step}", flush=True)
        if rank == 0 and said:  # what was re-partitioned, or why grad_accum differs
            print(said, flush=True)
    return Run(
        recipe,
        rank,
        world,
        device,
        engine,
        head,
        dataset,
        eval_set,
        state,
        micro_per_epoch,
        total,
        dirs,
        fingerprint,
        lock,
        plan,
        pack_of,
    )


def _warn_if_no_skip(engine, recipe: Recipe, rank: int) -> None:
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


def _check_head_matches(recipe: Recipe, head) -> None:
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


# --------------------------------------------------------------------------- train


def anchor_generator(run: Run, micro_step: int) -> torch.Generator:
    """Anchor sampling RNG of one micro step: a function of (seed, rank, step) alone."""
    seed = (run.recipe.train.seed * 1_000_003 + run.rank) * 1_000_003 + micro_step
    return torch.Generator().manual_seed(seed % (2**63))


def objective(run: Run, feats, generator: torch.Generator):
    """The loss and metrics of one batch of features (objective.py; dflash_objective.py
    for draft.kind dflash)."""
    from specforge_dspark.drafters.registry import loss_fn

    f = feats.to(run.device)
    return loss_fn(run.recipe.draft.kind)(
        run.engine.module,
        run.head,
        f.input_ids,
        f.loss_mask,
        f.aux_hidden,
        f.last_hidden,
        run.recipe.objective,
        generator,
        position_ids_BS=f.position_ids,
    )


def train_step(run: Run, feats, micro_step: int, guard):
    """Forward + backward of one micro-batch; returns the objective's output, or None
    when this step's update is skipped (nonfinite.py: samples with non-finite features
    are masked out first; a non-finite loss on any rank makes every rank backpropagate a
    NaN surrogate instead, which DeepSpeed's overflow check turns into a skipped update)."""
    from specforge_dspark.training.nonfinite import nan_loss
    from specforge_dspark.training.packing import pack_features

    feats = guard.screen(feats.to(run.device), micro_step)  # per conversation
    if run.pack_of is not None:  # data.pack: the conversations as their packed sequences
        feats = pack_features(feats, run.pack_of)
    out = objective(run, feats, anchor_generator(run, micro_step))
    boundary = run.engine.is_gradient_accumulation_boundary()
    loss = guard.check(out.loss, feats.sample_ids, micro_step, boundary)  # collective
    run.engine.backward(nan_loss(run.engine.module) if loss is None else loss)
    return None if loss is None else out


@torch.no_grad()
def eval_step(run: Run, feats, index: int) -> dict:
    """Teacher-forced metrics of one eval batch (fixed anchors: seeded by its index)."""
    return objective(run, feats, torch.Generator().manual_seed(index)).log_dict()


def train(run: Run, stop_at_step: int = 0) -> str | None:
    """The loop; returns why it stopped early (a signal, the launcher's death) or None."""
    from specforge_dspark.export.dispatch import export_checkpoint
    from specforge_dspark.cli.preflight import preflight_run
    from specforge_dspark.training import checkpoint
    from specforge_dspark.training.data_order import EVAL_ID, advance, batches, eval_rows
    from specforge_dspark.training.distributed import wait_for_every_rank
    from specforge_dspark.training.lifecycle import StopRequest, watch_launcher
    from specforge_dspark.training.nonfinite import NonFiniteError, NonFiniteGuard
    from specforge_dspark.training.served_eval import build_served_eval, served_accept_length
    from specforge_dspark.training.stream import FeatureStream
    from specforge_dspark.training.tracking import Tracker

    r, state, eng = run.recipe, run.state, run.engine
    n, mb, n_evals = run.units, r.train.micro_batch_size, 0
    if r.train.eval_interval:
        n_evals = len(eval_rows(run.eval_set, run.rank, run.world))
    tracker = Tracker(r, run.rank, run.total_steps, state.step, run.dirs["trackio"])
    tracker.write(
        f"training {run.total_steps} steps on {run.world} rank(s), {len(run.dataset)} rows"
        f"{'' if run.plan is None else f' in {len(run.plan)} packed sequences'}, "
        f"{run.micro_per_epoch} micro-batches per rank per epoch"
    )
    window: list = state.log_window  # carried across a stop (checkpoint.TrainState)
    evals: list = []
    t_start, start_step = time.time(), state.step
    t_last, wait_last, tokens_last = time.time(), 0.0, state.log_tokens
    stop = StopRequest()  # SIGTERM / SIGINT / launcher death: save at the next step, exit
    watch_launcher(stop)
    stopped: str | None = None
    stream = FeatureStream(r, rank=run.rank, world_size=run.world)
    guard = NonFiniteGuard(r, run.rank, run.device, state.step)
    served = build_served_eval(r, run.rank, run.world, run.device)  # None unless asked
    served_al: dict[int, float] = {}  # step -> served accept length, for the gap
    with stream:
        wait_for_every_rank()  # every node's server answered (its startup_timeout_s)
        preflight_run(run, stream)  # train.preflight_samples > 0: the engine's features checked
        data = batches(r, run.dataset, run.eval_set, run.rank, run.world, state, run.plan)
        for feats in stream.iterate(data):
            if state.step >= run.total_steps:
                break
            if feats.sample_ids[0] >= EVAL_ID:
                evals.append(eval_step(run, feats, len(evals)))
                if len(evals) == n_evals:
                    tf = _reduce_metrics(evals)
                    logged = {f"eval/{k}": v for k, v in tf.items()}
                    if state.step in served_al and "tau" in tf:  # teacher-forced minus served
                        logged["eval/tau_minus_accept_length"] = tf["tau"] - served_al[state.step]
                    tracker.log(state.step, logged)
                    evals = []
                continue
            out = train_step(run, feats, state.micro_step, guard)
            boundary = eng.is_gradient_accumulation_boundary()
            eng.step()  # at a boundary: the update, or DeepSpeed's skip of a non-finite one
            state.micro_step += 1
            advance(state, n, run.world, mb)  # the data cursor: epoch, epoch_samples
            state.tokens += int(feats.loss_mask.sum())
            if out is not None:
                window.append(out.log_dict())
            if not boundary:
                continue
            state.step += 1
            tracker.advance()
            report = guard.after_step(eng, state)  # collective when some rank saw a problem
            for line in report.lines:
                tracker.write(line)
            if (
                state.step % r.train.log_interval == 0
                or state.step == run.total_steps
                or report.skipped
            ):
                now = time.time()
                metrics = _reduce_metrics(window) if window else {}
                metrics.update(report.metrics)
                metrics.update(
                    lr=eng.get_lr()[0],
                    grad_norm=float(eng.get_global_grad_norm() or 0.0),
                    tokens_per_s=(state.tokens - tokens_last) / max(now - t_last, 1e-9),
                    wait_fraction=(stream.wait_seconds - wait_last) / max(now - t_last, 1e-9),
                    epoch=state.epoch,
                )
                if report.skipped:
                    metrics.pop("grad_norm")  # inf: DeepSpeed's mark of a skipped step
                tracker.log(state.step, metrics)
                t_last, wait_last, tokens_last = now, stream.wait_seconds, state.tokens
                window = []
            last = state.step == run.total_steps or state.step == stop_at_step
            interval = r.train.eval_interval
            if served is not None and (last or interval and state.step % interval == 0):
                res = served_accept_length(served, eng.module, run.head, run.device)
                served_al[state.step] = res["accept_length"]
                tracker.log(state.step, {f"eval/{k}": v for k, v in res.items()})
                tracker.write(
                    f"step {state.step}: served accept length {res['accept_length']:.3f} "
                    f"({res['served_prompts']} prompts, {res['served_seconds']:.1f} s)"
                )
            stopping = not last and stop.agreed(run.device)  # collective, every step
            halt = report.stop  # too many non-finite steps in a row: save, then fail
            if state.step % r.checkpoint.save_interval == 0 or last or stopping or halt:
                state.log_window, state.log_tokens = list(window), tokens_last
                keep = r.checkpoint.keep_last
                path = checkpoint.save(eng, run.dirs["checkpoint"], state, r, keep, run.fingerprint)
                tracker.write(f"step {state.step}: saved {path}")
            if halt:
                raise NonFiniteError(f"{halt}; saved them in {path}")
            if stopping:
                stopped = stop.reason or "another rank was asked to stop"
                tracker.write(f"step {state.step}: stopped ({stopped}); resume with --resume auto")
                break
            if last:
                break
    stop.restore()
    tracker.close()
    if run.rank == 0:
        took = time.time() - t_start
        done = state.step - start_step
        line = f"done: {done} steps in {took:.1f} s ({took / max(done, 1):.3f} s/step)"
        if run.device.type == "cuda":
            line += (
                f", peak GPU memory {torch.cuda.max_memory_allocated(run.device) / 2**30:.2f} GiB"
            )
        print(line, flush=True)
    if state.step >= run.total_steps and run.rank == 0:
        # from the final checkpoint's fp32 master weights: one path for every ZeRO stage
        final = checkpoint.step_dir(run.dirs["checkpoint"], state.step)
        for fmt in r.export.formats:
            out_dir = export_checkpoint(
                final,
                fmt,
                run.dirs["export"] / fmt,
                target_path=r.target.path or None,
                verifier_name=r.export.verifier_name or None,
            )
            print(f"exported {fmt} drafter to {out_dir}", flush=True)
        if r.export.calibrate_prompts:
            from specforge_dspark.decoding.calibration import calibrate_export

            calibrate_export(
                r.target.path,
                run.dirs["export"] / "sglang",
                workloads=r.export.calibrate_workloads,
                num_prompts=r.export.calibrate_prompts,
                out_dir=run.dirs["export"].parent / "calibration",
                device=str(run.device),
            )
    return stopped


def _reduce_metrics(window: list[dict]) -> dict:
    """Mean over the micro-steps of the logging window (the objective already pooled ranks).

    Per-position entries are NaN in a micro-step with no supervised slot there: ignored."""
    keys = sorted(window[0])
    vals = torch.tensor([[m.get(k, float("nan")) for k in keys] for m in window])
    mean = vals.to(torch.float64).nanmean(0)
    return {k: v for k, v in zip(keys, mean.tolist(), strict=True) if v == v}


if __name__ == "__main__":
    raise SystemExit(main())
