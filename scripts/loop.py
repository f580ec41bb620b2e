"""The closed loop on shifted traffic (`make loop`), SGLang as the judge, on this CPU with
the tiny Qwen3 target (SGLang's CPU engine serves it about 10x faster than the tiny Inkling
under Triton's interpreter, docs/engines.md):

1. base: a DSpark drafter trained on the target's own answers to GSM8K questions (the
   "original mix": what a user trained for before serving)
2. the loop: `python -m specforge_dspark.cli.loop` for ROUNDS rounds on traffic the base
   never saw (MT-Bench, HumanEval and MATH first turns): serve and record, mine, train
   `--steps` per round from the serving drafter, gate, swap. Meanwhile other users
   (`Users`) send a steady stream of GSM8K requests to the loop's serving address, through
   every swap: each counted (answered, failed, in flight across a swap) and each answer
   compared with the first one to the same prompt. With --position-weights the loop runs
   again from the same base, mining by acceptance per draft position (loop_positions)
3. control: the base trained the same number of steps on its original mix
4. judge: SGLang decodes the loop's held-out requests and GSM8K guard prompts with the base
   (no adaptation), the control and the loop's serving drafter(s): accept length with 95%
   intervals, each paired against the base, per draft position too, and whether every
   answer is the target's own

Writes runs/loop/summary.json (with its provenance), publishable with
`python -m evaluation.figures publish loop`. With `--engine vllm` (`make loop-vllm`) vLLM
serves, swaps each promoted drafter in place (loop.swap: reload) and judges:
runs/loop_vllm/summary.json, `publish loop_vllm`. With `--target smollm2` (`make loop
TARGET=smollm2`) the target is the real SmolLM2-135M-Instruct (recipes/smollm2_cpu.yaml)
with the smaller settings of TARGETS that fit this CPU: runs/loop_real, `publish loop_real`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import demo  # noqa: E402  (scripts/demo.py: prompt mixes and steps)
import quality  # noqa: E402  (scripts/quality.py: one cached training run per budget)

# per target: its recipe, where it writes, how many GSM8K questions it answers for the base
# (answer length), and the defaults of the command line that fit this 2-core CPU. SmolLM2
# (30 layers, 49152-row head) decodes ~8x slower than the tiny Qwen3 here: fewer and
# shorter requests, fewer steps, one loop (no mining-by-position variant).
TARGETS = {
    "tiny": {"recipe": "recipes/tiny_cpu_sglang.yaml", "out": "runs/loop", "original": 400,
             "answer_tokens": 128, "defaults": {}},
    "smollm2": {"recipe": "recipes/smollm2_cpu.yaml", "out": "runs/loop_real", "original": 200,
                "answer_tokens": 96, "defaults": {"requests": 48, "steps": 100,
                "base_steps": 300, "max_new_tokens": 48, "guard_prompts": 8,
                "position_weights": ""}},
}  # fmt: skip
RECIPE = TARGETS["tiny"]["recipe"]  # main() sets the target's
TRAIN = ("target.backend=hf", "train.preflight_samples=0", "tracking.enabled=false",
         "train.eval_interval=0", "export.formats=[sglang]",
         "train.epochs=1000")  # train.max_steps (the budget) decides  # fmt: skip
TRAFFIC = "[mt_bench,humaneval,math500]"


def original_answers(out: Path, rows: int, answer_tokens: int) -> Path:
    """The target's greedy answers to the first `rows` GSM8K training questions (messages
    rows), made once."""
    path = out / "original_mix_answers.jsonl"
    if (out / "original.done").is_file():
        return path
    mix = demo.prompt_mix(out / "original_mix.jsonl", (("train/gsm8k_train.jsonl", "question",
                                                         0, rows),))  # fmt: skip
    cmd = [sys.executable, "-m", "data_pipelines.regenerate", "--recipe", RECIPE,
           "--input", str(mix), "--format", "messages", "--out", str(path), "--backend", "hf",
           "--batch-size", "50", "--max-new-tokens", str(answer_tokens), "--quiet"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO)
    (out / "original.done").write_text("")
    return path


class Users:
    """Other users' requests through the loop's serving address (its front, found in
    <loop.dir>/front.json once the loop process `pid` wrote it) while the loop runs: one at
    a time, `pause_s` apart, each a GSM8K prompt of `prompts` in turn; not recorded by the
    loop. Counting starts at the first answer (before it the front has no server yet)."""

    def __init__(self, loop_dir: Path, pid: int, prompts: list, stop_ids: set[int], ask,
                 pause_s: float = 0.5) -> None:  # fmt: skip
        self.front_file, self.pid, self.prompts, self.ask = (
            loop_dir / "front.json",
            pid,
            prompts,
            ask,
        )
        self.stop_ids, self.pause_s = stop_ids, pause_s
        self.log: list[dict] = []  # {"t": [start, end], "prompt", "tokens" or "error"}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _url(self) -> str | None:
        try:
            front = json.loads(self.front_file.read_text())
        except (OSError, ValueError):
            return None
        return front["url"] if front["pid"] == self.pid else None

    def _run(self) -> None:
        url, i = None, 0
        while not self.stop.wait(self.pause_s):
            url = url or self._url()
            if url is None:
                continue
            t0, k = time.time(), i % len(self.prompts)
            try:
                tokens, _ = self.ask(url, self.prompts[k], 16, self.stop_ids)
                self.log.append({"t": [t0, time.time()], "prompt": k, "tokens": tokens})
            except OSError as e:
                if self.log:  # counted once the address has answered
                    self.log.append({"t": [t0, time.time()], "prompt": k, "error": repr(e)})
                continue
            i += 1

    def join(self) -> list[dict]:
        self.stop.set()
        self.thread.join()
        return self.log


def stream_figures(log: list[dict], rounds: list[dict]) -> dict:
    """The stream's counts against the rounds' swap phases (wall-clock windows): failed
    requests, those started during a swap and those in flight across one's start or end;
    failures after the last phase ended (the loop closing) are reported apart."""
    swaps = [r["windows"]["swap"] for r in rounds if "swap" in r.get("windows", {})]
    end = max((w[1] for r in rounds for w in r.get("windows", {}).values()), default=0.0)
    failed = [q for q in log if "error" in q]
    first: dict[int, list] = {}
    same = all(first.setdefault(q["prompt"], q["tokens"]) == q["tokens"] for q in log
               if "tokens" in q)  # fmt: skip
    return {
        "requests": len(log),
        "answered": len(log) - len(failed),
        "failed": sum(q["t"][0] <= end for q in failed),
        "failed_after_the_loop_ended": sum(q["t"][0] > end for q in failed),
        "started_during_a_swap": sum(any(a <= q["t"][0] <= b for a, b in swaps) for q in log),
        "in_flight_across_a_swap_edge": sum(
            any(q["t"][0] < edge < q["t"][1] for w in swaps for edge in w) for q in log
        ),
        "swaps": len(swaps),
        "same_answer_to_each_prompt": same,
        "errors": [q["error"] for q in failed][:5],
    }


def run_loop(out: Path, name: str, args: list[str], a, prompts, stop_ids, ask) -> dict:
    """`a.rounds` rounds of the loop in out/<name> (resumed where a kill left it) with the
    users' stream; the stream's figures (kept with the loop, for a rerun that has no
    rounds left to run)."""
    state, kept = out / name / "state.json", out / name / "stream.json"
    done = json.loads(state.read_text())["round"] if state.is_file() else 0
    if done >= a.rounds:
        return json.loads(kept.read_text()) if kept.is_file() else {}
    cmd = [sys.executable, "-m", "specforge_dspark.cli.loop", "--recipe", RECIPE,
           "--rounds", str(a.rounds - done), "--nproc", str(a.nproc), *args]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    users = Users(out / name, proc.pid, prompts, stop_ids, ask)
    code = proc.wait()
    log = users.join()
    if code != 0:
        raise SystemExit(f"the loop exited {code}")
    rounds = [
        json.loads(p.read_text()) for p in sorted((out / name / "rounds").glob("*/round.json"))
    ]
    figures = stream_figures(log, rounds)
    kept.write_text(json.dumps(figures, indent=1))
    return figures


def judge(loop, exports: dict[str, str], items) -> dict[str, dict]:
    """Each export served by the loop's engine in turn, every item decoded: name -> request ->
    figures."""
    out = {}
    for name, export in exports.items():
        served = loop.start(-1, export)
        try:
            out[name] = loop.decode(served.url, items)
        finally:
            served.proc.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("sglang", "vllm"), default="sglang",
                    help="the serving engine and judge (vllm: drafters swapped in place, "
                    "loop.swap: reload; results in runs/loop_vllm)")  # fmt: skip
    ap.add_argument("--target", choices=sorted(TARGETS), default="tiny",
                    help="smollm2: the real SmolLM2-135M-Instruct (make real-target)")  # fmt: skip
    ap.add_argument("--out", help="default runs/loop, with --engine vllm runs/loop_vllm, with "
                    "--target smollm2 runs/loop_real")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=96, help="served requests per round")
    ap.add_argument("--steps", type=int, default=150, help="training steps per round")
    ap.add_argument("--base-steps", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=64, help="answer budget of a request")
    ap.add_argument("--guard-prompts", type=int, default=16, help="GSM8K prompts at each gate")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--position-weights", default="1,0.5,0.25,0.125",
                    help="also run the loop mining by these weights per draft position "
                    "(loop.position_weights; '' for the plain loop alone)")  # fmt: skip
    ap.set_defaults(**TARGETS[ap.parse_known_args(argv)[0].target]["defaults"])
    a = ap.parse_args(argv)
    global RECIPE
    chosen = TARGETS[a.target]
    RECIPE = chosen["recipe"]
    os.chdir(REPO)
    t0 = time.time()
    from transformers import AutoTokenizer

    from evaluation.figures import provenance
    from specforge_dspark.config.recipe import load_recipe
    from specforge_dspark.decoding.intervals import bootstrap_ci, paired_difference
    from specforge_dspark.decoding.prompts import load_conversations, parse_workload, render
    from specforge_dspark.loop.gate import Lineage, positions
    from specforge_dspark.loop.round import Loop
    from specforge_dspark.loop.serve import ENGINES, stop_token_ids

    default_out = chosen["out"] if a.engine == "sglang" else f"{chosen['out']}_vllm"
    out = Path(a.out or default_out).resolve()
    train = TRAIN if a.engine == "sglang" else (*TRAIN, "export.formats=[sglang,speculators]")
    out.mkdir(parents=True, exist_ok=True)
    demo.step("1/4 the base drafter, trained on the target's answers to GSM8K questions")
    original = original_answers(out, chosen["original"], chosen["answer_tokens"])
    base = quality.train_budget(RECIPE, original, a.base_steps, out / "base", a.nproc, train)

    demo.step(f"2/4 {a.rounds} rounds of the loop on shifted traffic {TRAFFIC}")

    def loop_args(name: str) -> list[str]:
        return [
            "target.backend=hf", "train.preflight_samples=0", "tracking.enabled=false",
            f"train.output_dir={out / (name + '_runs')}", f"loop.dir={out / name}",
            f"loop.serve_from={base['export']}", f"loop.traffic={TRAFFIC}",
            f"loop.requests_per_round={a.requests}", f"loop.max_new_tokens={a.max_new_tokens}",
            f"loop.steps_per_round={a.steps}", f"loop.rows_per_round={a.requests}",
            "loop.replay_share=0.3", "loop.holdout_share=0.25", "loop.guard_workloads=[gsm8k]",
            f"loop.guard_prompts={a.guard_prompts}", f"checkpoint.save_interval={a.steps}",
            f"data.train_files=[{original}]", "data.format=messages",  # the replay: base's mix
            f"loop.engine={a.engine}", *(["loop.swap=reload"] if a.engine == "vllm" else []),
        ]  # fmt: skip

    recipe = load_recipe(RECIPE, loop_args("loop"))
    tokenizer = AutoTokenizer.from_pretrained(recipe.target.path)
    stop_ids = stop_token_ids(recipe.target.path, tokenizer)
    users = [
        render(tokenizer, [{"role": "user", "content": c.turns[0]}])
        for c in load_conversations(parse_workload("gsm8k"), 24)[16:]
    ]  # not the guard's
    variants = {"loop": loop_args("loop")}
    if a.position_weights:  # the same loop, mining by acceptance per draft position
        weights = f"loop.position_weights=[{a.position_weights}]"
        variants["loop_positions"] = [*loop_args("loop_positions"), weights]
    stream, loop_s = {}, {}
    for name, args in variants.items():
        t = time.time()
        stream[name] = run_loop(out, name, args, a, users, stop_ids, ENGINES[a.engine].ask)
        loop_s[name] = round(time.time() - t, 1)

    demo.step("3/4 control: the base trained as many steps on its original mix")
    from_base = (*train, f"draft.init_from={base['export']}")
    control = quality.train_budget(RECIPE, original, a.rounds * a.steps, out / "control", a.nproc,
                                   from_base)  # fmt: skip

    demo.step(f"4/4 {a.engine} decodes the held-out traffic and the guard prompts with each")
    loop = Loop(recipe, loop_args("loop"), a.nproc)
    items, _ = loop.gate_items()
    exports = {"base": base["export"], "control": control["export"]}
    for name in variants:
        exports[name] = Lineage(out / name / "lineage.json").serving()["export"]
    figs = judge(loop, exports, items)
    loop.close()

    def units(name: str, keys) -> dict:
        return {k: (figs[name][k]["completion_tokens"] - 1, max(figs[name][k]["verify_ct"], 1))
                for k in keys}  # fmt: skip

    groups = {"shifted traffic (held out)": [k for k in figs["base"] if not k.startswith("guard:")],
              "original: gsm8k": [k for k in figs["base"] if k.startswith("guard:")]}  # fmt: skip
    table = {}
    for group, keys in groups.items():
        row = {}
        for name in exports:
            u = units(name, keys)
            c, n = [v[0] for v in u.values()], [v[1] for v in u.values()]
            row[name] = {"accept_length": round(sum(c) / sum(n), 4), "ci": bootstrap_ci(c, n)}
            if name != "base":
                row[name]["minus_base"] = paired_difference(u, units("base", keys))
                row[name]["positions"] = positions(*({k: figs[d][k] for k in keys}
                                                     for d in ("base", name)))  # fmt: skip
        if "loop_positions" in row:  # the two ranks of mining, paired on the same requests
            row["loop_positions"]["minus_loop"] = paired_difference(
                units("loop_positions", keys), units("loop", keys)
            )
        table[group] = {"requests": len(keys), **row}
    lossless = all(figs[n][k]["tokens"] == figs["base"][k]["tokens"] for n in exports
                   for k, _ in items)  # fmt: skip

    def rounds_of(name: str) -> list[dict]:
        kept = sorted((out / name / "rounds").glob("*/round.json"),
                      key=lambda p: int(p.parent.name))  # fmt: skip
        return [{"round": r["round"], "seconds": r["seconds"], "promoted": r["gate"]["promote"],
                 "why": r["gate"]["why"], "mined": r["mine"]["mined"],
                 "replayed": r["mine"]["replayed"], "rank": r["mine"].get("rank"),
                 "front": r.get("front")}
                for r in (json.loads(p.read_text()) for p in kept)]  # fmt: skip

    summary = {
        "table": table,
        "lossless": lossless,
        "rounds": rounds_of("loop"),
        "variants": {
            n: {"rounds": rounds_of(n), "stream": stream[n], "seconds": loop_s[n]} for n in variants
        },  # fmt: skip
        "stream": stream["loop"],
        "serving_version": Lineage(out / "loop" / "lineage.json").serving()["version"],
        "settings": {
            "rounds": a.rounds,
            "requests_per_round": a.requests,
            "steps_per_round": a.steps,
            "base_steps": a.base_steps,
            "max_new_tokens": a.max_new_tokens,
            "guard_prompts": a.guard_prompts,
            "traffic": TRAFFIC,
            "target": a.target,
            "original_rows": chosen["original"],
            "recipe": RECIPE,
            "position_weights": a.position_weights,
            "engine": a.engine,
            "swap": "reload" if a.engine == "vllm" else "restart",
        },  # fmt: skip
        "loop_seconds": loop_s["loop"],
        "seconds": round(time.time() - t0, 1),
        "provenance": provenance(
            ["python", "scripts/loop.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for group, row in table.items():
        said = ", ".join(f"{n} {row[n]['accept_length']:.3f} {row[n]['ci']}" for n in exports)
        print(f"{group} ({row['requests']} requests): {said}")
    print(f"every answer the target's own: {lossless}; wrote {out / 'summary.json'} "
          f"({summary['seconds']:.0f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
