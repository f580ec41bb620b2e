"""Preflight of the features: check what the target engine hands the trainer, any engine.

    python -m specforge_dspark.cli.preflight --recipe R.yaml [--samples 4] [--reference auto]

and, with `train.preflight_samples > 0`, every rank of every run on its own stream before
its first step. One table, one row per check; a failure raises `PreflightError` (the CLI
exits 1, train.py 2) naming each failing check. Legend: B batch, S length, H hidden,
m aux layers, D = m*H, P checked positions, V LM-head rows.

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

import argparse
import json
import sys
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specforge_dspark.engines.features import (
    DTYPES,
    Sample,
    TargetFeatures,
    field,
    read_target_config,
    read_target_dims,
    tap_convention,
)

ARGMAX_MIN = 0.95
"""Least fraction of greedy positions whose teacher argmax must be the target's token."""
RELATIVE_TOL = {"float32": 1e-4, "bfloat16": 3e-2}
"""max |a - b| / max |b| allowed between two runs of the same features, by target.dtype."""
LOGPROB_TOL = {"float32": 1e-3, "bfloat16": 0.15}
"""Largest |teacher log p(y) - target log p(y)| on greedy positions, by target.dtype."""
REFERENCE_MAX_BYTES = 4 << 30
"""--reference auto loads the in-process hf reference only for weights up to this size."""
NEW_TOKENS = 16
"""Greedy tokens generated per prompt."""
PROMPT_MAX = 96
"""Prompt tokens kept (the last ones before the answer)."""


class PreflightError(ValueError):
    """The engine's features failed a preflight check; the message names each one."""


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not applicable here
    value: str
    limit: str = ""


@dataclass
class GreedyRow:
    """A sequence with the target's greedy token after each position in `positions_P`."""

    sample: Sample
    positions_P: torch.Tensor  # [P] positions t whose next token the target chose greedily
    tokens_P: torch.Tensor  # [P] that token
    logprobs_P: torch.Tensor  # [P] its log-prob under the target


# --------------------------------------------------------------------------- ground truth


def prompts_from(rows: Sequence[Any], n: int) -> list[list[int]]:
    """The first `n` rows' prompts: tokens before the first supervised one (<= PROMPT_MAX)."""
    out = []
    for row in rows:
        if len(out) == n:
            break
        ids, mask = list(field(row, "input_ids")), list(field(row, "loss_mask"))
        cut = mask.index(1) if 1 in mask else len(ids)
        if cut >= 1:
            out.append([int(t) for t in ids[max(0, cut - PROMPT_MAX) : cut]])
    if len(out) < n:
        raise ValueError(f"train.preflight_samples={n}: the data has only {len(out)} prompts")
    return out


def _rollout_row(sid: int, prompt: list[int], new: list[int], logprobs: list[float]) -> GreedyRow:
    ids = torch.tensor(prompt + new, dtype=torch.long)
    mask = torch.cat([torch.zeros(len(prompt), dtype=torch.long), torch.ones(len(new)).long()])
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(new) - 1)
    return GreedyRow(Sample(sid, ids, mask), positions, ids[positions + 1], torch.tensor(logprobs))


@torch.inference_mode()
def rollouts_hf(model: torch.nn.Module, prompts: list[list[int]], n: int) -> list[GreedyRow]:
    """Greedy continuations by the transformers model itself (cached decoding, no EOS stop)."""
    rows = []
    for sid, prompt in enumerate(prompts):
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        new, logprobs = [], []
        for _ in range(n):
            logp_V = out.logits[0, -1].float().log_softmax(-1)
            tok = int(logp_V.argmax())
            new.append(tok)
            logprobs.append(float(logp_V[tok]))
            step = torch.tensor([[tok]])
            out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
        rows.append(_rollout_row(sid, prompt, new, logprobs))
    return rows


def rollouts_sglang(
    url: str, prompts: list[list[int]], n: int, timeout_s: float
) -> list[GreedyRow]:
    """Greedy continuations by the SGLang server (what it serves), with their log-probs."""
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
    }
    replies = _post(f"{url}/generate", body, timeout_s)
    rows = []
    for sid, (prompt, reply) in enumerate(zip(prompts, replies, strict=True)):
        triples = reply["meta_info"]["output_token_logprobs"]  # [logprob, token id, text]
        new, logprobs = [int(t[1]) for t in triples], [float(t[0]) for t in triples]
        rows.append(_rollout_row(sid, prompt, new, logprobs))
    return rows


@torch.inference_mode()
def teacher_forced_rows(model: torch.nn.Module, samples: list[Any]) -> list[GreedyRow]:
    """The model's argmax after every position of given rows (an offline capture's)."""
    rows = []
    for s in samples:
        ids = torch.as_tensor(field(s, "input_ids"), dtype=torch.long)
        logp_SV = model(input_ids=ids[None]).logits[0].float().log_softmax(-1)
        tokens_S = logp_SV.argmax(-1)
        sample = Sample(int(field(s, "sample_id")), ids, torch.as_tensor(field(s, "loss_mask")))
        positions = torch.arange(ids.numel())
        rows.append(
            GreedyRow(sample, positions, tokens_S, logp_SV.gather(-1, tokens_S[:, None])[:, 0])
        )
    return rows


def _post(url: str, body: dict, timeout_s: float) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def server_chunk(url: str) -> int:
    """The server's chunked_prefill_size (<= 0: every prefill whole)."""
    with urllib.request.urlopen(f"{url}/server_info", timeout=30.0) as r:
        return int(json.loads(r.read()).get("chunked_prefill_size") or -1)


# --------------------------------------------------------------------------- checks


def relative_diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, that / max |want|) in float32."""
    got, want = got.float(), want.float()
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    return diff, diff / max(want.abs().max().item() if want.numel() else 0.0, 1e-12)


def _diff_check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> Check:
    diff, rel = relative_diff(got, want)
    return Check(name, rel <= tol, f"max abs {diff:.2g} (rel {rel:.2g})", f"rel <= {tol:g}")


def shape_checks(
    recipe, feats: list[TargetFeatures], expected_tap: str, recorded: str
) -> list[Check]:
    dims = read_target_dims(recipe.target.path, recipe.draft.target_layer_ids)
    m, H, dtype = len(dims.layer_ids), dims.hidden_size, DTYPES[recipe.target.dtype]
    widths = {(f.aux_hidden.shape[-1], f.last_hidden.shape[-1]) for f in feats}
    dtypes = {
        str(t.dtype).removeprefix("torch.") for f in feats for t in (f.aux_hidden, f.last_hidden)
    }
    bad_rows, n_seqs = 0, sum(len(f.sample_ids) for f in feats)
    for f in feats:
        for b, n in enumerate(f.lengths.tolist()):
            real_ok = all(bool(t[b, :n].isfinite().all()) for t in (f.aux_hidden, f.last_hidden))
            pad_ok = all(bool((t[b, n:] == 0).all()) for t in (f.aux_hidden, f.last_hidden))
            bad_rows += not (real_ok and pad_ok)
    want_dtype = str(dtype).removeprefix("torch.")
    return [
        Check(
            "aux width",
            widths == {(m * H, H)},
            ", ".join(f"aux {a}, last {h}" for a, h in sorted(widths)),
            f"aux {m} x {H} = {m * H}, last {H}",
        ),
        Check(
            "dtype", dtypes == {want_dtype}, ", ".join(sorted(dtypes)), f"target.dtype {want_dtype}"
        ),
        Check(
            "finite", bad_rows == 0, f"{bad_rows} bad of {n_seqs} sequences", "finite, padding 0"
        ),
        Check(
            "tap convention", recorded == expected_tap, recorded, f"{expected_tap} (architecture)"
        ),
    ]


def greedy_checks(
    rows: list[GreedyRow], feats: list[TargetFeatures], head, dtype: str
) -> list[Check]:
    """Teacher argmax and log-prob vs the target's greedy tokens; `feats[i]` holds row i alone."""
    hits = total = 0
    worst = 0.0
    for row, f in zip(rows, feats, strict=True):
        last_PH = f.last_hidden[0, row.positions_P].to(head.lm_head_weight.device)
        z_PV = head.teacher_logits(last_PH).float().cpu()
        logical_PV = z_PV[:, : head.logical_vocab].log_softmax(-1)
        hits += int((logical_PV.argmax(-1) == row.tokens_P).sum())
        total += row.positions_P.numel()
        # the target normalises over its logical rows (Inkling) or all LM-head rows (most
        # others) by architecture: the closer of the two is its own
        diffs = [
            (lp_PV.gather(-1, row.tokens_P[:, None])[:, 0] - row.logprobs_P).abs()
            for lp_PV in (logical_PV, z_PV.log_softmax(-1))
        ]
        worst = max(worst, torch.minimum(*diffs).max().item())
    rate, tol = hits / max(total, 1), LOGPROB_TOL[dtype]
    return [
        Check(
            "greedy argmax",
            rate >= ARGMAX_MIN,
            f"{hits}/{total} = {rate:.1%}",
            f">= {ARGMAX_MIN:.0%}",
        ),
        Check("greedy logprob", worst <= tol, f"max |diff| {worst:.2g}", f"<= {tol:g}"),
    ]


def _rows_of(f: TargetFeatures, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(f.lengths[b])
    return f.aux_hidden[b, :n], f.last_hidden[b, :n]


def batch_check(alone: list[TargetFeatures], together: TargetFeatures, tol: float) -> Check:
    worst = (0.0, 0.0)
    for b, f in enumerate(alone):
        for got, want in zip(_rows_of(together, b), _rows_of(f, 0), strict=True):
            worst = max(worst, relative_diff(got, want), key=lambda d: d[1])
    ok = worst[1] <= tol
    value = f"max abs {worst[0]:.2g} (rel {worst[1]:.2g}), {len(alone)} lengths padded"
    return Check("batch", ok, value, f"rel <= {tol:g}")


def split_check(whole: TargetFeatures, split: TargetFeatures, tol: float) -> Check:
    """The sample alone (whole prefill) vs packed behind a filler (row 1, split)."""
    worst = (0.0, 0.0)
    for got, want in zip(_rows_of(split, 1), _rows_of(whole, 0), strict=True):
        worst = max(worst, relative_diff(got, want), key=lambda d: d[1])
    n = int(whole.lengths[0])
    value = f"max abs {worst[0]:.2g} (rel {worst[1]:.2g}), {n} tokens cut at {n - n // 2}"
    return Check("split prefill", worst[1] <= tol, value, f"rel <= {tol:g}")


def split_plan(sample: Sample, chunk: int) -> tuple[Sample, list[Sample]] | None:
    """(the sample cut to <= chunk tokens, [filler, it]): packed behind the filler the
    server's prefill budget of `chunk` tokens runs out halfway through the sample."""
    if chunk <= 1:
        return None
    ids = torch.as_tensor(sample.input_ids)[:chunk]
    whole = Sample(1, ids, torch.ones_like(ids))
    filler_ids = ids.repeat(2)[: chunk - ids.numel() // 2]
    return whole, [Sample(0, filler_ids, torch.ones_like(filler_ids)), whole]


def reference_checks(
    layer_ids: list[int], engine: list[TargetFeatures], ref: list[TargetFeatures], tol: float
) -> list[Check]:
    H = ref[0].last_hidden.shape[-1]

    def part(f: TargetFeatures, i: int) -> torch.Tensor:  # aux slice i, or last (i = m)
        return f.last_hidden if i == len(layer_ids) else f.aux_hidden[..., i * H : (i + 1) * H]

    out = []
    for i, name in enumerate([*(f"L{k}" for k in layer_ids), "last"]):
        got = torch.cat([part(f, i).flatten() for f in engine])
        want = torch.cat([part(f, i).flatten() for f in ref])
        out.append(_diff_check(f"reference {name}", got, want, tol))
    return out


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
    t, dtype = recipe.target, recipe.target.dtype
    counters = (stream.wait_seconds, stream.bytes_out)
    ref = load_reference(recipe, reference)
    url = getattr(stream.engine, "url", None) if t.backend == "sglang" else None
    if t.backend == "offline":
        if ref is None:
            raise PreflightError("preflight: the offline backend needs the reference (target.path)")
        greedy = teacher_forced_rows(ref.model, [rows[i] for i in range(min(samples, len(rows)))])
    elif url is not None:
        greedy = rollouts_sglang(url, prompts_from(rows, samples), NEW_TOKENS, t.timeout_s)
    elif ref is not None:
        greedy = rollouts_hf(ref.model, prompts_from(rows, samples), NEW_TOKENS)
    else:
        greedy = None
    chosen = (
        [r.sample for r in greedy]
        if greedy
        else [_as_sample(rows[i]) for i in range(min(samples, len(rows)))]
    )
    plan = (
        split_plan(max(chosen, key=lambda s: len(s.input_ids)), server_chunk(url)) if url else None
    )
    batches = [[s] for s in chosen] + [chosen] + ([[plan[0]], plan[1]] if plan else [])
    feats = [_clone(f) for f in stream.iterate(batches)]
    stream.wait_seconds, stream.bytes_out = counters
    alone, together = feats[: len(chosen)], feats[len(chosen)]
    expected = tap_convention(read_target_config(t.path))
    checks = shape_checks(recipe, feats, expected, _recorded_tap(recipe, stream.engine, expected))
    if greedy:
        checks += greedy_checks(greedy, alone, head, dtype)
    else:
        checks += [
            Check(n, None, "n/a (no ground truth: no reference)")
            for n in ("greedy argmax", "greedy logprob")
        ]
    checks.append(batch_check(alone, together, RELATIVE_TOL[dtype]))
    if plan:
        checks.append(split_check(feats[-2], feats[-1], RELATIVE_TOL[dtype]))
    else:
        why = "the engine prefills whole" if url is None else "chunked_prefill_size <= 0"
        checks.append(Check("split prefill", None, f"n/a ({why})"))
    if ref is not None:
        hidden = together.last_hidden.shape[-1]
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


def _as_sample(row: Any) -> Sample:
    return Sample(int(field(row, "sample_id")), field(row, "input_ids"), field(row, "loss_mask"))


def _clone(f: TargetFeatures) -> TargetFeatures:
    """A copy that outlives the stream's shared-memory slot."""
    return TargetFeatures(
        list(f.sample_ids),
        f.input_ids.clone(),
        f.loss_mask.clone(),
        f.lengths.clone(),
        f.aux_hidden.clone(),
        f.last_hidden.clone(),
    )


def _batch(sample: Sample):
    from specforge_dspark.engines.features import pad_batch

    return pad_batch([sample])


def format_table(checks: list[Check], title: str) -> str:
    """One row per check: name, ok / FAIL / n/a, measured value, limit."""
    width = max(len(c.name) for c in checks)
    lines = [title]
    for c in checks:
        verdict = "n/a" if c.ok is None else "ok" if c.ok else "FAIL"
        lines.append(f"  {c.name:<{width}}  {verdict:<4}  {c.value:<44}  {c.limit}".rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from specforge_dspark.cli.capture import prepared_samples
    from specforge_dspark.objective.frozen_head import load_frozen_head
    from specforge_dspark.config.recipe import RecipeError, load_recipe
    from specforge_dspark.training.stream import FeatureStream

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True, help="recipe YAML (see recipes/)")
    ap.add_argument(
        "--samples", type=int, default=0, help="rows (default train.preflight_samples or 4)"
    )
    ap.add_argument("--reference", choices=["auto", "hf", "none"], default="auto")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, e.g. target.backend=hf")
    args = ap.parse_intermixed_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        samples = args.samples or recipe.train.preflight_samples or 4
        rows = prepared_samples(recipe)
        dtype = torch.bfloat16 if recipe.target.dtype == "bfloat16" else torch.float32
        head = load_frozen_head(recipe.target.path, dtype=dtype)
        with FeatureStream(recipe) as stream:
            preflight(recipe, stream, rows, head, samples, args.reference)
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (RecipeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
