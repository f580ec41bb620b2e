"""Train a DSpark drafter by online distillation from a live, frozen target.

    torchrun --nproc_per_node 8 train.py --recipe recipes/inkling_nvfp4.yaml
    torchrun --nproc_per_node 2 train.py --recipe recipes/tiny_cpu.yaml --resume auto
    python train.py --recipe R.yaml --dry-run [section.key=value ...]

main(argv) -> load_recipe -> build -> train. Each rank streams the target's aux hidden
states for its shard of the data (FeatureStream), runs the draft over sampled anchor
blocks, and DeepSpeed (ZeRO) steps the draft; the target's embedding and LM head are
frozen and replicated outside the optimizer. A recipe's `companions` are more drafters fed
by the same features, each its own engine (training/drafters.py). Importing this file
does nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from specforge_dspark.config.command_line import command_parser
from specforge_dspark.config.recipe import Recipe, RecipeError, load_recipe
from specforge_dspark.training.build import Run, build
from specforge_dspark.training.drafters import Drafter


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = command_parser(
        "torchrun --nproc_per_node N train.py",
        __doc__.split("\n\n")[0],
        "torchrun --nproc_per_node 2 train.py --recipe recipes/tiny_cpu.yaml",
        "python train.py --recipe recipes/inkling_nvfp4.yaml --dry-run",
    )
    ap.add_argument("--recipe", required=True, help="recipe YAML (see recipes/)")
    ap.add_argument("--dry-run", action="store_true", help="validate, build on meta, summarise")
    ap.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="--dry-run: data-parallel ranks to size for (default: torchrun's WORLD_SIZE, else "
        "the torchrun line in the recipe's header, else 1)",
    )
    ap.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="--dry-run: GPUs of a node, for the servers it starts (default: 8)",
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
        if not args.dry_run:  # the last run's status must not stand for this one
            from specforge_dspark.training.run_status import refuse_unloaded

            refuse_unloaded(args.recipe, args.overrides, f"RecipeError: {e}")
        return 2
    if args.dry_run:
        return dry_run(recipe, args.world_size, args.gpus_per_node)
    from specforge_dspark.training.checkpoint import CheckpointWriteError, ResumeError
    from specforge_dspark.training.lifecycle import RunLockError
    from specforge_dspark.training.nonfinite import NonFiniteError
    from specforge_dspark.training.run_status import RunStatus
    from specforge_dspark.transport.features import TargetLost, TargetRefused

    where = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    status = RunStatus(recipe.train.output_dir, int(os.environ.get("RANK", 0)))
    run = None
    try:
        run = build(recipe, args.resume, status)
        stopped = train(run, stop_at_step=args.stop_at_step)
    except RunLockError as e:  # another job's run: its status file is left alone
        print(f"{where}error: {e}", file=sys.stderr)
        return 2
    except TargetRefused as e:  # the server never served once: a retry fails the same way
        print(f"{where}error: {e}", file=sys.stderr)
        status.end("refused", f"{type(e).__name__}: {e}")
        return 2
    except (ResumeError, RecipeError, ValueError, FileNotFoundError) as e:
        if run is not None:  # raised by the loop: a failure, not a refusal
            return _failed(status, where, e, resumable=False)
        print(f"{where}error: {e}", file=sys.stderr)  # refused before the run started
        status.refuse(f"{type(e).__name__}: {e}")
        return 2
    except (CheckpointWriteError, NonFiniteError, TargetLost, TimeoutError) as e:
        return _failed(status, where, e)  # a fault during the run, said plainly
    except KeyboardInterrupt as e:  # a second signal: out now, from the last checkpoint
        status.end("stopped", _aborted(recipe, run, e))
        raise
    except BaseException as e:  # anything else: recorded, never called resumable
        status.end("failed", f"{type(e).__name__}: {e}", error=type(e).__name__)
        raise
    finally:  # the target (started by build) stops on every path
        if run is not None:
            run.stream.close()
    if stopped:  # state saved; not a finished run, so not exit status 0
        print(f"{where}stopped early ({stopped}); continue with --resume auto", file=sys.stderr)
        status.end("stopped", stopped)
        return EXIT_STOPPED
    status.end("finished", f"{run.total_steps} steps")
    return 0


def _aborted(recipe: Recipe, run: Run | None, e: KeyboardInterrupt) -> str:
    """What a second signal (or Ctrl-C before the run's handlers) cut short, for the status."""
    from specforge_dspark.training.drafters import checkpoint_roots, resolve_resume

    what = str(e) or "interrupted"
    where = f"at step {run.state.step}" if run is not None else "while starting"
    try:
        last = resolve_resume("auto", checkpoint_roots(recipe))
    except Exception as err:  # the status must be written whatever the checkpoints hold
        last = f"unknown ({type(err).__name__})"
    return (
        f"{what}: aborted {where} without a save; --resume auto resumes from "
        f"{last or 'the start (no complete checkpoint)'}"
    )


def _failed(status, where: str, e: BaseException, resumable: bool = True) -> int:
    print(f"{where}error: {e}", file=sys.stderr)
    status.end("failed", f"{type(e).__name__}: {e}", error=type(e).__name__ if resumable else "")
    return 1


EXIT_STOPPED = 143
"""Exit status of a run stopped early with its state saved (128 + SIGTERM)."""


# --------------------------------------------------------------------------- dry run


def dry_run(recipe: Recipe, world: int | None = None, gpus_per_node: int = 8) -> int:
    """Build the draft on the meta device and print what a real run would hold; a served
    target's launch arguments are checked by the engine itself (launch_check.py). Data
    files that do not exist yet are refused after the summary (exit 2): the sizes print
    for a recipe whose data is still to be made."""
    from specforge_dspark.config.validate import check_data_files
    from specforge_dspark.engines.pool import check_node_fits
    from specforge_dspark.training.launch_check import check_launch_args
    from specforge_dspark.training.memory import dry_run_summary, implied_world_size

    try:
        check_node_fits(recipe, gpus_per_node)
        checked = check_launch_args(recipe)
        world, source = implied_world_size(recipe, world)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"sizing for {world} rank(s) ({source})")
    print("\n".join([*dry_run_summary(recipe, world), *checked]))
    try:
        check_data_files(recipe)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


# --------------------------------------------------------------------------- train


def anchor_generator(run: Run, micro_step: int) -> torch.Generator:
    """Anchor sampling RNG of one micro step: a function of (seed, data rank, step) alone."""
    seed = (run.recipe.train.seed * 1_000_003 + run.data_rank) * 1_000_003 + micro_step
    return torch.Generator().manual_seed(seed % (2**63))


def objective(run: Run, d: Drafter, feats, generator: torch.Generator):
    """Drafter d's loss and metrics of one batch (its kind's loss, registry.py), over this
    rank's slice of the positions with dist.sequence_parallel."""
    from specforge_dspark.drafters.registry import loss_fn
    from specforge_dspark.objective.sequence_parallel import shard_features

    f, shard, halo = feats.to(run.device), run.shard, d.recipe.draft.block_size - 1
    aux, last = (f.aux_hidden, f.last_hidden) if shard is None else shard_features(f, shard, halo)
    return loss_fn(d.recipe.draft.kind)(
        d.engine.module,
        run.head,
        f.input_ids,
        f.loss_mask,
        aux,
        last,
        d.recipe.objective,
        generator,
        position_ids_BS=f.position_ids,
        shard=shard,
    )


def screen(run: Run, feats, micro_step: int):
    """The micro-batch on the device, once for every drafter: samples with non-finite
    features masked out (each drafter's guard counts them), then packed (data.pack)."""
    from specforge_dspark.training.packing import pack_features

    feats = feats.to(run.device)
    for d in run.drafters:  # per conversation; the same rows cleared for every drafter
        screened = d.guard.screen(feats, micro_step, run.sequence_group)
    if run.pack_of is not None:  # data.pack: the conversations as their packed sequences
        screened = pack_features(screened, run.pack_of)
    return screened


def train_step(run: Run, d: Drafter, feats, micro_step: int):
    """Forward + backward of drafter d on one micro-batch; returns the objective's output,
    or None when this step's update is skipped (nonfinite.py: a non-finite loss on any
    rank makes every rank backpropagate a NaN surrogate instead, which DeepSpeed's
    overflow check turns into a skipped update)."""
    from specforge_dspark.training.nonfinite import nan_loss

    out = objective(run, d, feats, anchor_generator(run, micro_step))  # the same anchors
    boundary = d.engine.is_gradient_accumulation_boundary()
    loss = d.guard.check(out.loss, feats.sample_ids, micro_step, boundary)  # collective
    d.engine.backward(nan_loss(d.engine.module) if loss is None else loss)
    return None if loss is None else out


@torch.no_grad()
def eval_step(run: Run, d: Drafter, feats, index: int) -> dict:
    """Teacher-forced metrics of one eval batch (fixed anchors: seeded by its index)."""
    return objective(run, d, feats, torch.Generator().manual_seed(index)).log_dict()


def train(run: Run, stop_at_step: int = 0) -> str | None:
    """The loop; returns why it stopped early (a signal, the launcher's death) or None."""
    from specforge_dspark.training.data_order import EVAL_ID, advance, batches
    from specforge_dspark.training.distributed import wait_for_every_rank
    from specforge_dspark.training.drafters import follow, save_all
    from specforge_dspark.training.lifecycle import StopRequest, watch_launcher
    from specforge_dspark.training.nonfinite import NonFiniteError, NonFiniteGuard
    from specforge_dspark.training.preflight import preflight_run
    from specforge_dspark.training.served_eval import EvalPool, build_served_eval
    from specforge_dspark.training.tracking import StepWindow

    r, state, eng = run.recipe, run.state, run.engine
    tracker = start_tracker(run)
    t_start, start_step = time.time(), state.step
    for d in run.drafters:  # each its own guard, metric window (carried across a stop), log
        d.guard = NonFiniteGuard(d.recipe, run.rank, run.device, state.step)
        d.window = StepWindow(d.state, t_start)
        d.tracker = tracker if not d.name else companion_tracker(run, d, tracker)
        d.evals = EvalPool(run, d)
    stop = StopRequest()  # SIGTERM / SIGINT / launcher death: save at the next step, exit
    watch_launcher(stop)
    stopped: str | None = None
    stream = run.stream  # started by build (training/build.py)
    served = build_served_eval(r, run.rank, run.world, run.device)  # None unless asked
    with stream:
        wait_for_every_rank()  # every node's server answered (its startup_timeout_s)
        preflight_run(run, stream)  # train.preflight_samples > 0: the engine's features checked
        data = batches(r, run.dataset, run.eval_set, run.data_rank, run.data_world, state, run.plan)
        for feats in stream.iterate(data):
            if state.step >= run.total_steps:
                break
            if feats.sample_ids[0] >= EVAL_ID:
                for d in run.drafters:
                    d.evals.add(eval_step(run, d, feats, len(d.evals.batches)), state.step)
                continue
            screened = screen(run, feats, state.micro_step)  # moved to the device once
            boundary = eng.is_gradient_accumulation_boundary()
            for d in run.drafters:  # the same features and anchors for each drafter
                d.window.add(train_step(run, d, screened, state.micro_step))
                d.engine.step()  # at a boundary: the update, or DeepSpeed's skip of it
            state.micro_step += 1
            advance(state, run.units, run.data_world, r.train.micro_batch_size)  # data cursor
            state.tokens += int(feats.loss_mask.sum())
            if not boundary:
                continue
            state.step += 1
            tracker.advance()
            reports = []
            for d in run.drafters:
                follow(d.state, state)  # a companion's cursor is the run's
                reports.append(d.guard.after_step(d.engine, d.state))  # collective if needed
                for line in reports[-1].lines:
                    tracker.write(f"[{d.name}] {line}" if d.name else line)
            if (
                state.step % r.train.log_interval == 0
                or state.step == run.total_steps
                or any(report.skipped for report in reports)
            ):
                now = time.time()
                beat = now - run.drafters[0].window.t_last
                for d, report in zip(run.drafters, reports, strict=True):
                    d.window.log(d.tracker, d.state, d.engine, stream.wait_seconds, report, now)
                if run.status is not None:  # rank 0: run_status.json's heartbeat
                    run.status.heartbeat(state.step, run.total_steps, beat)
            last = state.step == run.total_steps or state.step == stop_at_step
            interval = r.train.eval_interval
            if served is not None and (last or interval and state.step % interval == 0):
                for d in run.drafters:
                    d.evals.served(served, state.step)
            stopping = not last and stop.agreed(run.device)  # collective, every step
            halt = next((rep.stop for rep in reports if rep.stop), None)  # save, then fail
            if state.step % r.checkpoint.save_interval == 0 or last or stopping or halt:
                path = save_all(run, run.drafters)  # every drafter's, this step
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
    for d in reversed(run.drafters):  # the companions log through the main's trackio run
        d.tracker.close()
    say_done(run, time.time() - t_start, state.step - start_step)
    if state.step >= run.total_steps and run.rank == 0:
        for d in run.drafters:
            export_final(run, d)
    return stopped


# --------------------------------------------------------------------------- around the loop


def start_tracker(run: Run):
    from specforge_dspark.training.tracking import Tracker

    tracker = Tracker(run.recipe, run.rank, run.total_steps, run.state.step, run.dirs["trackio"])
    tracker.write(
        f"training {run.total_steps} steps on {run.ranks_said}, {len(run.dataset)} rows"
        f"{'' if run.plan is None else f' in {len(run.plan)} packed sequences'}, "
        f"{run.micro_per_epoch} micro-batches per rank per epoch"
    )
    return tracker


def companion_tracker(run: Run, d: Drafter, main):
    """A companion drafter's metrics.jsonl; its trackio metrics go into the job's run
    (`main`'s) as `<name>/<metric>`; no progress bar of its own."""
    from specforge_dspark.training.tracking import Tracker

    step, out = run.state.step, d.dirs["trackio"]
    return Tracker(d.recipe, run.rank, run.total_steps, step, out, main, f"{d.name}/")


def say_done(run: Run, took: float, done: int) -> None:
    if run.rank != 0:
        return
    line = f"done: {done} steps in {took:.1f} s ({took / max(done, 1):.3f} s/step)"
    capture = getattr(run.stream.engine, "forward_seconds", None)  # the hf worker's forwards
    if capture is not None:
        n = len(run.drafters)
        line += f", target capture {capture:.2f} s for {n} drafter(s) ({capture / n:.2f} s each)"
    if run.device.type == "cuda":
        line += f", peak GPU memory {torch.cuda.max_memory_allocated(run.device) / 2**30:.2f} GiB"
    print(line, flush=True)


def export_final(run: Run, d: Drafter) -> None:
    """Drafter d's serving exports (export.formats) of its final checkpoint, from its fp32
    master weights (one path for every ZeRO stage), and the calibration asked for."""
    from specforge_dspark.export.dispatch import export_checkpoint
    from specforge_dspark.training import checkpoint

    r, dirs = d.recipe, d.dirs
    final = checkpoint.step_dir(dirs["checkpoint"], run.state.step)
    for fmt in r.export.formats:
        out_dir = export_checkpoint(
            final,
            fmt,
            dirs["export"] / fmt,
            target_path=r.target.path or None,
            verifier_name=r.export.verifier_name or None,
        )
        what = f"{d.name} ({r.draft.kind})" if d.name else "drafter"
        print(f"exported {fmt} {what} to {out_dir}", flush=True)
    if r.export.calibrate_prompts:
        from specforge_dspark.decoding.calibration import calibrate_export

        calibrate_export(
            r.target.path,
            dirs["export"] / "sglang",
            workloads=r.export.calibrate_workloads,
            num_prompts=r.export.calibrate_prompts,
            out_dir=dirs["export"].parent / "calibration",
            device=str(run.device),
        )


if __name__ == "__main__":
    raise SystemExit(main())
