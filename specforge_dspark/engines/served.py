"""The trainer side of a served engine (SGLang, vLLM, the next transport), for one rank.

Features come from a live server through the rank's slots (shm.py; in place, or through
Mooncake) and tickets (tickets.py). `ServedEngine` does what every such engine does the
same: the slots; the server the node's local rank 0 starts under a `server.ServerKeeper`
(log `<output_dir>/<engine>_server<i>_rank<r>.log`, pid in `..._rank<node>.pid` for the
node's other ranks, i > 0 only with target.<engine>.servers_per_node) or an attached one
(`target.<engine>.url`); readiness (the health URL, then one probe through the whole
path); tickets; the reply against the caller's deadline while watching the server; the
tickets' check; restarts. An engine module subclasses it with what only it knows: its
server's launch, how a batch becomes requests (`post`), what its rows still need (`finish`).

Restarts (`restart()`, called by the stream, which then re-sends what was in flight): a
hung server's group is killed (pid file), the starting rank's keeper starts it again on
the same port, every rank waits until it answers (startup_timeout_s); an attached server
is waited for, else the run stops with the error. No restarts: `restart = None`.

Lost (TargetLost: restart, or failover in a pool.py pool): no connection, its process
gone (exited; or its pid file names another pid, or its group has no live process), a
ticket its writer failed (tickets.WRITER_FAILED), no features by the deadline (at least
WRITE_GRACE_S after a reply); no reply by then is a TimeoutError, handled alike. A
refused request stops the run (RuntimeError); a server that never served once ends it
refused (TargetRefused). A slot whose request was given up is renewed before its next
request (`submit`): a late writer never touches what a later request reads.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch

from specforge_dspark.engines.api_key import read_key_file, section_key, started_key, write_key_file
from specforge_dspark.engines.reaper import server_gone
from specforge_dspark.engines.server import (
    EngineServer,
    ServerKeeper,
    group_running,
    http_ok,
    kill_group,
    pid_file_current,
    read_pid,
    say,
    tail,
)
from specforge_dspark.engines.tap import TargetDims, read_target_dims
from specforge_dspark.transport.features import (
    DTYPES,
    PaddedBatch,
    TargetFeatures,
    TargetGone,
    TargetLost,
    TargetRefused,
)
from specforge_dspark.transport.mooncake import Exposer
from specforge_dspark.transport.request import (
    LATE_HINT,
    check_reply,
    issue_tickets,
    reach_hint,
    slot_features,
    ticket_state,
)
from specforge_dspark.transport.shm import ShmSlot, SlotViews
from specforge_dspark.transport.slot_budget import job_id, make_slots, sweep_stale_slots, wire_dtype

POLL_S = 0.2  # how often a wait looks at the server and the tickets
HEALTH_POLL_S = 0.5
WRITE_GRACE_S = 30.0
"""After a reply, the writes get at least min(this, target.timeout_s) more (a reply just
before the deadline still leaves the writer rank time: under TP another rank writes)."""


class ServedEngine:
    """Trainer side of one served engine for one rank (module docstring)."""

    engine = ""
    """The engine's name: its server's name in messages, its recipe section target.<engine>."""
    health_path = ""
    """The server's health URL path: 200 once it serves."""
    no_features_hint = ""
    """What to check when the server answered but wrote nothing (after 'wrote no features')."""
    identity_path, identity_fields = "", ()
    """GET path whose JSON says what the server serves, and its fields that name the model
    (pool.py compares them across a pool's servers; "": the engine does not say)."""

    def __init__(
        self, recipe, rank: int, num_slots: int, restarts: bool, shared=None, index: int = 0
    ):
        """`shared`: another engine of this rank (pool.py) whose slots this one writes to;
        `index`: which of the node's started servers (target.<engine>.servers_per_node)."""
        t, section = recipe.target, getattr(recipe.target, self.engine)
        self.recipe, self.rank, self.timeout_s, self.index = recipe, rank, t.timeout_s, index
        self.startup_timeout_s = section.startup_timeout_s
        self.dims: TargetDims = read_target_dims(t.path, recipe.draft.target_layer_ids)
        self.url = (section.url or f"http://{section.host}:{section.port}").rstrip("/")
        self.dtype = DTYPES[t.dtype]
        self.owns_slots = shared is None
        if shared is None:
            sweep_stale_slots(job_id(recipe))
            dims, exposer = self.dims, Exposer.for_recipe(recipe, self.url)
            self.slots = make_slots(
                rank,
                num_slots,
                dims.aux_width,
                dims.hidden_size,
                wire_dtype(recipe),
                recipe,
                None,
                exposer,
            )
            self.slot_open = [False] * num_slots  # a request there not taken back
        else:
            self.slots, self.slot_open = shared.slots, shared.slot_open
        self.futures: dict[int, Future] = {}
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        out = Path(recipe.train.output_dir)
        node = rank - local_rank
        stem = f"{self.engine}_server{index or ''}"  # sglang_server, sglang_server1, ...
        self.pid_file = None if section.url else out / f"{stem}_rank{node}.pid"
        self.key_file = None if section.url else self.pid_file.with_suffix(".key")
        self.api_key = section_key(section, self.engine) if section.url else None
        """The key every request carries (api_key.py): an attached server's from the
        recipe; a started one's generated here, or read once the server answers."""
        self.restarts = restarts
        self.keeper: ServerKeeper | None = None
        self.log_path = None if section.url else out / f"{stem}_rank{node}.log"
        if self.pid_file is not None and local_rank == 0:
            self.api_key = started_key(section, self.engine)
            write_key_file(self.key_file, self.api_key)  # before the server and its pid file
            launch = lambda: self.launch(self.log_path)  # noqa: E731
            keeper = (launch, self.pid_file, self.healthy, recipe, rank, self.url, self.engine)
            self.keeper = ServerKeeper(*keeper)
        self._ready = False
        self._server_pid: int | None = None  # the server the requests in flight went to
        self._failure = ""  # the first line of the last failed request's error
        self._wrote = False  # whether this server ever wrote a request's features
        self._group_look_at = 0.0  # when _check_server next looks at the process group

    # ------------------------------------------------------------ what an engine adds

    def launch(self, log_path: Path) -> EngineServer:
        """Start this rank's server (local rank 0 of a node, when not attached)."""
        raise NotImplementedError

    def post(self, seq: int, slot: ShmSlot, batch: PaddedBatch) -> Future:
        """Send batch `seq`, whose tickets are in `slot`; the future holds the reply.
        Each sequence's request carries its ticket's nonce (`slot.read_ticket(b).nonce`)."""
        raise NotImplementedError

    def finish(self, views: SlotViews, b: int, rows: int) -> None:
        """Whatever sequence b's `rows` written rows (`views.rows(b)`) still need before
        training."""

    # ------------------------------------------------------------------ the server

    @property
    def server(self) -> EngineServer | None:
        """The server this rank started (None: another rank's, or attached)."""
        return self.keeper.server if self.keeper else None

    @property
    def name(self) -> str:
        pid = f" (pid {self.server.proc.pid})" if self.server else ""
        return f"{self.engine} server {self.url}{pid}"

    def healthy(self) -> bool:
        return http_ok(f"{self.url}{self.health_path}", self.api_key)

    def _current(self) -> bool:
        """Whether this node's server answers, started in this job (its pid file current);
        then a rank that did not start it learns its key (the key file is older)."""
        if not (pid_file_current(self.pid_file) and self.healthy()):
            return False
        if self.api_key is None and self.key_file is not None:
            self.api_key = read_key_file(self.key_file)
        return True

    def _current_pid(self) -> int | None:
        """The pid of this node's server now (None: attached, or not known yet)."""
        if self.server is not None:
            return self.server.proc.pid
        return read_pid(self.pid_file) if self.pid_file else None

    def _check_server(self, what: str) -> None:
        """TargetLost when the server the requests went to is gone: the one this rank
        started exited; or, from the pid file (every POLL_S), the node's server was
        replaced (another pid) or its process group is gone (a rank that did not start it;
        at the first start too, so it need not wait for startup_timeout_s)."""
        code = self.server.exit_code() if self.server else None
        if code is not None:
            raise TargetLost(
                f"{self.name} died (exit code {code}) during {what}; last log lines "
                f"({self.server.log_path}):\n{self.server.tail()}"
            )
        old, now = self._server_pid, time.monotonic()
        if self.pid_file is None or now < self._group_look_at:
            return
        self._group_look_at = now + POLL_S
        if old is None:  # the first start: another rank's server that exits fails it too
            pid = self._current_pid() if pid_file_current(self.pid_file) else None
            if self.server is None and pid is not None and not group_running(pid):
                raise TargetLost(f"{self.engine} server {self.url} (pid {pid}) exited in {what}")
            return
        gone = server_gone(self._current_pid(), old, self.server is None)
        if gone:
            raise TargetLost(f"{self.engine} server {self.url} (pid {old}) {gone} during {what}")

    def wait_ready(self) -> None:
        """Until the server answers its health URL, then one probe request through the
        whole path. TargetRefused when it never served once (a started server that exits
        or does not answer before its first answer; any server whose probe fails): a
        retry of the run would fail the same way."""
        if self._ready:
            return
        try:
            self._answer_probe()
        except (TargetLost, TimeoutError) as e:
            if self._wrote or (self.pid_file is None and not self._ready):
                raise  # it served before (a restart), or an attached server is not up yet
            why = str(e)
            if self.log_path and str(self.log_path) not in why:  # the log says why
                why += f"; last log lines ({self.log_path}):\n{tail(self.log_path)}"
            raise TargetRefused(
                f"{self.engine} server {self.url} never answered once, so a retry would fail "
                f"the same way (check target.{self.engine}.server_args, its memory, its "
                f"install): {why}"
            ) from e

    def _answer_probe(self) -> None:
        limit = self.startup_timeout_s
        deadline = time.monotonic() + limit
        while not self._current():
            if self.keeper is not None and self.keeper.gave_up:
                raise RuntimeError(self.keeper.gave_up)
            if self._server_pid is None:  # first start: a server that exits fails the run
                self._check_server("start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} not healthy within target.{self.engine}.startup_timeout_s="
                    f"{limit:g}s"
                )
            time.sleep(HEALTH_POLL_S)
        self._ready = True
        self._server_pid = self._current_pid()
        ids = torch.tensor([[1, 2]])
        probe = PaddedBatch([-1], ids, torch.ones_like(ids), torch.tensor([2]))
        self.submit(-1, probe)
        self.result(-1, probe, time.monotonic() + self.timeout_s)
        if self.keeper is not None and self.restarts:
            self.keeper.watch()

    def restart(self) -> None:
        """Bring the server back after a failed request; the caller re-sends what was in
        flight. A server still running is hung: kill its process group (unless it was
        replaced meanwhile); the keeper of the starting rank starts it again. Then wait
        until it answers (target.<engine>.startup_timeout_s)."""
        self.release()
        failure = self._failure
        try:
            self.wait_ready()
        except (TargetLost, TimeoutError):
            if self.pid_file is not None:
                raise  # the starting rank may still bring it back: the stream tries again
            key = f"target.{self.engine}"
            raise TargetGone(
                f"{failure} (attached server, {key}.url: the trainer does not restart it, "
                f"and it did not answer again within {key}.startup_timeout_s="
                f"{self.startup_timeout_s:g}s)"
            ) from None

    def release(self) -> None:
        """After a failed request: not ready until it answers again; a server still
        running is hung: kill its process group (unless it was replaced meanwhile), so
        that the keeper of the starting rank starts it again."""
        self._ready = False
        pid = self._current_pid()
        if pid is not None and pid == self._server_pid:
            if group_running(pid):
                say(
                    f"[rank {self.rank}] {self.engine} server {self.url} (pid {pid}) stopped "
                    f"answering (target.timeout_s={self.timeout_s:g}s); killing its process group"
                )
            kill_group(pid)

    def answering(self) -> bool:
        """After `release()`: whether the server answers again (its pid file current, its
        health URL 200); then it is ready, without the start-up probe (the same command
        came back: pool.py takes it back while other requests use the slots)."""
        if not self._current():
            return False
        self._ready, self._server_pid = True, self._current_pid()
        return True

    # ------------------------------------------------------------------ requests

    def submit(self, seq: int, batch: PaddedBatch) -> None:
        """Send batch `seq` through slot seq % slots. A slot whose last request was not
        taken back (the trainer gave up on it: a lost server, a re-send) is renewed first
        (shm.ShmSlot.prepare fresh): a late writer of that request reaches only the old
        file or registration, never this request's rows or tickets."""
        index = seq % len(self.slots)
        slot = self.slots[index]
        issue_tickets(slot, batch, fresh=self.slot_open[index])
        self.slot_open[index] = True
        self.futures[seq] = self.post(seq, slot, batch)

    def result(self, seq: int, batch: PaddedBatch, deadline: float) -> TargetFeatures:
        """Batch `seq`'s features: its reply by `deadline`, then its tickets (by the
        deadline, or WRITE_GRACE_S after a late reply). TargetLost (the server is lost:
        gone, its writer failed, no features) or TimeoutError (no reply) are the stream's
        to restart or fail over; RuntimeError when the server refused the request."""
        self.wait_ready()
        what = "the start-up probe" if seq < 0 else f"batch {seq} (sample ids {batch.sample_ids})"
        try:
            reply = self._wait_reply(self.futures.pop(seq), deadline, what)
            if self.keeper is not None:
                self.keeper.answered()
            check_reply(reply, self.name, what)
            slot = self.slots[seq % len(self.slots)]
            views = slot.views(batch.window_rows())
            deadline = max(deadline, time.monotonic() + min(self.timeout_s, WRITE_GRACE_S))
            # the reply is no proof of the write: under TP any rank may write, rank 0 replies
            for b, n in enumerate(batch.lengths.tolist()):
                self._wait_ticket(slot, b, n, deadline, f"{what}, sequence {b}")
                self.finish(views, b, views.lengths[b])
        except (TargetLost, TimeoutError) as e:
            self._failure = str(e).splitlines()[0]
            raise
        self._wrote, self.slot_open[seq % len(self.slots)] = True, False
        return slot_features(views, batch, self.dtype)

    def _wait_reply(self, fut: Future, deadline: float, what: str) -> Any:
        """The reply to one request; TargetLost when the server is gone, TimeoutError
        when it does not answer by `deadline`."""
        while True:
            try:
                return fut.result(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
            except FutureTimeout:
                self._check_server(f"the wait for {what}")
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{self.name} did not answer {what} within target.timeout_s="
                        f"{self.timeout_s:g}s (stalled or overloaded server)"
                    ) from None
            except TargetLost as e:  # no connection: the server is gone or going
                self._check_server(f"the wait for {what}")
                raise TargetLost(f"{self.name} failed on {what}: {e}") from None
            except RuntimeError as e:
                raise RuntimeError(f"{self.name} failed on {what}: {e}") from None

    def _wait_ticket(self, slot: ShmSlot, b: int, rows: int, deadline: float, what: str) -> None:
        """Until sequence b's ticket says all its `rows` positions are written (checked once when
        `deadline` has passed). TargetLost naming the server, the slot and the reason when
        the writer failed (tickets.WRITER_FAILED) or nothing came by the deadline;
        RuntimeError when the writer refused the request (its rows disagree with it)."""
        while True:
            state, error = ticket_state(slot, b, rows)
            if state == "done":
                return
            if state == "lost":
                raise TargetLost(
                    f"{self.name} could not write {what} into slot {slot.location}: {error}"
                )
            if state == "refused":
                raise RuntimeError(f"{self.name} could not capture {what}: {error}")
            self._check_server(f"the wait for {what}")
            if time.monotonic() >= deadline:
                # the install hint only while the server never wrote: later, a rank failed
                hint = self.no_features_hint if not self._wrote else LATE_HINT
                raise TargetLost(
                    f"{self.name} answered {what} but wrote no features into slot "
                    f"{slot.location} within target.timeout_s={self.timeout_s:g}s"
                    f"{hint}{reach_hint(slot)}"
                )
            time.sleep(0.005)

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.stop()
        for slot in self.slots if self.owns_slots else ():
            slot.close()
