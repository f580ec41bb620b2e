"""The `hf` backend: a transformers target in a worker process next to each trainer rank.

`HFTarget` is the model (usable in-process, e.g. by tests and `capture`); `HFEngine` is
the trainer side: it spawns `worker_main` in its own process (named `hf-target-rank<r>` in
ps/top), sends it `(seq, slot, lengths)` messages over a pipe, and the worker writes the
features straight into the slot's shared memory, ragged like every engine's (shm.py). Only
a few ints cross the pipe (and the token ids of a request for a window of rows,
PaddedBatch.window: the slot then has room for those rows only). A dead worker raises
`TargetLost`, a silent one TimeoutError; `restart()` replaces it (the stream re-sends what
was in flight, see stream.py).

Legend: B batch, S padded length, T = sum of the B lengths, H hidden size, m aux layers,
D = m*H.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import time
import traceback
from typing import Any

import torch

from specforge_dspark.engines.tap import AuxTap, TargetDims
from specforge_dspark.transport.features import (
    DTYPES,
    PaddedBatch,
    TargetFeatures,
    TargetLost,
    window_rows,
)
from specforge_dspark.transport.ragged import pad_rows, starts
from specforge_dspark.transport.slot_budget import job_id, make_slots, sweep_stale_slots
from specforge_dspark.transport.slot_writer import SlotMaps

POLL_S = 0.1
"""How often a waiting trainer checks that its worker is still alive."""
STARTUP_TIMEOUT_S = 600.0
"""Longest a worker may take to import transformers and load the target."""
REPLAY_FEATURES = False
"""Benchmark only (`bench stream` sets it around the streams it times, never the trainer):
after the first forward of a shape, the worker re-writes those features, transport only."""


class HFTarget:
    """A frozen transformers causal LM that returns aux and post-norm hidden states.

    Aux layer k is SGLang's tap of decoder layer k (`AuxTap`, before the final norm:
    Inkling's excludes the layer's MLP short convolution, other targets' is
    `hidden_states[k+1]`); `last_hidden` is the decoder's `last_hidden_state`, i.e. after
    the final norm: the LM head's input before any muP logits division (Inkling divides
    in the head).
    """

    def __init__(self, path: str, dtype: str, device: str, layer_ids: list[int], chunk: int):
        from specforge_dspark.engines.quant_targets import load_causal_lm

        model = load_causal_lm(path, dtype=DTYPES[dtype])  # a quantized copy as served
        self.model = model.to(device).eval().requires_grad_(False)
        self.decoder = model.base_model  # the model without its LM head
        self.device = torch.device(device)
        self.layer_ids = list(layer_ids)
        self.tap = AuxTap(model, self.layer_ids)
        self.chunk = max(1, chunk)

    @torch.inference_mode()
    def forward_into(
        self,
        input_ids_BS: torch.Tensor,
        lengths_B: torch.Tensor,
        aux_TD: torch.Tensor,
        last_TH: torch.Tensor,
        window: tuple[int, int] | None = None,
    ) -> None:
        """Run the target on `input_ids_BS`, `chunk` sequences per forward, writing the
        features into the given (shared-memory) tensors, ragged: sequence b's rows at
        `ragged.starts(rows)[b]`, where rows are its lengths, or with a `window` (lo, W)
        the rows of positions [lo, lo + W) only (PaddedBatch.window_rows).

        Each chunk is cut to its own longest sequence, so with chunk 1 every sequence
        runs unpadded and its features do not depend on how the caller batched it
        (padding changes the kernels' shapes, hence the last bits)."""
        B = input_ids_BS.shape[0]
        lo_w, W = (0, input_ids_BS.shape[1]) if window is None else window
        offsets = starts(window_rows(lengths_B.tolist(), window))
        for lo in range(0, B, self.chunk):
            hi = min(B, lo + self.chunk)
            lens = lengths_B[lo:hi]
            Sc = int(lens.max())
            ids = input_ids_BS[lo:hi, :Sc].to(self.device)
            mask = None
            if bool((lens < Sc).any()):
                mask = (torch.arange(Sc)[None, :] < lens[:, None]).long().to(self.device)
            with self.tap:
                out = self.decoder(input_ids=ids, attention_mask=mask, use_cache=False)
            H = out.last_hidden_state.shape[-1]
            taps = self.tap.taps()
            for b, n in enumerate(lens.tolist()):
                o, a, z = offsets[lo + b], lo_w, max(lo_w, min(n, lo_w + W))  # positions [a, z)
                for i, tap_BSH in enumerate(taps):
                    aux_TD[o : o + z - a, i * H : (i + 1) * H].copy_(tap_BSH[b, a:z])
                last_TH[o : o + z - a].copy_(out.last_hidden_state[b, a:z])

    def forward(self, batch: PaddedBatch, hidden: int) -> TargetFeatures:
        """In-process convenience: features for `batch` in freshly allocated tensors."""
        lengths, S = batch.lengths.tolist(), batch.shape[1]
        dtype = next(self.model.parameters()).dtype
        aux = torch.empty(sum(lengths), hidden * len(self.layer_ids), dtype=dtype)
        last = torch.empty(sum(lengths), hidden, dtype=dtype)
        self.forward_into(batch.input_ids, batch.lengths, aux, last)
        aux, last = pad_rows(aux, lengths, S), pad_rows(last, lengths, S)
        return TargetFeatures(
            batch.sample_ids, batch.input_ids, batch.loss_mask, batch.lengths, aux, last
        )


def _set_process_name(name: str) -> None:
    """Linux: the name ps, top and psutil show (15 bytes at most); the cmdline is kept."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


def worker_main(conn, spec: dict[str, Any]) -> None:
    """Worker process: load the target, then serve `run` messages until `stop`/EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when we stop
    _set_process_name(spec.get("name", "hf-target"))
    torch.set_num_threads(spec["threads"])
    parent = os.getppid()
    try:
        target = HFTarget(
            spec["path"], spec["dtype"], spec["device"], spec["layer_ids"], spec["chunk"]
        )
    except BaseException:
        conn.send(("error", -1, traceback.format_exc()))
        return
    conn.send(("ready", -1, ""))
    slots = SlotMaps()
    replayed: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent:  # the trainer died without telling us
                return
            continue
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            return
        _, seq, _, path, S, lengths, window, ids_BS = msg
        try:
            t0 = time.perf_counter()
            v, key = slots.views(path, window_rows(lengths, window)), (tuple(lengths), window)
            if key in replayed:  # transport-only benchmark: write, don't compute
                v.aux.copy_(replayed[key][0])
                v.last.copy_(replayed[key][1])
            else:
                if ids_BS is None:  # the slot holds them (no window)
                    ids_BS = pad_rows(v.input_ids, lengths, S).clone()  # no view outlives v
                target.forward_into(ids_BS, torch.tensor(lengths), v.aux, v.last, window)
                if spec.get("replay"):
                    replayed[key] = (v.aux.clone(), v.last.clone())
            del v
            conn.send(("done", seq, f"{time.perf_counter() - t0:.6f}"))
        except Exception:
            conn.send(("error", seq, traceback.format_exc()))


def worker_threads(world_size: int) -> int:
    """CPU threads per worker: an even share of the cores among trainers and workers."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, (os.cpu_count() or 1) // (2 * max(1, local)))


def resolve_device(device: str, rank: int) -> str:
    """`cuda` means this rank's local GPU; anything else is used as given."""
    if device == "cuda":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    return device


class HFEngine:
    """Trainer side of one hf worker: slots, requests, answers, liveness, timeouts,
    restarts."""

    def __init__(self, recipe, dims: TargetDims, rank: int, world_size: int, num_slots: int):
        t = recipe.target
        spec = {
            "path": t.path,
            "dtype": t.dtype,
            "device": resolve_device(t.device, rank),
            "layer_ids": list(dims.layer_ids),
            "chunk": t.batch_size,
            "threads": worker_threads(world_size),
            "replay": REPLAY_FEATURES,
            "name": f"hf-target-rank{rank}",
        }
        self.rank, self.timeout_s, self._spec = rank, t.timeout_s, spec
        dtype = DTYPES[t.dtype]
        sweep_stale_slots(job_id(recipe))
        self.slots = make_slots(rank, num_slots, dims.aux_width, dims.hidden_size, dtype, recipe)
        self.forward_seconds = 0.0
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=worker_main, args=(child, self._spec), name=self._spec["name"], daemon=True
        )
        self.proc.start()
        child.close()
        self._ready = False

    def restart(self) -> None:
        """Replace the worker: kill it (a stopped one too), wait until it is gone, so it
        writes no slot again, then start a fresh one and wait until it is ready. Requests
        in flight are lost: the caller re-submits them."""
        self._stop_worker(grace_s=0.0)
        self._start()
        self.wait_ready()

    @property
    def name(self) -> str:
        return f"hf target worker for rank {self.rank} (pid {self.proc.pid})"

    def wait_ready(self) -> None:
        if not self._ready:
            kind, _, text = self._receive(time.monotonic() + STARTUP_TIMEOUT_S, "start-up")
            if kind != "ready":
                raise RuntimeError(f"{self.name} failed to load the target:\n{text}")
            self._ready = True

    def submit(self, seq: int, batch: PaddedBatch) -> None:
        """Send batch `seq` to the worker: its ids through the slot, or with a window (the
        slot then holds only the window's rows) through the pipe."""
        index = seq % len(self.slots)
        slot, lengths = self.slots[index], batch.lengths.tolist()
        views = slot.prepare(batch.window_rows())  # over the slot budget: ValueError
        ids = None
        if batch.window is None:
            views.put_ids(batch.input_ids)
        else:  # the slot has room for the window's rows only
            ids = batch.input_ids
        msg = ("run", seq, index, str(slot.path), batch.shape[1], lengths, batch.window, ids)
        try:
            self.conn.send(msg)
        except OSError:  # a dead worker (broken pipe): `result` raises TargetLost for it
            pass

    def result(self, seq: int, batch: PaddedBatch, deadline: float) -> TargetFeatures:
        self.wait_ready()
        what = f"batch {seq} (sample ids {batch.sample_ids})"
        kind, got, text = self._receive(deadline, what)
        while got < seq:  # answers to requests of an iteration the caller abandoned
            kind, got, text = self._receive(deadline, what)
        assert got == seq, f"one FIFO worker answers in order, got {got} for {seq}"
        if kind == "error":
            raise RuntimeError(f"{self.name} failed on {what}:\n{text}")
        self.forward_seconds += float(text)
        views = self.slots[seq % len(self.slots)].views(batch.window_rows())
        row0, rows = (None, batch.shape[1]) if batch.window is None else batch.window
        aux, last = views.padded(rows)
        return TargetFeatures(
            batch.sample_ids, batch.input_ids, batch.loss_mask, batch.lengths, aux, last, row0=row0
        )

    def _receive(self, deadline: float, what: str) -> tuple[str, int, str]:
        while True:
            try:
                if self.conn.poll(POLL_S):
                    return self.conn.recv()
            except (EOFError, OSError):  # the worker is gone: say so below
                self.proc.join(1.0)
            if not self.proc.is_alive():
                self.proc.join(1.0)
                raise TargetLost(
                    f"{self.name} died (exit code {self.proc.exitcode}) while the trainer "
                    f"waited for {what}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} did not answer {what} within target.timeout_s="
                    f"{self.timeout_s:g}s (stalled or overloaded worker)"
                )

    def close(self) -> None:
        self._stop_worker(grace_s=2.0)
        for slot in self.slots:
            slot.close()

    def _stop_worker(self, grace_s: float) -> None:
        if self.proc.is_alive() and grace_s > 0:
            try:
                self.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(grace_s)
        if self.proc.is_alive():
            self.proc.kill()  # also ends a stopped (SIGSTOP) worker
            self.proc.join(30.0)
        self.conn.close()
