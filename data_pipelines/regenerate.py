"""On-policy regeneration: the target answers the training prompts itself.

    python -m data_pipelines.regenerate --recipe R --input FILE --out FILE
        [--backend hf|openai|sglang] [--url URL] [--concurrency N] [--batch-size N]
        [--max-new-tokens N] [--temperature T] [--top-p P] [--chat-template-kwargs JSON]
        [--answers-per-prompt N --opening-tokens K [--opening-temperature T]]
        [--errors FILE] [--retry-errors] [key.sub=value ...]

Backends (backends.py): hf generates in this process; openai asks a chat server; sglang
sends token ids to an SGLang server's /generate, so that an answer opened by sampled
tokens continues from exactly those tokens. Input rows are read like `prepare` reads
them (sharegpt, messages, pairs, or MT-Bench style `{"turns": [str, ...]}`); only the
system and user turns are kept (regen_jobs.py). The user turns are answered in order,
each conditioned on the target's own earlier answers. Output rows (OpenAI messages, ready
for `prepare`): `{"id", "source", "messages", "finish_reasons"}` with any reasoning in the
assistant turns' `reasoning_content`. The row id is the input's `id` field, else
"file:row"; with `--answers-per-prompt N` the further answers to a row are rows "<id>#1" ..
"<id>#N-1" (input ids containing "#" are then refused before anything is generated), each
answer of which opens with K tokens sampled at the opening temperature and continues as
configured (greedy by default: the target's own greedy trajectories from N-1 more starting
points). Output is exactly-once and resumable (see journal.py): rerun the same command
after a crash or kill to finish the job. Rows that cannot be done go to the errors file
with a reason; when many rows in a row fail for transient reasons (server down) the run
stops with exit status 1 instead of failing every row, and a rerun retries them. Defaults
come from the recipe's `data.regenerate` section; flags override them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from data_pipelines.backends import Answer, OpenAIBackend, RequestError, SGLangBackend
from data_pipelines.formats import FormatConfig, Message
from data_pipelines.ingest import batched, count_rows
from data_pipelines.journal import Journal
from data_pipelines.regen_jobs import Job, check_ids, jobs
from specforge_dspark.config.command_line import command_parser


class _Conversation:
    """One job being answered: the history sent to the target and the output row."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.rest = deque(job.prompts)
        self.history: list[Message] = []
        self.out: list[Message] = []
        self.finishes: list[str] = []
        self.error: RequestError | None = None

    def advance(self) -> bool:
        """Move prompts into the history up to the next user turn; True if one waits."""
        while self.rest and self.error is None:
            m = self.rest.popleft()
            self.history.append(m)
            self.out.append(m)
            if m["role"] == "user":
                return True
        return False

    def take(self, answer: Answer) -> None:
        """Append the target's answer; the history carries it without its reasoning, as a
        chat template shows earlier turns. RequestError if the answer is empty."""
        if not answer.content.strip():
            raise RequestError("empty_response", f"finish_reason {answer.finish_reason}")
        msg: Message = {"role": "assistant", "content": answer.content}
        if answer.reasoning_content:
            msg["reasoning_content"] = answer.reasoning_content
        self.history.append({"role": "assistant", "content": answer.content})
        self.out.append(msg)
        self.finishes.append(answer.finish_reason)

    def finish(self, journal: Journal) -> None:
        j = self.job
        if self.error is not None:
            e = self.error
            journal.error(j.id, j.source, e.reason, e.detail, e.transient)
        else:
            row = {"id": j.id, "source": j.source, "messages": self.out}
            journal.write({**row, "finish_reasons": self.finishes})


async def _converse(backend, job: Job, journal: Journal) -> RequestError | None:
    conv = _Conversation(job)
    try:
        while conv.advance():
            conv.take(await backend.answer(conv.history, job.opening))
    except RequestError as e:
        conv.error = e
    conv.finish(journal)
    return conv.error


class ServerDown(RuntimeError):
    """Too many rows in a row failed transiently: stop instead of failing every row."""


ABORT_STREAK = 16


async def run_served(todo: Iterator[Job], backend, journal: Journal, bar) -> None:
    """Conversations in parallel on a server backend (openai or sglang; at most
    rc.concurrency requests in flight), each row written the moment it finishes, in
    whatever order that is."""
    rc = backend.rc
    async with backend:
        queue: asyncio.Queue = asyncio.Queue(rc.concurrency * 2)

        async def feed() -> None:
            for job in todo:
                await queue.put(job)
            for _ in range(rc.concurrency):
                await queue.put(None)

        streak = [0]  # consecutive rows lost to transient failures

        async def work() -> None:
            while (job := await queue.get()) is not None:
                error = await _converse(backend, job, journal)
                streak[0] = streak[0] + 1 if error is not None and error.transient else 0
                if streak[0] >= max(ABORT_STREAK, 2 * rc.concurrency):
                    raise ServerDown(f"{streak[0]} rows in a row failed: {error}")
                bar.update(1)
                bar.set_postfix(errors=journal.errors, refresh=False)

        await asyncio.gather(feed(), *(work() for _ in range(rc.concurrency)))


def run_hf(todo: Iterator[Job], backend, batch_size: int, journal: Journal, bar) -> None:
    """Batches of conversations, turn by turn: turn t of every conversation in the batch
    that has one is generated in one `generate` call."""
    streak = 0  # consecutive batches whose generate raised
    for batch in batched(todo, batch_size):
        convs = [_Conversation(j) for j in batch]
        while asking := [c for c in convs if c.advance()]:
            try:
                answers = backend.answer_batch(
                    [c.history for c in asking], [c.job.opening for c in asking]
                )
            except Exception as e:  # fails these rows (retried on resume), not the run...
                for c in asking:
                    c.error = RequestError("generate_failed", f"{type(e).__name__}: {e}")
                streak += 1
                if streak >= 3:  # ...unless generation is broken altogether
                    raise ServerDown(f"generate failed {streak} times in a row: {e}") from e
                continue
            streak = 0
            for c, answer in zip(asking, answers, strict=True):
                try:
                    c.take(answer)
                except RequestError as e:
                    c.error = e
        for c in convs:
            c.finish(journal)
        bar.update(len(batch))
        bar.set_postfix(errors=journal.errors, refresh=False)


def _total(files: list[str], max_rows: int, samples: int) -> int | None:
    counts = [count_rows(f) for f in files]
    if any(c is None for c in counts):
        return None
    return samples * sum(min(c, max_rows) if max_rows else c for c in counts)


SERVED = {"openai": OpenAIBackend, "sglang": SGLangBackend}
"""Server backends by data.regenerate.backend (the hf backend generates in this process)."""


def _check(rc, target_path: str, files: list[str]) -> str | None:
    """The first problem with the settings, naming the flag / recipe key, or None."""
    if not files:
        return "no input: pass --input or set data.train_files"
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        return f"input file not found: {missing[0]}"
    if rc.concurrency < 1 or rc.batch_size < 1:
        return "--concurrency / --batch-size (data.regenerate.*) must be >= 1"
    if rc.backend in SERVED and not rc.url:
        return f"--url (data.regenerate.url) is needed for the {rc.backend} backend"
    if rc.backend != "openai" and not target_path:
        return f"target.path is needed for the {rc.backend} backend (its tokenizer)"
    if rc.samples < 1 or rc.opening_tokens < 0:
        return "--answers-per-prompt must be >= 1 and --opening-tokens >= 0 (data.regenerate.*)"
    if rc.samples > 1 and rc.opening_tokens == 0 and rc.temperature == 0:
        return (
            "--answers-per-prompt > 1 at temperature 0 without --opening-tokens repeats the "
            "first answer; set --opening-tokens (or --temperature)"
        )
    if rc.opening_tokens and not 0 < rc.opening_tokens < rc.max_new_tokens:
        return "--opening-tokens must be below --max-new-tokens"
    if rc.opening_tokens and rc.opening_temperature <= 0:
        return "--opening-temperature must be > 0"
    if rc.opening_tokens and rc.samples > 1 and rc.backend == "openai":
        return (
            "--opening-tokens needs the hf or sglang backend: a chat server cannot continue a "
            "partial answer token-exactly (use --temperature for several answers there)"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    from specforge_dspark.config.recipe import RecipeError, load_recipe

    ap = command_parser(
        "data_pipelines.regenerate",
        __doc__.split("\n\n")[0],
        (
            "python -m data_pipelines.regenerate --recipe recipes/tiny_cpu.yaml "
            "--input ../shared/data/train/gsm8k_train.jsonl --out runs/regen/gsm8k.jsonl "
            "--backend hf --max-rows 100"
        ),
    )
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--input", nargs="+", help="input files (default: data.train_files)")
    ap.add_argument("--out", required=True, type=Path, help="output jsonl (appended, resumable)")
    ap.add_argument("--errors", type=Path, help="errors jsonl (default: <out>.errors.jsonl)")
    ap.add_argument("--retry-errors", action="store_true", help="redo rows that failed before")
    ap.add_argument("--format", choices=["auto", "sharegpt", "messages", "pairs"])
    ap.add_argument("--backend", choices=["hf", "openai", "sglang"])
    ap.add_argument("--url")
    ap.add_argument("--model")
    ap.add_argument("--concurrency", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-p", type=float)
    ap.add_argument(
        "--answers-per-prompt", type=int, dest="samples", help="(data.regenerate.samples; 1)"
    )
    ap.add_argument("--opening-tokens", type=int, help="sampled tokens opening answers 2..N")
    ap.add_argument("--opening-temperature", type=float, help="their temperature (1.0)")
    ap.add_argument("--chat-template-kwargs", type=json.loads, help='JSON, e.g. {"x": 1}')
    ap.add_argument("--timeout", type=float, dest="request_timeout_s")
    ap.add_argument("--retries", type=int, default=3, help="per request (server backends)")
    ap.add_argument("--max-rows", type=int, help="rows per file (default: data.max_rows)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, key.sub=value")
    a = ap.parse_args(argv)
    try:
        recipe = load_recipe(a.recipe, a.overrides, required={})  # its sections: target, data
    except RecipeError as e:
        print(f"regenerate: {e}", file=sys.stderr)
        return 2
    names = [f.name for f in dataclasses.fields(recipe.data.regenerate)]
    rc = dataclasses.replace(
        recipe.data.regenerate, **{k: v for k, v in vars(a).items() if k in names and v is not None}
    )
    d = recipe.data
    files = a.input or d.train_files
    problem = _check(rc, recipe.target.path, files)
    max_rows = d.max_rows if a.max_rows is None else a.max_rows
    problem = problem or check_ids(files, max_rows, rc.samples)
    if problem:
        print(f"regenerate: {problem}", file=sys.stderr)
        return 2
    cfg = FormatConfig(a.format or d.format, d.prompt_field, d.response_field, d.system_prompt)
    errors = a.errors or a.out.with_name(a.out.name.removesuffix(".jsonl") + ".errors.jsonl")
    journal = Journal(a.out, errors, a.retry_errors)
    total = _total(files, max_rows, rc.samples)
    skip = len(journal.done) + len(journal.failed)
    bar = tqdm(total=total, initial=min(skip, total or skip), unit="row", disable=a.quiet)
    status = 0
    try:
        todo = jobs(files, cfg, journal, max_rows, rc)
        if rc.backend in SERVED:
            backend = SERVED[rc.backend](rc, a.retries, recipe.target.path)
            asyncio.run(run_served(todo, backend, journal, bar))
        else:
            from data_pipelines.backends import HFBackend

            backend = HFBackend(recipe.target.path, rc, recipe.target.device)
            t0 = time.perf_counter()
            try:
                run_hf(todo, backend, rc.batch_size, journal, bar)
            finally:
                took = time.perf_counter() - t0
                speed = f"{backend.generated_tokens / took:.0f}" if took > 0 else "n/a"
                print(
                    f"regenerate: generated {backend.generated_tokens} tokens in {took:.1f} s "
                    f"({speed} tokens/s, batch size {rc.batch_size})"
                )
    except ServerDown as e:
        print(f"regenerate: stopped, {e}; fix the server and rerun to resume", file=sys.stderr)
        status = 1
    finally:
        bar.close()
        journal.close()
    print(
        f"regenerate: {journal.written} rows written this run ({len(journal.done)} in all) "
        f"-> {a.out}; {journal.errors} errors this run ({len(journal.failed)} in all) -> {errors}"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
