"""Served accept length during training (`train.served_eval`).

Every `train.eval_interval` steps and at the end, each rank decodes its share of a
fixed set of held-out prompts by real greedy speculative decoding (decoding/
spec_decode.py, one loop for either drafter kind: the hf target verifies the draft's
blocks, its output equals plain greedy) with the draft's current weights, and the ranks
pool committed tokens and verify steps. Logged as `eval/accept_length` beside the
teacher-forced `eval/tau` of the same step and their gap `eval/tau_minus_accept_length`.
Greedy decoding of fixed prompts from the same weights is deterministic, so a resumed
run logs the same values at the same steps (given an exact resume, checkpoint.py).

Bounded time: a rank starts no prompt after `max_seconds`; the prompts it skipped are
logged as `eval/served_skipped` (then the figure covers fewer prompts). `EvalPool`: one
drafter's evaluation during training (train.py), the eval split's eval/* beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specforge_dspark.training.data_order import eval_rows
from specforge_dspark.training.tracking import reduce_metrics


@dataclass
class ServedEval:
    target: object  # specforge_dspark.decoding.hf_target.HFTarget, loaded once per rank
    prompts: list[list[int]]  # this rank's share of the rendered prompts
    max_new_tokens: int
    max_seconds: float


def build_served_eval(recipe, rank: int, world: int, device: torch.device) -> ServedEval | None:
    """The target and this rank's prompts (prompt i goes to rank i % world); None if off."""
    se = recipe.train.served_eval
    if se.num_prompts == 0:
        return None
    from specforge_dspark.decoding.hf_target import HFTarget
    from specforge_dspark.decoding.prompts import load_conversations, parse_workload, render

    dtype = torch.bfloat16 if recipe.target.dtype == "bfloat16" else torch.float32
    layer_ids = list(recipe.draft.target_layer_ids)
    target = HFTarget.load(recipe.target.path, layer_ids, "crop", str(device), dtype)
    per = -(-se.num_prompts // len(se.workloads))  # ceil: the first workloads fill up
    convs = [c for w in se.workloads for c in load_conversations(parse_workload(w), per)]
    convs = convs[: se.num_prompts]
    mine = [
        render(target.tokenizer, [{"role": "user", "content": c.turns[0]}])
        for i, c in enumerate(convs)
        if i % world == rank
    ]
    return ServedEval(target, mine, se.max_new_tokens, se.max_seconds)


@torch.no_grad()
def served_accept_length(se: ServedEval, draft: torch.nn.Module, head, device) -> dict:
    """Pooled over the ranks (a collective when distributed): accept length and counts."""
    from specforge_dspark.decoding.spec_decode import speculative_generate

    was_training = draft.training
    draft.eval()
    committed = steps = prompts = skipped = 0
    t0 = time.perf_counter()
    try:
        for prompt in se.prompts:
            if time.perf_counter() - t0 > se.max_seconds:
                skipped += 1
                continue
            gen = speculative_generate(
                se.target, draft, prompt, se.max_new_tokens, head.embed, head.logits
            )
            committed += sum(s.committed for s in gen.steps)
            steps += len(gen.steps)
            prompts += 1
    finally:
        draft.train(was_training)
    took = time.perf_counter() - t0
    counts = torch.tensor([committed, steps, prompts, skipped], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        counts = counts.to(device)
        dist.all_reduce(counts)
        counts = counts.cpu()
    committed, steps, prompts, skipped = counts.tolist()
    return {
        "accept_length": committed / steps if steps else float("nan"),
        "served_prompts": int(prompts),
        "served_skipped": int(skipped),
        "served_seconds": took,
    }


class EvalPool:
    """One drafter's teacher-forced eval batches until this rank's share is in, then one
    logged mean; the served accept length (train.served_eval) and the gap between the two."""

    def __init__(self, run, drafter):
        self.run, self.drafter, self.tracker = run, drafter, drafter.tracker
        self.expected = 0
        if run.recipe.train.eval_interval:
            self.expected = len(eval_rows(run.eval_set, run.data_rank, run.data_world))
        self.batches: list[dict] = []
        self.served_al: dict[int, float] = {}  # step -> served accept length, for the gap

    def add(self, metrics: dict, step: int) -> None:
        self.batches.append(metrics)
        if len(self.batches) < self.expected:
            return
        tf = reduce_metrics(self.batches)
        logged = {f"eval/{k}": v for k, v in tf.items()}
        if step in self.served_al and "tau" in tf:  # teacher-forced minus served
            logged["eval/tau_minus_accept_length"] = tf["tau"] - self.served_al[step]
        self.tracker.log(step, logged)
        self.batches = []

    def served(self, served, step: int) -> None:
        run, d = self.run, self.drafter
        res = served_accept_length(served, d.engine.module, run.head, run.device)
        self.served_al[step] = res["accept_length"]
        self.tracker.log(step, {f"eval/{k}": v for k, v in res.items()})
        who = f"[{d.name}] " if d.name else ""
        self.tracker.write(
            f"{who}step {step}: served accept length {res['accept_length']:.3f} "
            f"({res['served_prompts']} prompts, {res['served_seconds']:.1f} s)"
        )
