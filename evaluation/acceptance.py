"""Accept length of a DSpark drafter, measured by real speculative decoding.

    python -m evaluation.acceptance --target PATH --draft DIR \
        --workloads gsm8k,math500,humaneval,mt_bench --num-prompts 20 \
        --max-new-tokens 256 --out runs/eval

Every prompt is also decoded by plain target greedy; the speculative output must equal
it token for token (`LosslessError` otherwise, naming the workload and prompt).
`--temperature T` (> 0) runs SGLang DSPARK's speculative sampling instead (lossless in
distribution, tests/test_sampling_lossless.py); `--verify-token-cost C` adds decoding
with SGLang's confidence verify budget, without and with the STS calibration (`--sts`). Writes
summary.json, report.md, per_position.csv and PNG plots to --out (see report.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from evaluation.budget import budget_row, verify_budgets
from evaluation.metrics import accept_length_ci, by_context, pooled_speed, speed_stats, step_stats
from evaluation.report import generation_record, write_report
from specforge_dspark.config.command_line import command_parser
from specforge_dspark.decoding.hf_target import CacheMode, HFTarget
from specforge_dspark.decoding.loading import DTYPES, check_pair, head_fns, load_drafter
from specforge_dspark.decoding.prompts import (
    BUILTIN_WORKLOADS,
    Workload,
    answer_text,
    load_conversations,
    parse_workload,
    render,
)
from specforge_dspark.decoding.sampling import SamplingTarget
from specforge_dspark.decoding.spec_decode import (
    Drafter,
    Generation,
    Step,
    check_lossless,
    speculative_generate,
)


def run_workload(
    target: HFTarget,
    drafter: Drafter,
    workload: Workload,
    num_prompts: int,
    max_new_tokens: int,
    embed_fn: Callable,
    logits_fn: Callable,
    log: Callable[[str], None] = print,
    *,
    logical_vocab: int | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    budget=None,
    references: dict | None = None,
    records: list[dict] | None = None,
    divergence: str = "raise",
) -> tuple[dict, list[Generation]]:
    """Decode the workload's prompts both ways; returns its statistics and generations.
    `logical_vocab`: the tokens the target emits (drafts at or above it are counted as
    padded-row drafts; None = not counted). At `temperature` > 0 the reference is plain
    sampling (timed, not compared: lossless in distribution is a test) and later turns
    follow the speculative answer; `budget` (a VerifyBudget) limits the drafts verified.
    `references` caches plain greedy outputs (and their seconds) by prompt across calls, so
    several drafters are checked against one decoding; `records` receives one dict per
    generation (the decoded text and its counts, for generations.jsonl). `divergence`
    "follow" (for targets emulating a quantized format, where a verify forward may round a
    near tie apart from a one-token forward) counts outputs that differ from plain greedy
    (stats `diverged`) and follows them; "raise" is the lossless check."""
    G = int(drafter.config.block_size)
    gens: list[Generation] = []
    units: list[int] = []  # the conversation of each generation (the bootstrap's unit)
    plain_s = 0.0
    plain_unknown = False
    sampling = temperature > 0
    diverged = 0
    if sampling and generator is None:
        generator = torch.Generator().manual_seed(0)
    ref_gen = torch.Generator().manual_seed(1) if sampling else None
    extra = {"temperature": temperature, "generator": generator} if sampling else {}
    if budget is not None:
        extra["budget"] = budget
    conversations = load_conversations(workload, num_prompts)
    for conv in conversations:
        messages: list[dict] = []
        for turn, text in enumerate(conv.turns):
            messages.append({"role": "user", "content": text})
            ids = render(target.tokenizer, messages)
            key = (tuple(ids), max_new_tokens)
            cached = not sampling and references is not None and key in references
            if cached:
                ref, took = references[key]
            else:
                t0 = time.perf_counter()
                if sampling:
                    target.sample(ids, max_new_tokens, temperature, ref_gen)
                else:
                    ref = target.greedy(ids, max_new_tokens)
                took = time.perf_counter() - t0
                if not sampling and references is not None:
                    references[key] = (ref, took)
            gen = speculative_generate(
                target, drafter, ids, max_new_tokens, embed_fn, logits_fn, **extra
            )
            where = f"workload {workload.name} prompt {conv.index}"
            if cached and took is None and gen.tokens != ref:  # a batched reference: redo it
                t0 = time.perf_counter()  # one by one, the reference the check rests on
                ref = target.greedy(ids, max_new_tokens)
                took = time.perf_counter() - t0
                references[key] = (ref, took)
                log(f"{where}: the batched reference differed; decoded it one by one")
            if took is None:
                plain_unknown = True  # batched references carry no per-prompt time
            else:
                plain_s += took
            if sampling:
                ref = gen.tokens
            elif divergence == "follow" and gen.tokens != ref:
                diverged += 1
                log(f"{where}: differs from plain greedy (a near tie rounded apart); followed")
                ref = gen.tokens
            check_lossless(gen.tokens, ref, where + (f" turn {turn + 1}" if turn else ""))
            gens.append(gen)
            units.append(conv.index)
            if records is not None:
                records.append(
                    generation_record(workload.name, conv.index, turn, text, gen, target)
                )
            messages.append(
                {
                    "role": "assistant",
                    "content": answer_text(target.tokenizer, ref, target.eos_ids),
                }
            )
    steps: list[Step] = [s for g in gens for s in g.steps]
    stats = step_stats(steps, G, logical_vocab)
    tokens = sum(len(g.tokens) for g in gens)
    spec_s = sum(g.seconds for g in gens)
    lossless = None if sampling else diverged == 0
    stats.update(lossless=lossless, prompts=len(conversations), diverged=diverged)
    stats["accept_length_ci"] = accept_length_ci(gens, units)
    stats["by_context"] = by_context(gens, units)
    stats.update(speed_stats(len(gens), tokens, None if plain_unknown else plain_s, spec_s))
    log(
        f"{workload.name}: {len(gens)} generations, {tokens} tokens, {len(steps)} steps, "
        f"accept length {_fmt(stats['accept_length'])}, "
        f"padded drafts {_fmt(stats['padded_draft_rate'])}, "
        + (f"temperature {temperature}" if sampling else "lossless")
        + ("" if budget is None else f", {_fmt(stats['tokens_per_verified_token'])} tok/verified")
    )
    return stats, gens


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def evaluate(
    target_path: str | Path,
    draft: str | Path | Drafter,
    workloads: list[str],
    num_prompts: int,
    max_new_tokens: int,
    out_dir: str | Path,
    data_dir: str | Path | None = None,
    cache_mode: CacheMode = "crop",
    device: str = "cpu",
    dtype: str = "float32",
    head=None,
    log: Callable[[str], None] = print,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    verify_token_cost: float | None = None,
    sts_path: str | Path | None = None,
    references: dict | None = None,
    divergence: str = "raise",
) -> dict:
    """Evaluate `draft` on `workloads` (built-in names or name=path:field); returns summary.

    `head` (with `.embed` and `.logits`, and `.logical_vocab` for `padded_draft_rate`)
    defaults to `load_frozen_head(target_path)`. `temperature` > 0: speculative sampling
    with SGLang's DSPARK rule, every draw from `seed`. `verify_token_cost` (step time
    1 + cost * verified tokens): also decode with SGLang's confidence verify budget,
    uncalibrated and (with `sts_path`, default DRAFT/sts_calibration.json when present)
    calibrated, and report tokens per verified token of each (summary `verify_budget`).
    `references`: a dict shared by several calls so that plain greedy decoding of each
    prompt runs once (the lossless reference; references.greedy_references fills one in
    batches). `divergence`: run_workload's (a quantized target's near ties). The decoded
    texts go to
    OUT/generations.jsonl; accept lengths carry a 95% bootstrap interval over prompts.
    """
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not workloads:
        raise ValueError("--workloads: give at least one workload")
    if divergence not in ("raise", "follow"):
        raise ValueError(f"divergence must be raise or follow, got {divergence!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    if verify_token_cost is not None and verify_token_cost < 0:
        raise ValueError(f"--verify-token-cost must be >= 0, got {verify_token_cost}")
    data = Path(data_dir) if data_dir is not None else None
    parsed = [parse_workload(spec, data) for spec in workloads]
    names = [w.name for w in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"--workloads: a workload name is given twice in {names}")
    is_export = isinstance(draft, Path) or isinstance(draft, str) and not draft.startswith("ngram:")
    if is_export:  # an export made for another target: refuse it
        from specforge_dspark.decoding.loading import NO_SELECTOR
        from specforge_dspark.export.conventions import check_conventions

        check_conventions(str(draft).removeprefix(NO_SELECTOR), target_path=target_path)
    drafter = load_drafter(draft, device, DTYPES[dtype])
    G = int(drafter.config.block_size)
    layer_ids = list(drafter.config.target_layer_ids)
    target_cls = SamplingTarget if temperature > 0 else HFTarget
    target = target_cls.load(target_path, layer_ids, cache_mode, device, DTYPES[dtype])
    check_pair(drafter, target)
    if head is None:
        from specforge_dspark.objective.frozen_head import load_frozen_head

        head = load_frozen_head(target_path, device=device, dtype=DTYPES[dtype])
    embed_fn, logits_fn = head_fns(head)
    logical_vocab = getattr(head, "logical_vocab", None)
    target.greedy(render(target.tokenizer, [{"role": "user", "content": "hi"}]), 2)  # warm-up

    budgets = verify_budgets(drafter, draft, verify_token_cost, sts_path)
    per_workload: dict[str, dict] = {}
    all_steps: list[Step] = []
    all_gens: list[Generation] = []
    all_units: list[tuple[str, int]] = []
    records: list[dict] = []
    budget_steps: dict[str, list[Step]] = {name: [] for name in budgets}
    for workload in parsed:

        def run(budget=None, workload=workload):
            return run_workload(
                target,
                drafter,
                workload,
                num_prompts,
                max_new_tokens,
                embed_fn,
                logits_fn,
                log,
                logical_vocab=logical_vocab,
                temperature=temperature,
                generator=torch.Generator().manual_seed(seed),
                budget=budget,
                references=references,
                records=records if budget is None else None,
                divergence=divergence,
            )

        n_before = len(records)
        stats, gens = run()
        all_gens.extend(gens)
        all_units.extend((r["workload"], r["index"]) for r in records[n_before:])
        per_workload[workload.name] = stats
        all_steps.extend(s for g in gens for s in g.steps)
        if budgets:
            stats["verify_budget"] = {"verify_all": budget_row(stats)}
            for name, budget in budgets.items():
                b_stats, b_gens = run(budget)
                stats["verify_budget"][name] = budget_row(b_stats)
                budget_steps[name].extend(s for g in b_gens for s in g.steps)

    overall = step_stats(all_steps, G, logical_vocab)  # pooled over verify steps
    overall["accept_length_ci"] = accept_length_ci(all_gens, all_units)
    overall["by_context"] = by_context(all_gens, all_units)
    overall["lossless"] = (
        None if temperature > 0 else all(w["lossless"] for w in per_workload.values())
    )
    overall["diverged"] = sum(w["diverged"] for w in per_workload.values())
    if budgets:
        overall["verify_budget"] = {"verify_all": budget_row(overall)} | {
            name: budget_row(step_stats(steps, G, logical_vocab))
            for name, steps in budget_steps.items()
        }
    overall.update(pooled_speed(per_workload.values()))
    lengths = [w["accept_length"] for w in per_workload.values() if w["accept_length"] is not None]
    summary = {
        "target": str(target_path),
        "draft": str(draft) if isinstance(draft, (str, Path)) else type(draft).__name__,
        "block_size": G,
        "target_layer_ids": layer_ids,
        "num_prompts": num_prompts,
        "max_new_tokens": max_new_tokens,
        "cache_mode": cache_mode,
        "temperature": temperature,
        "seed": seed,
        "verify_token_cost": verify_token_cost,
        "sts_temperatures": budgets["calibrated"].temperatures if "calibrated" in budgets else None,
        "device": device,
        "dtype": dtype,
        "logical_vocab": logical_vocab,
        "workloads": per_workload,
        "overall": overall,
        "macro_accept_length": sum(lengths) / len(lengths) if lengths else None,
    }
    write_report(summary, Path(out_dir))
    with (Path(out_dir) / "generations.jsonl").open("w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    ci = overall["accept_length_ci"]
    pooled = f"accept length on {'+'.join(per_workload)} {_fmt(overall['accept_length'])}"
    # a caller that splits workloads over processes (scripts/demo.py) prints the overall
    log(
        f"{pooled} (95% CI {ci[0]:.3f}-{ci[1]:.3f}) -> {out_dir}"
        if ci
        else f"{pooled} -> {out_dir}"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(
        "evaluation.acceptance",
        __doc__.split("\n\n")[0],
        "python -m evaluation.acceptance --target .cache/tiny_target "
        "--draft runs/demo/export/sglang --out runs/acceptance",
    )
    ap.add_argument("--target", required=True, help="hf target directory")
    ap.add_argument(
        "--draft",
        required=True,
        help="exported drafter (config.json + safetensors), ngram:G for the n-gram baseline, or "
        "no-selector:DIR for a DFlash2 export with its selector off",
    )
    ap.add_argument(
        "--workloads",
        default="gsm8k,math500,humaneval,mt_bench",
        help=f"comma list of built-ins ({', '.join(BUILTIN_WORKLOADS)}) or name=path:field",
    )
    ap.add_argument(
        "--workload",
        action="append",
        default=[],
        metavar="NAME=PATH:FIELD",
        help="an extra jsonl workload read by field name (repeatable)",
    )
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--data-dir", type=Path, default=None, help="folder of the built-ins")
    ap.add_argument("--cache-mode", choices=["crop", "rerun"], default="crop")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0, help="seed of every draw at T > 0")
    ap.add_argument(
        "--verify-token-cost",
        type=float,
        default=None,
        help="also run SGLang's confidence verify budget (step time 1 + cost * tokens)",
    )
    ap.add_argument("--sts", type=Path, default=None, help="STS calibration JSON")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    specs = [w for w in a.workloads.split(",") if w.strip()] + a.workload
    evaluate(
        a.target,
        a.draft,
        specs,
        a.num_prompts,
        a.max_new_tokens,
        a.out,
        a.data_dir,
        a.cache_mode,
        a.device,
        a.dtype,
        temperature=a.temperature,
        seed=a.seed,
        verify_token_cost=a.verify_token_cost,
        sts_path=a.sts,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
