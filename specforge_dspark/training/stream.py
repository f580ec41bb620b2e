"""FeatureStream: frozen-target features for the trainer, prefetched, bounded, ordered.

    stream = FeatureStream(recipe, rank=rank, world_size=ws)   # starts the engine
    with stream:                                                 # waits until it is ready
        for feats in stream.iterate(batches):                    # lists of samples, in order
            ...feats.aux_hidden [B,S,m*H], feats.last_hidden [B,S,H]...
        stream.wait_seconds                                      # time blocked on features

With `stream.window` set (dist.sequence_parallel), each batch asks the engine for a
window of its positions only, the features then `[B, W, ...]` from position row0.

`target.prefetch` requests stay in flight; results come back in the order of `batches`
with their sample ids. Memory is bounded: prefetch + 1 shared-memory slots per rank
(in flight + the one the caller holds), reused round-robin, so a yielded batch's tensors
are valid until the iterator advances. A dead worker (`TargetLost`) or one that leaves a
request unanswered for `target.timeout_s` (TimeoutError) is restarted, when its engine
can (`restart()`: the hf worker; the sglang server, which the rank that started it starts
again while the others wait for it, engines/served.py), after
`target.restart_backoff_s * 2**(k-1)` seconds for the k-th restart in a row; the
requests in flight are then re-sent in their order, so
the caller sees the same batches in the same order, each once, and a deterministic
target recomputes the same features. Past `target.max_restarts` restarts in a row (with
no request answered in between), or for an engine that cannot restart, the error is
raised naming the worker (and the budget). While the stream is open, SIGTERM raises
SystemExit(143) in the main thread (SIGINT raises KeyboardInterrupt as usual), so `with`
unwinds and the engine is stopped cleanly.

`python -m specforge_dspark.cli.bench stream` measures the stream (bench/stream.py).
"""

from __future__ import annotations

import pkgutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from specforge_dspark.transport.features import (
    PaddedBatch,
    TargetFeatures,
    TargetGone,
    TargetLost,
    pad_batch,
)


class Engine(Protocol):
    """What a backend offers the stream (hf.HFEngine, sglang.SGLangEngine, offline...)."""

    name: str

    def wait_ready(self) -> None: ...

    def submit(self, seq: int, batch: PaddedBatch) -> None: ...

    def result(self, seq: int, batch: PaddedBatch, deadline: float) -> TargetFeatures: ...

    def close(self) -> None: ...


SERVED_ENGINES = {
    "sglang": "specforge_dspark.engines.sglang:SGLangEngine",
    "vllm": "specforge_dspark.engines.vllm:VLLMEngine",
}
"""Backends with a live server (engines/served.py): a new one is its module plus a line."""


def make_engine(recipe, rank: int, world_size: int, num_slots: int) -> Engine:
    """The backend named by `target.backend` (imported lazily: sglang needs extras)."""
    backend = recipe.target.backend
    if backend == "hf":
        from specforge_dspark.engines.hf import HFEngine
        from specforge_dspark.engines.tap import read_target_dims

        dims = read_target_dims(recipe.target.path, recipe.draft.target_layer_ids)
        return HFEngine(recipe, dims, rank, world_size, num_slots)
    if backend in SERVED_ENGINES:
        engine_cls = pkgutil.resolve_name(SERVED_ENGINES[backend])
        section = getattr(recipe.target, backend)
        if getattr(section, "urls", None) or getattr(section, "servers_per_node", 1) > 1:
            from specforge_dspark.engines.pool import ServerPool

            return ServerPool(engine_cls, recipe, rank, world_size, num_slots)
        return engine_cls(recipe, rank, world_size, num_slots)
    if backend == "offline":
        from specforge_dspark.engines.offline import OfflineEngine

        return OfflineEngine(recipe)
    raise ValueError(f"target.backend: unknown backend {backend!r}")


def _raise_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class FeatureStream:
    """Ordered, prefetching, bounded feature stream for one trainer rank."""

    def __init__(self, recipe, rank: int = 0, world_size: int = 1):
        self.prefetch = recipe.target.prefetch
        self.timeout_s = recipe.target.timeout_s
        self.max_restarts = recipe.target.max_restarts
        self.restart_backoff_s = recipe.target.restart_backoff_s
        self.rank = rank
        self.wait_seconds = 0.0
        """Cumulative seconds `iterate` blocked its caller waiting for features."""
        self.bytes_out = 0
        """Feature bytes (aux + last hidden) yielded so far."""
        self.restarts: list[dict[str, Any]] = []
        """One record per engine restart: why, backoff and restart seconds, re-sent count."""
        self._in_a_row = 0  # restarts since the last answered request
        self._seq = 0
        self._old_sigterm: Any = None
        self.engine = make_engine(recipe, rank, world_size, num_slots=self.prefetch + 1)
        self.window: Callable[[int], tuple[int, int]] | None = None
        """Padded length S -> the window of rows (lo, W) to ask the engine for
        (PaddedBatch.window; dist.sequence_parallel sets it, training/build.py); None:
        every row."""

    def __enter__(self) -> FeatureStream:
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                self._old_sigterm = signal.signal(signal.SIGTERM, _raise_sigterm)
        try:
            self.engine.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine and free the shared memory (idempotent)."""
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        self.engine.close()

    def iterate(self, batches: Iterable[list[Any]]) -> Iterator[TargetFeatures]:
        """Features for each batch of samples, in order, `prefetch` requests ahead."""
        source = iter(batches)
        pending: deque[tuple[int, PaddedBatch, float]] = deque()
        last_answer = time.monotonic()

        def top_up() -> None:
            while len(pending) < self.prefetch:
                samples = next(source, None)
                if samples is None:
                    return
                batch = pad_batch(list(samples))
                if self.window is not None:
                    batch.window = self.window(batch.shape[1])
                seq, self._seq = self._seq, self._seq + 1
                self.engine.submit(seq, batch)
                pending.append((seq, batch, time.monotonic()))

        top_up()
        while pending:
            seq, batch, submitted = pending[0]
            # Per-request clock: from when the engine could start on it.
            deadline = max(submitted, last_answer) + self.timeout_s
            t0 = time.monotonic()
            try:
                feats = self.engine.result(seq, batch, deadline)
            except (TargetLost, TimeoutError) as e:
                self._restart(e, pending)  # or raises
                last_answer = time.monotonic()
                self.wait_seconds += last_answer - t0
                continue
            pending.popleft()
            self._in_a_row = 0
            last_answer = time.monotonic()
            self.wait_seconds += last_answer - t0
            self.bytes_out += _nbytes(feats)
            top_up()  # reuses the slot of the batch the caller just released
            yield feats

    def _restart(self, error: Exception, pending: deque) -> None:
        """Restart the engine after `error` and re-send `pending` in order (each keeps its
        sequence number, hence its slot); raise the error once the budget is spent."""
        restart = getattr(self.engine, "restart", None)
        if restart is None:  # e.g. offline: nothing to restart
            raise error
        while True:
            if self._in_a_row >= self.max_restarts:
                budget = f"target.max_restarts={self.max_restarts}"
                raise type(error)(
                    f"{error} (gave up after {self._in_a_row} restart(s) in a row: {budget})"
                ) from error
            self._in_a_row += 1
            backoff = self.restart_backoff_s * 2 ** (self._in_a_row - 1)
            first_line = str(error).splitlines()[0]
            _say(
                f"[rank {self.rank}] {first_line}; restart {self._in_a_row} of at most "
                f"{self.max_restarts} in {backoff:g}s, then re-sending {len(pending)} request(s)"
            )
            time.sleep(backoff)
            t0 = time.monotonic()
            try:
                restart()
                for seq, batch, _ in pending:
                    self.engine.submit(seq, batch)
            except TargetGone:
                raise
            except (TargetLost, TimeoutError) as e:
                error = e
                continue
            now = time.monotonic()
            for i, (seq, batch, _) in enumerate(pending):
                pending[i] = (seq, batch, now)
            took = now - t0
            self.restarts.append(
                {
                    "error": first_line,
                    "backoff_s": backoff,
                    "restart_s": took,
                    "resent": len(pending),
                }
            )
            _say(f"[rank {self.rank}] restarted as {self.engine.name} in {took:.2f}s")
            return


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _nbytes(f: TargetFeatures) -> int:
    return sum(t.numel() * t.element_size() for t in (f.aux_hidden, f.last_hidden))
