"""Why a drafter's deep slots are never accepted: decoded drafts next to the target's own
greedy continuation, step by step (docs/engines.md, "The zero tail").

    python scripts/zero_tail.py --target .cache/tiny_qwen3 --draft RUN/export/sglang \
        [--workload gsm8k] [--num-prompts 12] [--max-new-tokens 64] [--show 6]

Prints, over every verify step of greedy speculative decoding (our harness, exactly what
SGLang and vLLM serve), how often draft slot k equals the target's greedy token k (without
and with the slots before it accepted), then the first steps that accepted a draft:
context, the drafts and the target's tokens, decoded.
"""

from __future__ import annotations

import argparse

import torch

from specforge_dspark.decoding.hf_target import HFTarget
from specforge_dspark.decoding.loading import head_fns, load_drafter
from specforge_dspark.decoding.prompts import load_conversations, parse_workload, render
from specforge_dspark.decoding.spec_decode import speculative_generate
from specforge_dspark.objective.frozen_head import load_frozen_head


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True, help="SGLang export of the drafter")
    ap.add_argument("--workload", default="gsm8k")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--show", type=int, default=6, help="steps printed as text")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    drafter = load_drafter(a.draft, "cpu", torch.float32)
    G = int(drafter.num_drafts)
    target = HFTarget.load(a.target, list(drafter.config.target_layer_ids), "crop", "cpu")
    embed_fn, logits_fn = head_fns(load_frozen_head(a.target))
    tok = target.tokenizer
    hits, accepted, steps, shown = [0] * G, [0] * G, 0, []
    for conv in load_conversations(parse_workload(a.workload), a.num_prompts):
        ids = render(tok, [{"role": "user", "content": conv.turns[0]}])
        gen = speculative_generate(target, drafter, ids, a.max_new_tokens, embed_fn, logits_fn)
        made = 1  # the prefill's token; a step's truth is the greedy output after it
        for s in gen.steps:
            truth = gen.tokens[made : made + len(s.drafts)]
            steps += 1
            for k, (d, t) in enumerate(zip(s.drafts, truth, strict=False)):
                hits[k] += d == t
                accepted[k] += s.accepted > k
            if s.accepted and len(shown) < a.show and len(truth) == G:
                context = tok.decode(gen.tokens[max(0, made - 12) : made])
                shown.append((context, s.drafts, truth, s.accepted))
            made += s.committed
    print(f"{steps} verify steps, block {G}")
    print(f"draft k == target's greedy token k, any step:      {hits}")
    print(f"accepted at slot k (all slots before it accepted): {accepted}")
    for context, drafts, truth, n in shown:
        print(f"...{context!r}")
        print(f"   drafts {[tok.decode([t]) for t in drafts]}")
        print(f"   target {[tok.decode([t]) for t in truth]}   accepted {n}")


if __name__ == "__main__":
    main()
