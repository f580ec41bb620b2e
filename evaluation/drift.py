"""How far a second target drifts from a first (a quantized copy from its full-precision
original, or any pair a user has), and what that does to a drafter.

    python -m evaluation.drift --target A --target B [--draft EXPORT] --out DIR

Target against target: A's greedy answers to the prompts, read by both targets (teacher
forced): per workload the top-1 agreement (B's argmax is A's token) and the mean
KL(A || B) per answer token, over the rows both serve (the first `logical_vocab`).
Drafter (with --draft): accept length against each target by lossless greedy decoding,
per workload with 95% intervals, and B minus A on the same prompts with its paired
interval. Writes DIR/drift.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specforge_dspark.config.command_line import command_parser
from specforge_dspark.decoding.intervals import paired_difference
from specforge_dspark.engines.quant_targets import load_causal_lm


@torch.inference_mode()
def target_drift(a: str | Path, b: str | Path, workloads: list[str], num_prompts: int,
                 max_new_tokens: int) -> dict:  # fmt: skip
    """Per workload: {"tokens", "top1_agreement", "kl_a_b"} of B against A's answers."""
    from transformers import AutoTokenizer

    from evaluation.references import greedy_references
    from specforge_dspark.decoding.prompts import load_conversations, parse_workload, render
    from specforge_dspark.objective.frozen_head import load_frozen_head

    tok = AutoTokenizer.from_pretrained(a)
    models = [load_causal_lm(p, dtype=torch.float32).eval() for p in (a, b)]
    rows = load_frozen_head(a).logical_vocab
    refs = greedy_references(a, workloads, num_prompts, max_new_tokens)
    out = {}
    for spec in workloads:
        agree, kl, n = 0, 0.0, 0
        for conv in load_conversations(parse_workload(spec), num_prompts):
            messages = [{"role": "user", "content": conv.turns[0]}]
            ids = render(tok, messages)
            answer = list(refs[(tuple(ids), max_new_tokens)][0])
            if not answer:
                continue
            x = torch.tensor([ids + answer])
            la, lb = (m(input_ids=x).logits[0, len(ids) - 1 : -1, :rows].float() for m in models)
            pa, lpb = la.log_softmax(-1), lb.log_softmax(-1)
            agree += int((lb.argmax(-1) == torch.tensor(answer)).sum())
            kl += float((pa.exp() * (pa - lpb)).sum())
            n += len(answer)
        per = (agree / n, kl / n) if n else (None, None)
        out[parse_workload(spec).name] = {"tokens": n, "top1_agreement": per[0], "kl_a_b": per[1]}
    return out


def drafter_drift(draft: str, a: str, b: str, workloads: list[str], num_prompts: int,
                  max_new_tokens: int, out_dir: Path) -> dict:  # fmt: skip
    """Accept length of `draft` against each target, and B - A paired on the same prompts."""
    from evaluation.acceptance import evaluate
    from evaluation.metrics import prompt_units

    units, summary = {}, {}
    for name, target in (("a", a), ("b", b)):
        res = evaluate(target, draft, workloads, num_prompts, max_new_tokens, out_dir / name)
        summary[name] = {w: {k: v[k] for k in ("accept_length", "accept_length_ci", "lossless")}
                         for w, v in res["workloads"].items()}  # fmt: skip
        units[name] = prompt_units(out_dir / name)
    summary["b_minus_a"] = paired_difference(units["b"], units["a"])
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(
        "evaluation.drift",
        __doc__.split("\n\n")[0],
        "python -m evaluation.drift --target .cache/tiny_target --target "
        ".cache/tiny_target_nvfp4 --draft runs/demo/export/sglang --out runs/drift",
    )
    ap.add_argument("--target", action="append", required=True, help="twice: A, then B")
    ap.add_argument("--draft", help="an exported drafter to decode against both")
    ap.add_argument("--workloads", default="gsm8k,mt_bench")
    ap.add_argument("--num-prompts", type=int, default=8, help="per workload")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    if len(a.target) != 2:
        ap.error(f"--target: give exactly two (A then B), got {len(a.target)}")
    workloads = a.workloads.split(",")
    a.out.mkdir(parents=True, exist_ok=True)
    drift = target_drift(*a.target, workloads, a.num_prompts, a.max_new_tokens)
    report = {"a": a.target[0], "b": a.target[1], "num_prompts": a.num_prompts,
              "max_new_tokens": a.max_new_tokens, "targets": drift}  # fmt: skip
    if a.draft:
        report["drafter"] = drafter_drift(a.draft, *a.target, workloads, a.num_prompts,
                                          a.max_new_tokens, a.out)  # fmt: skip
    (a.out / "drift.json").write_text(json.dumps(report, indent=1))
    for w, r in report["targets"].items():
        print(f"{w}: top-1 agreement {r['top1_agreement']:.4f}, KL(A||B) {r['kl_a_b']:.5f} "
              f"nats/token over {r['tokens']} tokens")  # fmt: skip
    if a.draft:
        d = report["drafter"]["b_minus_a"]
        print(f"drafter accept length, B - A: {d['difference']:+.3f} {d['ci']}")
    print(f"wrote {a.out / 'drift.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
