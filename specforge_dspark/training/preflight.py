"""Preflight of the features: check what the target engine hands the trainer, any engine.

    python -m specforge_dspark.cli.preflight --recipe R.yaml [--rows 4] [--reference auto]

(cli/preflight.py) and, with `train.preflight_samples > 0`, every rank of every run on
its own stream before its first step. One table, one row per check; a failure raises
`PreflightError` (the CLI exits 1, train.py 2) naming each failing check. Legend: B batch,
S length, H hidden, m aux layers, D = m*H, P checked positions, V LM-head rows.

  aux width       aux_hidden [B,S,m*H] and last_hidden [B,S,H] (m, H: recipe and config)
  dtype           both are target.dtype
  finite          no NaN/Inf on real rows, zeros on padding
  tap convention  the engine's aux tap is SGLang's for the architecture (`tap_convention`);
                  an offline capture's recorded tap must equal it
  greedy argmax   argmax of `FrozenHead.teacher_logits(last_hidden)` equals the target's own
                  greedy next token on >= ARGMAX_MIN of the positions (a wrong tap of the
                  final hidden, the head or the vocab crop fails here)
  greedy logprob  our teacher's log-prob of that token equals the target's (`LOGPROB_TOL`):
                  a pre-norm hidden or a muP/softcap slip only rescales the logits, which
                  can keep every argmax
  batch           each sample alone == the same sample right-padded in one batch with the
                  others (relative max abs diff, `RELATIVE_TOL`)
  split prefill   sglang with chunked_prefill_size c > 0: a sample the server prefills whole
                  (alone, <= c tokens) == the same sample split (packed behind a filler of
                  c - n/2 tokens, so the budget cuts it); n/a for engines that prefill whole
  reference L<k>  per aux layer, and `last`: max abs diff to the hf backend's code run
                  in-process on the same target (`--reference auto` loads it when the
                  weights are under REFERENCE_MAX_BYTES; `none` skips)

Ground truth for the greedy rows comes from the target itself, never from our head on the
engine's features (that would agree with itself under any norm): with the sglang backend
the server's own `/generate` (greedy, ignore_eos, with the chosen tokens' log-probs), so it
holds for targets too big to load here; otherwise the reference transformers model:
a cached greedy rollout from each prompt (hf), or for an offline capture, which serves only
the captured rows, the model's teacher-forced argmax at every position of those rows.
Prompts are the recipe's first data rows cut at their first supervised token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specforge_dspark.engines.tap import read_target_config, tap_convention
from specforge_dspark.training.preflight_checks import (
    NEW_TOKENS,
    REFERENCE_MAX_BYTES,
    RELATIVE_TOL,
    Check,
    PreflightError,
    batch_check,
    format_table,
    greedy_checks,
    prompts_from,
    reference_checks,
    rollouts_hf,
    rollouts_sglang,
    server_chunk,
    shape_checks,
    split_check,
    split_plan,
    teacher_forced_rows,
)
from specforge_dspark.transport.features import Sample, TargetFeatures, field
from specforge_dspark.transport.slot_budget import request_budget

# --------------------------------------------------------------------------- the run


def load_reference(recipe, mode: str):
    """The hf backend's target in-process (engines/hf.py HFTarget, CPU) or None."""
    from specforge_dspark.engines.hf import HFTarget

    if mode == "none":
        return None
    size = sum(p.stat().st_size for p in Path(recipe.target.path).glob("*.safetensors"))
    if mode == "auto" and size > REFERENCE_MAX_BYTES:
        return None
    t = recipe.target
    return HFTarget(t.path, t.dtype, "cpu", list(recipe.draft.target_layer_ids), chunk=1)


def _recorded_tap(recipe, engine: Any, expected: str) -> str:
    store = getattr(engine, "store", None)  # an offline capture records its tap
    if recipe.target.backend == "offline" and store is not None:
        return store.manifest["target"].get("tap", "layer_output")
    return expected  # hf: AuxTap picks it by tap_convention; sglang: the server's model class


def preflight(
    recipe,
    stream,
    rows: Sequence[Any],
    head,
    samples: int = 4,
    reference: str = "auto",
    log: Callable[[str], None] | None = print,
) -> list[Check]:
    """Run every check on an open FeatureStream (`stream.iterate`); print the table with
    `log`; raise PreflightError naming the failures. The stream's wait/bytes counters are
    left as they were, so training's first log window does not count the preflight."""
    t = recipe.target
    dtype = t.transport_dtype if t.transport_dtype != "auto" else t.dtype  # the tolerances
    last_dtype = "bfloat16" if t.transport_dtype == "fp8_e4m3" else t.dtype  # never fp8
    counters = (stream.wait_seconds, stream.bytes_out)
    ref = load_reference(recipe, reference)
    url = getattr(stream.engine, "url", None) if t.backend == "sglang" else None
    api_key = getattr(stream.engine, "api_key", None)
    if t.backend == "offline":
        if ref is None:
            raise PreflightError("preflight: the offline backend needs the reference (target.path)")
        greedy = teacher_forced_rows(ref.model, [rows[i] for i in range(min(samples, len(rows)))])
    elif url is not None:
        greedy = rollouts_sglang(url, prompts_from(rows, samples), NEW_TOKENS, t.timeout_s, api_key)
    elif ref is not None:
        greedy = rollouts_hf(ref.model, prompts_from(rows, samples), NEW_TOKENS)
    else:
        greedy = None
    chosen = (
        [r.sample for r in greedy]
        if greedy
        else [_as_sample(rows[i]) for i in range(min(samples, len(rows)))]
    )
    budget = request_budget(recipe)
    together = _fitting(chosen, budget)
    longest = max(chosen, key=lambda s: len(s.input_ids))
    plan = split_plan(longest, server_chunk(url, api_key)) if url else None
    plan_fits = plan is not None and not budget.refusal([len(s.input_ids) for s in plan[1]])
    batches = [[s] for s in chosen] + [together] + ([[plan[0]], plan[1]] if plan_fits else [])
    window, stream.window = stream.window, None  # every position's rows: the checks read them
    try:
        feats = [_clone(f) for f in stream.iterate(batches)]
    finally:
        stream.window = window
    stream.wait_seconds, stream.bytes_out = counters
    alone, together_f = feats[: len(chosen)], feats[len(chosen)]
    expected = tap_convention(read_target_config(t.path))
    checks = shape_checks(recipe, feats, expected, _recorded_tap(recipe, stream.engine, expected))
    if greedy:
        checks += greedy_checks(greedy, alone, head, last_dtype)
    else:
        checks += [
            Check(n, None, "n/a (no ground truth: no reference)")
            for n in ("greedy argmax", "greedy logprob")
        ]
    if len(together) > 1:
        checks.append(batch_check(alone[: len(together)], together_f, RELATIVE_TOL[dtype]))
    else:
        checks.append(Check("batch", None, f"n/a (two rows exceed one request: {budget.keys})"))
    if plan_fits:
        checks.append(split_check(feats[-2], feats[-1], RELATIVE_TOL[dtype]))
    else:
        why = (
            "the engine prefills whole"
            if url is None
            else "chunked_prefill_size <= 0"
            if plan is None
            else f"the split request exceeds one request: {budget.keys}"
        )
        checks.append(Check("split prefill", None, f"n/a ({why})"))
    if ref is not None:
        hidden = together_f.last_hidden.shape[-1]
        ref_feats = [ref.forward(_batch(s), hidden) for s in chosen]
        checks += reference_checks(
            list(recipe.draft.target_layer_ids), alone, ref_feats, RELATIVE_TOL[dtype]
        )
    else:
        checks.append(Check("reference", None, f"n/a (no reference: --reference {reference})"))
    if log is not None:
        log(format_table(checks, f"preflight: {t.backend} engine, target {t.path}, {dtype}"))
    failed = [c for c in checks if c.ok is False]
    if failed:
        raise PreflightError(
            "preflight failed: " + "; ".join(f"{c.name}: {c.value}, want {c.limit}" for c in failed)
        )
    return checks


def preflight_run(run, stream) -> None:
    """train.py's hook: with train.preflight_samples > 0 each rank checks its open stream
    on the first data rows before its first step (rank 0 prints the table)."""
    n = run.recipe.train.preflight_samples
    if n:
        say = print if run.rank == 0 else None
        preflight(run.recipe, stream, run.dataset, run.head, n, log=say)


def _fitting(chosen: list[Sample], budget) -> list[Sample]:
    """The longest prefix of `chosen` that one request of the run can hold (the slot
    budget, slot_budget.py): the batch check never asks for a bigger slot than training."""
    lengths = [len(s.input_ids) for s in chosen]
    k = len(chosen)
    while k > 1 and budget.refusal(lengths[:k]):
        k -= 1
    return chosen[:k]


def _as_sample(row: Any) -> Sample:
    return Sample(int(field(row, "sample_id")), field(row, "input_ids"), field(row, "loss_mask"))


def _clone(f: TargetFeatures) -> TargetFeatures:
    """A copy that outlives the stream's shared-memory slot (fp8 aux rows dequantized)."""
    f = f.to("cpu")
    return TargetFeatures(
        list(f.sample_ids),
        f.input_ids.clone(),
        f.loss_mask.clone(),
        f.lengths.clone(),
        f.aux_hidden.clone(),
        f.last_hidden.clone(),
    )


def _batch(sample: Sample):
    from specforge_dspark.transport.features import pad_batch

    return pad_batch([sample])
