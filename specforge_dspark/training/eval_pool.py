"""Evaluation during training, per drafter (train.py): the teacher-forced metrics of the
eval split (eval/*), the served accept length (train.served_eval) and the gap between them."""

from __future__ import annotations

from specforge_dspark.training.data_order import eval_rows
from specforge_dspark.training.served_eval import served_accept_length
from specforge_dspark.training.tracking import reduce_metrics


class EvalPool:
    """One drafter's teacher-forced eval batches until this rank's share is in, then one
    logged mean; the served accept length (train.served_eval) and the gap between the two."""

    def __init__(self, run, drafter):
        self.run, self.drafter, self.tracker = run, drafter, drafter.tracker
        self.expected = 0
        if run.recipe.train.eval_interval:
            self.expected = len(eval_rows(run.eval_set, run.rank, run.world))
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
