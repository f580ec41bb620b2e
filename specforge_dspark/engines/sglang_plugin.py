"""SGLang plugin: captured hidden states go to the trainer by shared memory, not JSON.

Registered as entry point `specforge_dspark` in group `sglang.srt.plugins` (pyproject),
so every SGLang process calls `register()` at start-up (`sglang.srt.plugins.load_plugins`).
It wraps (HookType.AROUND) the scheduler's per-request prefill hidden-state handler,
`SchedulerBatchResultProcessor._append_prefill_hidden_states`. Upstream turns each
request's [S, m*H] aux hidden states into Python lists for the JSON reply (far too slow
for 4096 x 30720 floats). For a request whose rid starts with `RID_PREFIX` the wrapper
instead copies the aux rows (`logits_output.hidden_states`, the concatenated capture
of `--return-aux-hidden-state-layer-ids`) and the post-norm, pre-muP last hidden rows
(`logits_output.last_hidden_states`) into the trainer's slot named in the rid (a
/dev/shm path, or with `target.transport: mooncake` a slot on the trainer's host written
through Mooncake's Transfer Engine: slot_writer.SlotAccess), then marks the request's
ticket done, unless the rid's nonce is no longer the ticket's (a request the trainer
gave up on: slot_writer.py, tickets.py). Other requests are untouched. In a CPU-engine
server (SGLANG_USE_CPU_ENGINE=1), and only there, `register()` also installs the CPU
bridges of engines/cpu/.

Writers. Every attention-TP rank holds the same rows; each writes a share: whole requests,
request `rid` by rank `writer_rank(rid, attn_tp_size)` (with attention DP each DP group's
ranks share their own requests; with attention CP only CP rank 0 writes). Every chunk of
a request goes to the same rank, so a ticket has one writer. Ranks come from
`sglang.srt.runtime_context.get_parallel()`, published in every scheduler (its request
receiver reads them). In an SGLang process (`register()` ran) whose ranks cannot be read
no rank writes: each fails the ticket saying why (every rank writing the same rows would
race on the ticket). Outside SGLang (the hook called directly) the caller is the only
process and writes.

The copy stays on the scheduler's path, synchronous. SGLang streams a batch's replies in
the same call that runs our hook (managers/scheduler_components/batch_result_processor.py:
hook at 334, `output_streamer.stream_output` at 502), and the trainer reads the tickets
when the reply arrives (engines/served.py `result`): a copy that finished later would
need tickets polled and guarded against reuse of the slot. Nor would it gain GPU time:
with overlap off (engines/sglang.py OVERLAP) the next forward is launched only after we
return (managers/scheduler.py:2048-2049), a copy left on the forward stream runs before
that forward anyway, and on another stream the outputs (CUDA-graph buffers) may be
overwritten under it. What is kept short instead: a rank copies only its share, into a
mapping opened once and page-locked on CUDA (slot_writer.SLOTS), so the device-to-host copy
is one DMA into the slot at pinned bandwidth (docs/production.md, "Feature supply: cost model").

A prefill that SGLang splits into chunks (its chunk budget is per batch, so with many
requests in flight any sequence may be split) reaches the hook once per chunk: middle
chunks with `store=False` (upstream drops their rows), the last one with `store=True`.
We write every chunk's rows at their offset in the sequence (`req.extend_end -
extend_input_len`, the chunk's first position) and mark the ticket done once all rows
are there. A cached prefix has no hidden states, so our requests never reuse one: the
launcher passes `--disable-radix-cache` where the model allows it, and for models that
require the radix cache (Inkling asserts it, `models/inkling.py` ~975) a second hook,
on `Req._compute_max_prefix_len` (`managers/schedule_batch.py`, the cap on the prefix
a request may match), caps it at 0 for our requests only. The launcher also passes
`--disable-overlap-schedule` (engines/sglang.py, OVERLAP).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import zlib

import torch

from specforge_dspark.transport.slot_writer import fail, write_features

PLUGIN_NAME = "specforge_dspark"
RID_PREFIX = "sfdspark|"
APPEND_PREFILL = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._append_prefill_hidden_states"
)
MAX_PREFIX_LEN = "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len"
APPEND_PREFILL_PARAMS = (
    "self",
    "req",
    "logits_output",
    "hidden_state_offset",
    "capture_hidden_mode",
    "extend_input_len",
    "store",
)
"""The hooked method's parameters in sglang 0.5.23 (checked by tests/test_sglang_args.py)."""

_in_sglang = False  # register() ran: this is an SGLang process


def register() -> None:
    """Entry point: install the hook (SGLang applies it after all plugins loaded)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global _in_sglang
    if not _in_sglang:  # which environment serves: SGLang's own, not the trainer's
        version = importlib.metadata.version
        print(  # plugins load before SGLang configures logging: straight to the server log
            f"{PLUGIN_NAME} plugin loaded in {sys.prefix} (torch {torch.__version__}, "
            f"sglang {version('sglang')})",
            file=sys.stderr,
            flush=True,
        )
    _in_sglang = True
    HookRegistry.register(APPEND_PREFILL, append_prefill_hidden_states, HookType.AROUND)
    HookRegistry.register(MAX_PREFIX_LEN, max_prefix_len, HookType.AROUND)
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":  # only then: engines/cpu/README.md
        from specforge_dspark.engines.cpu import sglang as sglang_cpu

        sglang_cpu.register()


def max_prefix_len(original, self, input_len: int) -> int:
    """AROUND hook: a feature request matches no cached prefix (its every position must
    be prefilled to have hidden states); other requests keep SGLang's cap."""
    return 0 if parse_rid(self.rid) is not None else original(self, input_len)


def make_rid(nonce: int, ticket: int, location: str) -> str:
    """The rid of a feature request: its ticket's nonce (unique per request, and the
    writer's proof that the ticket is still this request's), index and slot (a /dev/shm
    path, or a Mooncake location: slot_writer.SlotAccess)."""
    return f"{RID_PREFIX}{nonce}|{ticket}|{location}"


def parse_rid(rid: object) -> tuple[int, str, int] | None:
    """(ticket index, slot location, nonce) for our requests, None for anyone else's."""
    if not isinstance(rid, str) or not rid.startswith(RID_PREFIX):
        return None
    _, nonce, ticket, path = rid.split("|", 3)
    return int(ticket), path, int(nonce)


def append_prefill_hidden_states(
    original,
    self,
    *,
    req,
    logits_output,
    hidden_state_offset,
    capture_hidden_mode,
    extend_input_len,
    store=True,
):
    """AROUND hook with the original's contract: returns the next row offset."""
    target = parse_rid(req.rid)
    if target is None:
        return original(
            self,
            req=req,
            logits_output=logits_output,
            hidden_state_offset=hidden_state_offset,
            capture_hidden_mode=capture_hidden_mode,
            extend_input_len=extend_input_len,
            store=store,
        )
    full = capture_hidden_mode.is_full()
    if not full and not capture_hidden_mode.is_last():
        raise ValueError(f"Unexpected hidden states capture mode: {capture_hidden_mode}")
    start = hidden_state_offset
    end = start + (extend_input_len if full else 1)
    middle_chunk = getattr(req, "inflight_middle_chunks", 0) > 0
    if not (store or middle_chunk):
        return end
    ticket, path, nonce = target
    try:
        mine = writes_here(req.rid)
    except RuntimeError as e:
        fail(path, ticket, nonce, str(e))
        return end
    if mine:
        if not full:
            fail(
                path,
                ticket,
                nonce,
                "server captured only the last position; start it with "
                "--enable-return-aux-hidden-states (return_hidden_states_mode full)",
            )
        else:
            last = logits_output.last_hidden_states
            write_features(
                path,
                ticket,
                nonce,
                chunk_start(req, extend_input_len),
                logits_output.hidden_states[start:end],
                None if last is None else last[start:end],
            )
    return end


def chunk_start(req, extend_input_len: int) -> int | None:
    """Position in its sequence of this forward's first row for `req`: SGLang extends
    fill ids [prefix_len, extend_end) in a round, so the chunk starts at
    extend_end - extend_input_len. None when the request does not say (then chunks are
    taken to arrive in order)."""
    extend_end = getattr(req, "extend_end", None)
    if isinstance(extend_end, int):
        return extend_end - extend_input_len
    return None


def writer_rank(rid: str, attn_tp_size: int) -> int:
    """The attention-TP rank that writes request `rid`. A hash of the rid, alike in every
    process (crc32; Python's `hash` is salted per process), not the ticket index: that is
    the sequence's place in its batch, always 0 at target.batch_size 1."""
    return zlib.crc32(rid.encode()) % attn_tp_size


def writes_here(rid: str) -> bool:
    """Whether this process writes request `rid` (module docstring, Writers); RuntimeError
    naming why when this SGLang process cannot read its ranks."""
    if not _in_sglang:
        return True
    why = "no TP rank wrote: the server cannot read its attention-TP rank"
    context = sys.modules.get("sglang.srt.runtime_context")
    if context is None:
        raise RuntimeError(f"{why} (sglang.srt.runtime_context is not loaded)")
    try:
        par = context.get_parallel()
        rank, size = par.attn_tp_rank, par.attn_tp_size
        cp_rank = getattr(par, "attn_cp_rank", 0)  # 0: an SGLang without attention CP
    except Exception as e:
        raise RuntimeError(f"{why} ({type(e).__name__}: {e})") from None
    return cp_rank == 0 and writer_rank(rid, size) == rank
