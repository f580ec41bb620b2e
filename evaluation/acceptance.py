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

import argparse
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from evaluation.metrics import bootstrap_ci, step_stats
from evaluation.report import write_report
from specforge_dspark.decoding.hf_target import CacheMode, HFTarget
from specforge_dspark.decoding.prompts import (
    BUILTIN_WORKLOADS,
    Workload,
    load_conversations,
    parse_workload,
    render,
)
from specforge_dspark.decoding.sampling import SamplingTarget
from specforge_dspark.decoding.spec_decode import Drafter, Generation, Step, speculative_generate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class LosslessError(RuntimeError):
    """Speculative output differs from plain target greedy decoding."""


def load_drafter(draft: str | Path | Drafter, device: str, dtype: torch.dtype) -> Drafter:
    """An exported SGLang-layout directory (config.json + model.safetensors), `ngram:G`
    (the training-free prompt-lookup drafter of block size G, decoding/ngram.py) or a
    drafter."""
    if isinstance(draft, str) and draft.startswith("ngram:"):
        from specforge_dspark.decoding.ngram import NgramDrafter

        return NgramDrafter(int(draft.removeprefix("ngram:")))
    if isinstance(draft, (str, Path)):
        from specforge_dspark.drafters.dspark import DSparkDraft

        draft = DSparkDraft.from_pretrained(Path(draft))
    if isinstance(draft, torch.nn.Module):
        draft = draft.to(device=device, dtype=dtype).eval()
    return draft


def check_pair(drafter: Drafter, target: HFTarget) -> None:
    """A drafter trained for another target reads the wrong features: refuse it."""
    tcfg = target.model.config
    for field, want in (
        ("hidden_size", tcfg.hidden_size),
        ("num_target_layers", tcfg.num_hidden_layers),
    ):
        got = getattr(drafter.config, field, None)
        if got is not None and got != want:
            raise ValueError(f"--draft: config {field}={got}, but the target has {want}")


def head_fns(head) -> tuple[Callable, Callable]:
    """(embed_fn, logits_fn) of a frozen head. The draft's logits are NOT cropped to the
    logical vocabulary: SGLang 0.5.23's DSpark draft takes its argmax over every LM-head
    row (`models/dspark.py` crops only to `lm_head.org_vocab_size`, the padded row count
    for Inkling), so a padded row can be drafted (and is always rejected) when served. The
    target's greedy choice stays over its logical rows (see hf_target.py)."""
    return head.embed, head.logits


def check_lossless(spec: list[int], ref: list[int], where: str) -> None:
    if spec == ref:
        return
    i = next(
        (j for j, (a, b) in enumerate(zip(spec, ref, strict=False)) if a != b),
        min(len(spec), len(ref)),
    )
    got = spec[i] if i < len(spec) else "<end>"
    want = ref[i] if i < len(ref) else "<end>"
    raise LosslessError(
        f"{where}: speculative output differs from plain greedy at new token {i} "
        f"(speculative {got}, greedy {want}; lengths {len(spec)} vs {len(ref)})"
    )


def _answer_text(tokenizer, tokens: list[int], eos_ids: set[int]) -> str:
    body = tokens[:-1] if tokens and tokens[-1] in eos_ids else tokens
    return tokenizer.decode(body, skip_special_tokens=True)


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
) -> tuple[dict, list[Generation]]:
    """Decode the workload's prompts both ways; returns its statistics and generations.
    `logical_vocab`: the tokens the target emits (drafts at or above it are counted as
    padded-row drafts; None = not counted). At `temperature` > 0 the reference is plain
    sampling (timed, not compared: lossless in distribution is a test) and later turns
    follow the speculative answer; `budget` (a VerifyBudget) limits the drafts verified.
    `references` caches plain greedy outputs (and their seconds) by prompt across calls, so
    several drafters are checked against one decoding; `records` receives one dict per
    generation (the decoded text and its counts, for generations.jsonl)."""
    G = int(drafter.config.block_size)
    gens: list[Generation] = []
    units: list[int] = []  # the conversation of each generation (the bootstrap's unit)
    plain_s = 0.0
    plain_unknown = False
    sampling = temperature > 0
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
            check_lossless(gen.tokens, ref, where + (f" turn {turn + 1}" if turn else ""))
            gens.append(gen)
            units.append(conv.index)
            if records is not None:
                records.append(_record(workload.name, conv.index, turn, text, gen, target))
            messages.append(
                {
                    "role": "assistant",
                    "content": _answer_text(target.tokenizer, ref, target.eos_ids),
                }
            )
    steps: list[Step] = [s for g in gens for s in g.steps]
    stats = step_stats(steps, G, logical_vocab)
    tokens = sum(len(g.tokens) for g in gens)
    spec_s = sum(g.seconds for g in gens)
    stats.update(lossless=None if sampling else True, prompts=len(conversations))
    stats["accept_length_ci"] = accept_length_ci(gens, units)
    stats.update(_speed(len(gens), tokens, None if plain_unknown else plain_s, spec_s))
    log(
        f"{workload.name}: {len(gens)} generations, {tokens} tokens, {len(steps)} steps, "
        f"accept length {_fmt(stats['accept_length'])}, "
        f"padded drafts {_fmt(stats['padded_draft_rate'])}, "
        + (f"temperature {temperature}" if sampling else "lossless")
        + ("" if budget is None else f", {_fmt(stats['tokens_per_verified_token'])} tok/verified")
    )
    return stats, gens


def _record(workload: str, index: int, turn: int, prompt: str, gen: Generation, target) -> dict:
    return {
        "workload": workload,
        "index": index,
        "turn": turn,
        "prompt": prompt,
        "output": target.tokenizer.decode(gen.tokens, skip_special_tokens=True),
        "new_tokens": len(gen.tokens),
        "verify_steps": len(gen.steps),
        "committed": sum(st.committed for st in gen.steps),
        "accepted_per_step": [st.accepted for st in gen.steps],
    }


def accept_length_ci(gens: list[Generation], units: list) -> list[float] | None:
    """95% bootstrap interval of the pooled accept length, resampling conversations
    (`units[i]` names generation i's; an MT-Bench conversation's two turns stay together)."""
    committed: dict = {}
    steps: dict = {}
    for gen, unit in zip(gens, units, strict=True):
        committed[unit] = committed.get(unit, 0) + sum(st.committed for st in gen.steps)
        steps[unit] = steps.get(unit, 0) + len(gen.steps)
    keys = [k for k in committed if steps[k]]
    return bootstrap_ci([committed[k] for k in keys], [steps[k] for k in keys])


@torch.inference_mode()
def greedy_references(
    target_path: str | Path,
    workloads: list[str],
    num_prompts: int,
    max_new_tokens: int,
    data_dir: str | Path | None = None,
    batch_size: int = 20,
) -> dict:
    """Plain greedy outputs of every prompt and later turn (conditioned on the earlier
    outputs, as run_workload builds them) decoded in left-padded batches: a cache for
    `evaluate(references=...)` shared by several drafters. A batch can round differently
    from one-by-one decoding; run_workload decodes a prompt one by one again whenever its
    speculative output differs from the cached one, so the lossless check always rests
    on one-by-one greedy decoding. Entries carry no time (speedup is then not reported)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specforge_dspark.decoding.hf_target import batched_greedy, eos_token_ids

    tok = AutoTokenizer.from_pretrained(target_path)
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    eos = eos_token_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else sorted(eos)[0]
    data = Path(data_dir) if data_dir is not None else None
    out: dict = {}
    for spec in workloads:
        convs = load_conversations(parse_workload(spec, data), num_prompts)
        history: list[list[dict]] = [[] for _ in convs]
        for turn in range(max(len(c.turns) for c in convs)):
            live = [i for i, c in enumerate(convs) if turn < len(c.turns)]
            for i in live:
                history[i].append({"role": "user", "content": convs[i].turns[turn]})
            prompts = [render(tok, history[i]) for i in live]
            for b in range(0, len(live), batch_size):
                chunk = prompts[b : b + batch_size]
                news = batched_greedy(model, chunk, max_new_tokens, eos, pad)
                for i, q, new in zip(live[b : b + batch_size], chunk, news, strict=True):
                    out[(tuple(q), max_new_tokens)] = (new, None)
                    history[i].append({"role": "assistant", "content": _answer_text(tok, new, eos)})
    return out


def _budgets(drafter, draft, cost: float | None, sts_path) -> dict:
    """{"uncalibrated": VerifyBudget, "calibrated": VerifyBudget (when an STS file is
    given or sits in the draft directory)} for a verify-token cost; {} without one.
    Uncalibrated is the head as trained: a confidence-bias shift that calibration added
    to the export (its safetensors metadata) is taken off again."""
    if cost is None:
        return {}
    from evaluation.budget import VerifyBudget
    from evaluation.calibrate import STS_FILE, read_bias_shift, validate_sts_file

    G = int(drafter.config.block_size)
    shift = 0.0
    if isinstance(draft, (str, Path)):
        if (Path(draft) / "model.safetensors").is_file():
            shift = read_bias_shift(draft)
        if sts_path is None and (Path(draft) / STS_FILE).is_file():
            sts_path = Path(draft) / STS_FILE
    out = {"uncalibrated": VerifyBudget(G, cost, logit_offset=-shift)}
    if sts_path is not None:
        out["calibrated"] = VerifyBudget(G, cost, validate_sts_file(Path(sts_path), G))
    return out


def _budget_row(stats: dict) -> dict:
    keys = ("steps", "accept_length", "verified_tokens", "tokens_per_verified_token")
    row = {k: stats[k] for k in keys}
    row["drafts_verified_per_step"] = (
        stats["verified_tokens"] / stats["steps"] - 1 if stats["steps"] else None
    )
    return row


def _pooled_speed(stats: Iterable[dict]) -> dict:
    stats = list(stats)
    plain = [s["seconds_plain"] for s in stats]
    return _speed(
        sum(s["generations"] for s in stats),
        sum(s["new_tokens"] for s in stats),
        None if None in plain else sum(plain),
        sum(s["seconds_spec"] for s in stats),
    )


def _speed(generations: int, tokens: int, plain_s: float | None, spec_s: float) -> dict:
    """Wall-clock figures of plain vs speculative decoding (reported, never asserted);
    plain_s None: the references came batched (greedy_references), not timed per prompt."""
    if plain_s is None:
        return {
            "generations": generations,
            "new_tokens": tokens,
            "seconds_plain": None,
            "seconds_spec": spec_s,
            "tokens_per_s_plain": None,
            "tokens_per_s_spec": tokens / spec_s if spec_s else None,
            "speedup": None,
        }
    return {
        "generations": generations,
        "new_tokens": tokens,
        "seconds_plain": plain_s,
        "seconds_spec": spec_s,
        "tokens_per_s_plain": tokens / plain_s if plain_s else None,
        "tokens_per_s_spec": tokens / spec_s if spec_s else None,
        "speedup": plain_s / spec_s if spec_s else None,
    }


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
) -> dict:
    """Evaluate `draft` on `workloads` (built-in names or name=path:field); returns summary.

    `head` (with `.embed` and `.logits`, and `.logical_vocab` for `padded_draft_rate`)
    defaults to `load_frozen_head(target_path)`. `temperature` > 0: speculative sampling
    with SGLang's DSPARK rule, every draw from `seed`. `verify_token_cost` (step time
    1 + cost * verified tokens): also decode with SGLang's confidence verify budget,
    uncalibrated and (with `sts_path`, default DRAFT/sts_calibration.json when present)
    calibrated, and report tokens per verified token of each (summary `verify_budget`).
    `references`: a dict shared by several calls so that plain greedy decoding of each
    prompt runs once (the lossless reference). The decoded texts go to
    OUT/generations.jsonl; accept lengths carry a 95% bootstrap interval over prompts.
    """
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not workloads:
        raise ValueError("--workloads: give at least one workload")
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
        from specforge_dspark.export.core import check_conventions

        check_conventions(draft, target_path=target_path)
    drafter = load_drafter(draft, device, DTYPES[dtype])
    G = int(drafter.config.block_size)
    layer_ids = list(drafter.config.target_layer_ids)
    target_cls = SamplingTarget if temperature > 0 else HFTarget
    target = target_cls.load(target_path, layer_ids, cache_mode, device, DTYPES[dtype])
    check_pair(drafter, target)
    if head is None:
        from specforge_dspark.frozen_head import load_frozen_head

        head = load_frozen_head(target_path, device=device, dtype=DTYPES[dtype])
    embed_fn, logits_fn = head_fns(head)
    logical_vocab = getattr(head, "logical_vocab", None)
    target.greedy(render(target.tokenizer, [{"role": "user", "content": "hi"}]), 2)  # warm-up

    budgets = _budgets(drafter, draft, verify_token_cost, sts_path)
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
            )

        n_before = len(records)
        stats, gens = run()
        all_gens.extend(gens)
        all_units.extend((r["workload"], r["index"]) for r in records[n_before:])
        per_workload[workload.name] = stats
        all_steps.extend(s for g in gens for s in g.steps)
        if budgets:
            stats["verify_budget"] = {"verify_all": _budget_row(stats)}
            for name, budget in budgets.items():
                b_stats, b_gens = run(budget)
                stats["verify_budget"][name] = _budget_row(b_stats)
                budget_steps[name].extend(s for g in b_gens for s in g.steps)

    overall = step_stats(all_steps, G, logical_vocab)  # pooled over verify steps
    overall["accept_length_ci"] = accept_length_ci(all_gens, all_units)
    overall["lossless"] = (
        None if temperature > 0 else all(w["lossless"] for w in per_workload.values())
    )
    if budgets:
        overall["verify_budget"] = {"verify_all": _budget_row(overall)} | {
            name: _budget_row(step_stats(steps, G, logical_vocab))
            for name, steps in budget_steps.items()
        }
    overall.update(_pooled_speed(per_workload.values()))
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
    log(
        f"overall accept length {_fmt(overall['accept_length'])} "
        f"(95% CI {ci[0]:.3f}-{ci[1]:.3f}) -> {out_dir}"
        if ci
        else f"overall accept length {_fmt(overall['accept_length'])} -> {out_dir}"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="hf target directory")
    ap.add_argument(
        "--draft",
        required=True,
        help="exported drafter (config.json + safetensors), or ngram:G for the n-gram baseline",
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
