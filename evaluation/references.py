"""Plain greedy references decoded once, in batches, for several drafters' lossless checks."""

from __future__ import annotations

from pathlib import Path

import torch

from specforge_dspark.decoding.hf_target import batched_greedy, eos_token_ids
from specforge_dspark.decoding.prompts import (
    answer_text,
    load_conversations,
    parse_workload,
    render,
)


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
    from transformers import AutoTokenizer

    from specforge_dspark.engines.quant_targets import load_causal_lm

    tok = AutoTokenizer.from_pretrained(target_path)
    model = load_causal_lm(target_path, dtype=torch.float32).eval()
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
                    history[i].append({"role": "assistant", "content": answer_text(tok, new, eos)})
    return out
