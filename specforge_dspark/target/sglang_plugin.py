"""SGLang plugin: captured hidden states go to the trainer by shared memory, not JSON.

Registered as entry point `specforge_dspark` in group `sglang.srt.plugins` (pyproject),
so every SGLang process calls `register()` at start-up (`sglang.srt.plugins.load_plugins`).
It wraps (HookType.AROUND) the scheduler's per-request prefill hidden-state handler,
`SchedulerBatchResultProcessor._append_prefill_hidden_states`. Upstream turns each
request's [S, m*H] aux hidden states into Python lists for the JSON reply (far too slow
for 4096 x 30720 floats). For a request whose rid starts with `RID_PREFIX` the wrapper
instead copies the aux rows (`logits_output.hidden_states`, the concatenated capture
of `--return-aux-hidden-state-layer-ids`) and the post-norm, pre-muP last hidden rows
(`logits_output.last_hidden_states`) into the trainer's shared-memory slot named in the
rid, then marks the request's ticket done (see shm.py). Other requests are untouched.
Only attention-TP rank 0 writes (all TP ranks hold the same rows).

The server must prefill each sequence in one piece: the trainer's launcher passes
`--disable-radix-cache` (a cached prefix has no hidden states) and the chunked-prefill
size must exceed the longest sequence; otherwise the ticket reports the problem.
"""

from __future__ import annotations

import logging
import sys

from specforge_dspark.target.shm import (
    CODE_DTYPES,
    DONE,
    FAILED,
    TICKET_SIZE,
    SlotLayout,
    Ticket,
    map_file,
    release,
    view,
)

logger = logging.getLogger(__name__)

PLUGIN_NAME = "specforge_dspark"
RID_PREFIX = "sfdspark|"
APPEND_PREFILL = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._append_prefill_hidden_states"
)
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


def register() -> None:
    """Entry point: install the hook (SGLang applies it after all plugins loaded)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(APPEND_PREFILL, append_prefill_hidden_states, HookType.AROUND)


def make_rid(nonce: str, ticket: int, path: str) -> str:
    return f"{RID_PREFIX}{nonce}|{ticket}|{path}"


def parse_rid(rid: object) -> tuple[int, str] | None:
    """(ticket index, slot path) for our requests, None for anyone else's."""
    if not isinstance(rid, str) or not rid.startswith(RID_PREFIX):
        return None
    _, _, ticket, path = rid.split("|", 3)
    return int(ticket), path


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
    if _is_writer_rank():
        ticket, path = target
        if not full:
            fail(
                path,
                ticket,
                "server captured only the last position; start it with "
                "--enable-return-aux-hidden-states (return_hidden_states_mode full)",
            )
        elif store:
            last = logits_output.last_hidden_states
            write_features(
                path,
                ticket,
                logits_output.hidden_states[start:end],
                None if last is None else last[start:end],
            )
        elif getattr(req, "inflight_middle_chunks", 0) > 0:
            fail(
                path,
                ticket,
                f"server split the sequence into prefill chunks "
                f"({extend_input_len} tokens in one); raise --chunked-prefill-size",
            )
    return end


def _is_writer_rank() -> bool:
    context = sys.modules.get("sglang.srt.runtime_context")  # loaded in any real server
    if context is None:
        return True
    try:
        return context.get_parallel().attn_tp_rank == 0
    except Exception:  # ranks not published (single process): we are the writer
        return True


def write_features(path: str, ticket: int, aux_ND, last_NH) -> None:
    """Copy one request's rows into its slot and mark the ticket; never raises (a
    failure is reported to the trainer through the ticket, the server keeps serving)."""
    buf = None
    try:
        buf = map_file(path)
        layout = SlotLayout.unpack(buf, path)
        off = layout.tickets_off + ticket * TICKET_SIZE
        t = Ticket.unpack(buf, off)
        if t is None:
            raise RuntimeError(f"no ticket {ticket} in {path}")
        rows = aux_ND.shape[0]
        problem = _check(t, aux_ND, last_NH)
        if problem:
            t.status, t.error = FAILED, problem
        else:
            dtype = CODE_DTYPES[t.dtype_code]
            view(buf, dtype, t.aux_off, (rows, t.aux_width)).copy_(aux_ND)
            view(buf, dtype, t.last_off, (rows, t.hidden)).copy_(last_NH)
            t.status, t.written = DONE, rows
        buf[off : off + TICKET_SIZE] = t.pack().ljust(TICKET_SIZE, b"\0")
    except Exception:
        logger.exception("specforge_dspark: could not hand features to %s", path)
    finally:
        release(buf)


def _check(t: Ticket, aux_ND, last_NH) -> str:
    rows = aux_ND.shape[0]
    if last_NH is None:
        return "server returned no last hidden states (--enable-return-aux-hidden-states off?)"
    if rows != t.rows:
        return (
            f"server prefilled {rows} of the {t.rows} tokens (prefix cache or chunked "
            "prefill: pass --disable-radix-cache, raise --chunked-prefill-size)"
        )
    if aux_ND.shape[-1] != t.aux_width or last_NH.shape[-1] != t.hidden:
        return (
            f"server captured aux width {aux_ND.shape[-1]} / hidden {last_NH.shape[-1]}, "
            f"trainer expects {t.aux_width} / {t.hidden} (layer ids or target differ)"
        )
    return ""


def fail(path: str, ticket: int, message: str) -> None:
    """Mark a ticket failed with `message` (best effort)."""
    buf = None
    try:
        buf = map_file(path)
        off = SlotLayout.unpack(buf, path).tickets_off + ticket * TICKET_SIZE
        t = Ticket.unpack(buf, off)
        if t is not None:
            t.status, t.error = FAILED, message
            buf[off : off + TICKET_SIZE] = t.pack().ljust(TICKET_SIZE, b"\0")
    except Exception:
        logger.exception("specforge_dspark: could not report to %s", path)
    finally:
        release(buf)
