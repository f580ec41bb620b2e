"""Accept length of a DSpark drafter, measured by real greedy speculative decoding.

    python -m evaluation.acceptance --target PATH --draft DIR \
        --workloads gsm8k,math500,humaneval,mt_bench --num-prompts 20 \
        --max-new-tokens 256 --out runs/eval

Every prompt is also decoded by plain target greedy; the speculative output must equal
it token for token (`LosslessError` otherwise, naming the workload and prompt). Writes
summary.json, report.md, per_position.csv and PNG plots to --out (see report.py).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from evaluation.hf_target import CacheMode, HFTarget
from evaluation.metrics import step_stats
from evaluation.prompts import (
    BUILTIN_WORKLOADS,
    Workload,
    load_conversations,
    parse_workload,
    render,
)
from evaluation.report import write_report
from evaluation.spec_decode import Drafter, Generation, Step, speculative_generate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class LosslessError(RuntimeError):
    """Speculative output differs from plain target greedy decoding."""


def load_drafter(draft: str | Path | Drafter, device: str, dtype: torch.dtype) -> Drafter:
    """An exported SGLang-layout directory (config.json + model.safetensors) or a drafter."""
    if isinstance(draft, (str, Path)):
        from specforge_dspark.model import DSparkDraft

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
) -> tuple[dict, list[Generation]]:
    """Decode the workload's prompts both ways; returns its statistics and generations.
    `logical_vocab`: the tokens the target emits (drafts at or above it are counted as
    padded-row drafts; None = not counted)."""
    G = int(drafter.config.block_size)
    gens: list[Generation] = []
    plain_s = 0.0
    conversations = load_conversations(workload, num_prompts)
    for conv in conversations:
        messages: list[dict] = []
        for turn, text in enumerate(conv.turns):
            messages.append({"role": "user", "content": text})
            ids = render(target.tokenizer, messages)
            t0 = time.perf_counter()
            ref = target.greedy(ids, max_new_tokens)
            plain_s += time.perf_counter() - t0
            gen = speculative_generate(target, drafter, ids, max_new_tokens, embed_fn, logits_fn)
            where = f"workload {workload.name} prompt {conv.index}"
            check_lossless(gen.tokens, ref, where + (f" turn {turn + 1}" if turn else ""))
            gens.append(gen)
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
    stats.update(lossless=True, prompts=len(conversations))
    stats.update(_speed(len(gens), tokens, plain_s, spec_s))
    log(
        f"{workload.name}: {len(gens)} generations, {tokens} tokens, {len(steps)} steps, "
        f"accept length {_fmt(stats['accept_length'])}, "
        f"padded drafts {_fmt(stats['padded_draft_rate'])}, lossless"
    )
    return stats, gens


def _pooled_speed(stats: Iterable[dict]) -> dict:
    stats = list(stats)
    return _speed(
        sum(s["generations"] for s in stats),
        sum(s["new_tokens"] for s in stats),
        sum(s["seconds_plain"] for s in stats),
        sum(s["seconds_spec"] for s in stats),
    )


def _speed(generations: int, tokens: int, plain_s: float, spec_s: float) -> dict:
    """Wall-clock figures of plain vs speculative decoding (reported, never asserted)."""
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
) -> dict:
    """Evaluate `draft` on `workloads` (built-in names or name=path:field); returns summary.

    `head` (with `.embed` and `.logits`, and `.logical_vocab` for `padded_draft_rate`)
    defaults to `load_frozen_head(target_path)`.
    """
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not workloads:
        raise ValueError("--workloads: give at least one workload")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    data = Path(data_dir) if data_dir is not None else None
    parsed = [parse_workload(spec, data) for spec in workloads]
    names = [w.name for w in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"--workloads: a workload name is given twice in {names}")
    if isinstance(draft, (str, Path)):  # an export made for another target: refuse it
        from specforge_dspark.export import check_conventions

        check_conventions(draft, target_path=target_path)
    drafter = load_drafter(draft, device, DTYPES[dtype])
    G = int(drafter.config.block_size)
    layer_ids = list(drafter.config.target_layer_ids)
    target = HFTarget.load(target_path, layer_ids, cache_mode, device, DTYPES[dtype])
    check_pair(drafter, target)
    if head is None:
        from specforge_dspark.frozen_head import load_frozen_head

        head = load_frozen_head(target_path, device=device, dtype=DTYPES[dtype])
    embed_fn, logits_fn = head_fns(head)
    logical_vocab = getattr(head, "logical_vocab", None)
    target.greedy(render(target.tokenizer, [{"role": "user", "content": "hi"}]), 2)  # warm-up

    per_workload: dict[str, dict] = {}
    all_steps: list[Step] = []
    for workload in parsed:
        stats, gens = run_workload(
            target,
            drafter,
            workload,
            num_prompts,
            max_new_tokens,
            embed_fn,
            logits_fn,
            log,
            logical_vocab=logical_vocab,
        )
        per_workload[workload.name] = stats
        all_steps.extend(s for g in gens for s in g.steps)

    overall = step_stats(all_steps, G, logical_vocab)  # pooled over verify steps
    overall["lossless"] = all(w["lossless"] for w in per_workload.values())
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
        "device": device,
        "dtype": dtype,
        "logical_vocab": logical_vocab,
        "workloads": per_workload,
        "overall": overall,
        "macro_accept_length": sum(lengths) / len(lengths) if lengths else None,
    }
    write_report(summary, Path(out_dir))
    log(f"overall accept length {_fmt(overall['accept_length'])} -> {out_dir}")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="hf target directory")
    ap.add_argument("--draft", required=True, help="exported drafter (config.json + safetensors)")
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
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
