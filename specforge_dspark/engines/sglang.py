"""The `sglang` backend: a live SGLang server for the target, features by shared memory.

The trainer's local rank 0 starts `python -m sglang.launch_server` with `launch_args`
(or every rank attaches to `target.sglang.url`). With `target.device: cpu` the server
runs SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`, `CPU_ENGINE_ARGS`, and the import
shims of cpu/shims/ on its PYTHONPATH); that is how CI and the embedded default run the
real server. Each batch becomes one `/generate`
request (max_new_tokens 1, return_hidden_states) whose rids name a shared-memory slot
and a ticket per sequence; our SGLang plugin (sglang_plugin.py, loaded in the server
through its entry point) writes the aux and last hidden states there instead of
returning JSON lists. The reply only says "done"; the tickets say what was written.

A dead or hung server comes back (`restart()`, called by the stream, which then re-sends
what was in flight). A rank stuck on a hung server kills it (its process group, pid from
`<output_dir>/sglang_server_rank<r>.pid`); the rank that started it starts it again on
the same port (sglang_keeper.py); every rank waits until it answers
(`target.sglang.startup_timeout_s`). Attached servers (`target.sglang.url`) are not ours:
the trainer waits for them to answer again, or stops with the error that ended the wait.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from specforge_dspark.engines.features import (
    DTYPES,
    PaddedBatch,
    TargetDims,
    TargetFeatures,
    TargetGone,
    TargetLost,
    check_layer_ids,
    post_json,
    read_target_dims,
)
from specforge_dspark.engines.inkling_layout import needs_radix_cache, sglang_layout
from specforge_dspark.engines.sglang_keeper import (
    ServerKeeper,
    engine_python,
    group_running,
    kill_group,
    read_pid,
    say,
)
from specforge_dspark.engines.sglang_plugin import PLUGIN_NAME, make_rid
from specforge_dspark.engines.shm import (
    DONE,
    DTYPE_CODES,
    FAILED,
    Ticket,
    make_slots,
    sweep_stale_slots,
)

RESERVED = {
    "model_path": "target.path",
    "host": "target.sglang.host",
    "port": "target.sglang.port",
    "enable_return_aux_hidden_states": "the backend (always on)",
    "speculative_algorithm": "the backend (DSPARK capture convention)",
    "return_aux_hidden_state_layer_ids": "draft.target_layer_ids",
    "disable_radix_cache": "the backend (cached prefixes have no hidden states: see the plugin)",
    "disable_overlap_schedule": "the backend (always on: see OVERLAP below)",
    "dtype": "target.dtype",
}
OVERLAP = """Overlap scheduling is always off: SGLang would process a batch's results after the
next batch launched, reading `last_hidden_states` from device memory it may reuse; a
prefill-only feature request gains nothing from overlap."""
CPU_ENGINE_ARGS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "disable_cuda_graph": True,
    "tp_size": 1,
    "max_total_tokens": 8192,
    "mem_fraction_static": 0.05,
    "skip_server_warmup": True,
    "sleep_on_idle": True,
}
"""Defaults for a CPU-engine server (`target.device: cpu`); `target.sglang.server_args`
overrides any of them."""
CPU_SHIMS = Path(__file__).resolve().parent / "cpu" / "shims"
LAUNCHER_VARS = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
}  # fmt: skip
POLL_S = 0.5


def launch_args(recipe) -> list[str]:
    """`sglang.launch_server` arguments for the recipe: capture flags + server_args."""
    t, s, d = recipe.target, recipe.target.sglang, recipe.draft
    check_layer_ids(d.target_layer_ids, d.num_target_layers)
    served = sglang_layout(t.path, log=lambda *a: None)  # a transformers Inkling: converted
    args = ["--model-path", str(served), "--host", s.host, "--port", str(s.port)]
    args += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "DSPARK"]
    args += ["--return-aux-hidden-state-layer-ids", *map(str, d.target_layer_ids)]
    if not needs_radix_cache(served):  # else our plugin keeps our requests off it
        args += ["--disable-radix-cache"]
    args += ["--disable-overlap-schedule", "--dtype", t.dtype]
    for key in s.server_args:
        if key in RESERVED:
            raise ValueError(
                f"target.sglang.server_args.{key} is set by {RESERVED[key]}; remove it"
            )
    cpu = cpu_engine_args(served) if is_cpu_engine(recipe) else {}
    for key, value in {**cpu, **s.server_args}.items():
        args += cli_flag(key, value)
    return args


def cpu_engine_args(model: str | Path) -> dict[str, Any]:
    """CPU_ENGINE_ARGS; for Inkling (its attention takes fa4 or triton only) triton, run by
    Triton's interpreter, no prefill graph (a CPU has no graph pool), and no tokenizer: its
    chat adapter refuses any but Inkling's o200k (cpu/sglang_inkling.py), and our requests
    carry input_ids."""
    if needs_radix_cache(model):
        return {
            **CPU_ENGINE_ARGS,
            "attention_backend": "triton",
            "disable_prefill_cuda_graph": True,
            "skip_tokenizer_init": True,
        }
    return dict(CPU_ENGINE_ARGS)


def is_cpu_engine(recipe) -> bool:
    return recipe.target.device == "cpu"  # SGLang's CPU engine


def server_env(
    cpu_engine: bool, base: dict[str, str] | None = None, interpret_triton: bool = False
) -> dict[str, str]:
    """The environment of a server we start: our plugin allowed, and for the CPU engine
    `SGLANG_USE_CPU_ENGINE=1` with the import shims first on PYTHONPATH (inherited by
    the scheduler and detokenizer processes it spawns). torchrun's variables are
    dropped: the server is one process group of its own, not a peer of the trainer."""
    env = dict(os.environ if base is None else base)
    for key in list(env):  # torchrun's rendezvous would make SGLang's own init wait for peers
        if key in LAUNCHER_VARS or key.startswith("TORCHELASTIC_"):
            del env[key]
    allowed = env.get("SGLANG_PLUGINS")
    if allowed and PLUGIN_NAME not in allowed.split(","):
        env["SGLANG_PLUGINS"] = f"{allowed},{PLUGIN_NAME}"
    if cpu_engine:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SHIMS), env.get("PYTHONPATH")) if p)
        if interpret_triton:  # Triton kernels (Inkling's) run in Triton's interpreter
            env["TRITON_INTERPRET"] = "1"
    return env


def cli_flag(key: str, value: Any) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, list | tuple):
        return [flag, *map(str, value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def validate_launch_args(args: list[str]) -> Any:
    """Run SGLang's own argument parsing and its model-independent resolution hooks
    (`prepare_server_args` + `ServerArgs.resolve_once`, which includes
    `handle_aux_hidden_state_capture`) on `args`; returns the resolved view. The model
    path is swapped for "dummy" so that the checks run without the weights (the server
    repeats all of them, model-dependent ones included, when it starts)."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    argv = list(args)
    argv[argv.index("--model-path") + 1] = "dummy"
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    return resolved_view(server_args)


def request_body(rids: list[str], input_ids: list[list[int]]) -> dict[str, Any]:
    """The `/generate` request for one batch: prefill only, hidden states requested."""
    return {
        "rid": rids,
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_hidden_states": True,
        "stream": False,
    }


class ServerProcess:
    """A `sglang.launch_server` child in its own process group, logging to a file."""

    def __init__(
        self,
        python: str,
        args: list[str],
        log_path: Path,
        cpu_engine: bool = False,
        key: str = "target.sglang.python",
    ):
        """`python`: the interpreter of SGLang's own environment (checked: sglang imports
        there and our plugin is registered there); `key` names where it came from."""
        exe = engine_python(python, key, "sglang", "sglang.srt.plugins")
        triton = "--attention-backend triton" in " ".join(args)
        env = server_env(cpu_engine, interpret_triton=cpu_engine and triton)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [exe, "-m", "sglang.launch_server", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, the whole process group; returns once it is gone."""
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.proc.pid)  # what the launcher left: scheduler, detokenizer


class SGLangEngine:
    """Trainer side of the sglang backend for one rank."""

    def __init__(self, recipe, rank: int, world_size: int, num_slots: int):
        t = recipe.target
        self.recipe, self.rank, self.timeout_s = recipe, rank, t.timeout_s
        self.dims: TargetDims = read_target_dims(t.path, recipe.draft.target_layer_ids)
        self.url = (t.sglang.url or f"http://{t.sglang.host}:{t.sglang.port}").rstrip("/")
        self.dtype = DTYPES[t.dtype]
        sweep_stale_slots()
        self.slots = make_slots(
            rank, num_slots, self.dims.aux_width, self.dims.hidden_size, self.dtype, recipe
        )
        self.futures: dict[int, Future] = {}
        self.slot_busy: list[Future | None] = [None] * num_slots
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        out = Path(recipe.train.output_dir)
        self.pid_file = None if t.sglang.url else out / f"sglang_server_rank{rank - local_rank}.pid"
        self.keeper: ServerKeeper | None = None
        if self.pid_file is not None and local_rank == 0:
            args, log = launch_args(recipe), out / f"sglang_server_rank{rank}.log"
            self.keeper = ServerKeeper(
                lambda: ServerProcess(t.sglang.python, args, log, is_cpu_engine(recipe)),
                self.pid_file,
                self._healthy,
                recipe,
                rank,
                self.url,
            )
        self._ready = False
        self._server_pid: int | None = None  # the server the requests in flight went to
        self._failure = ""  # the first line of the last failed request's error

    @property
    def server(self) -> ServerProcess | None:
        """The server this rank started (None: another rank's, or attached)."""
        return self.keeper.server if self.keeper else None

    @property
    def name(self) -> str:
        pid = f" (pid {self.server.proc.pid})" if self.server else ""
        return f"sglang server {self.url}{pid}"

    def _current_pid(self) -> int | None:
        """The pid of this node's server now (None: attached, or not known yet)."""
        if self.server is not None:
            return self.server.proc.pid
        return read_pid(self.pid_file) if self.pid_file else None

    # ------------------------------------------------------------------ start-up

    def wait_ready(self) -> None:
        if self._ready:
            return
        limit = self.recipe.target.sglang.startup_timeout_s
        deadline = time.monotonic() + limit
        while not self._healthy():
            if self.keeper is not None and self.keeper.gave_up:
                raise RuntimeError(self.keeper.gave_up)
            if self._server_pid is None:  # first start: a server that exits fails the run
                self._check_server("start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} not healthy within target.sglang.startup_timeout_s={limit:g}s"
                )
            time.sleep(POLL_S)
        self._ready = True
        self._server_pid = self._current_pid()
        probe = PaddedBatch([-1], *_probe_tensors())
        self.submit(-1, probe)
        self.result(-1, probe, time.monotonic() + self.timeout_s)
        if self.keeper is not None:
            self.keeper.watch()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health_generate", timeout=5.0) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _check_server(self, what: str) -> None:
        code = self.server.exit_code() if self.server else None
        if code is not None:
            raise TargetLost(
                f"{self.name} died (exit code {code}) during {what}; last log lines "
                f"({self.server.log_path}):\n{self.server.tail()}"
            )

    def restart(self) -> None:
        """Bring the server back after a failed request; the caller re-sends what was in
        flight. A server still running is hung: kill its process group (unless it was
        replaced meanwhile); the keeper of the starting rank starts it again. Then wait
        until it answers (target.sglang.startup_timeout_s)."""
        self._ready = False
        pid = self._current_pid()
        if pid is not None and pid == self._server_pid:
            if group_running(pid):
                say(
                    f"[rank {self.rank}] sglang server {self.url} (pid {pid}) stopped answering "
                    f"(target.timeout_s={self.timeout_s:g}s); killing its process group"
                )
            kill_group(pid)
        failure = self._failure
        try:
            self.wait_ready()
        except (TargetLost, TimeoutError):
            if self.pid_file is not None:
                raise  # the starting rank may still bring it back: the stream tries again
            limit = self.recipe.target.sglang.startup_timeout_s
            raise TargetGone(
                f"{failure} (attached server, target.sglang.url: the trainer does not restart "
                f"it, and it did not answer again within target.sglang.startup_timeout_s="
                f"{limit:g}s)"
            ) from None

    # ------------------------------------------------------------------ requests

    def submit(self, seq: int, batch: PaddedBatch) -> None:
        index = seq % len(self.slots)
        busy = self.slot_busy[index]
        if busy is not None:  # an abandoned request may still write here: let it finish
            try:
                busy.result(timeout=self.timeout_s)
            except Exception:
                pass
        slot = self.slots[index]
        B, S = batch.shape
        views = slot.prepare(B, S)
        lay = slot.layout
        item = views.aux_hidden.element_size()
        rids, ids = [], []
        for b in range(B):
            n = int(batch.lengths[b])
            slot.write_ticket(
                b,
                Ticket(
                    status=0,
                    rows=n,
                    written=0,
                    aux_off=lay.aux_off + b * S * lay.aux_width * item,
                    last_off=lay.last_off + b * S * lay.hidden * item,
                    aux_width=lay.aux_width,
                    hidden=lay.hidden,
                    dtype_code=DTYPE_CODES[self.dtype],
                ),
            )
            rids.append(make_rid(f"{seq}-{b}-{uuid.uuid4().hex[:8]}", b, str(slot.path)))
            ids.append(batch.input_ids[b, :n].tolist())
        fut: Future = Future()
        body = json.dumps(request_body(rids, ids)).encode()
        threading.Thread(
            target=post_json,
            args=(f"{self.url}/generate", body, self.timeout_s + 30.0, fut),
            daemon=True,
            name=f"sglang-req-{seq}",
        ).start()
        self.futures[seq] = fut
        self.slot_busy[index] = fut

    def result(self, seq: int, batch: PaddedBatch, deadline: float) -> TargetFeatures:
        self.wait_ready()
        what = "the start-up probe" if seq < 0 else f"batch {seq} (sample ids {batch.sample_ids})"
        try:
            reply = self._wait(self.futures.pop(seq), deadline, what)
        except (TargetLost, TimeoutError) as e:
            self._failure = str(e).splitlines()[0]
            raise
        if self.keeper is not None:
            self.keeper.answered()
        _check_reply(reply, self.name, what)
        slot = self.slots[seq % len(self.slots)]
        views = slot.prepare(*batch.shape)
        for b in range(batch.shape[0]):
            n = int(batch.lengths[b])
            _check_ticket(slot.read_ticket(b), n, self.name, f"{what}, sequence {b}")
            views.aux_hidden[b, n:] = 0
            views.last_hidden[b, n:] = 0
        return TargetFeatures(
            batch.sample_ids,
            batch.input_ids,
            batch.loss_mask,
            batch.lengths,
            views.aux_hidden,
            views.last_hidden,
        )

    def _wait(self, fut: Future, deadline: float, what: str) -> Any:
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

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.stop()
        for slot in self.slots:
            slot.close()


def _probe_tensors():
    import torch

    ids = torch.zeros(1, 2, dtype=torch.long)
    return ids, torch.zeros_like(ids), torch.tensor([2])


def _check_reply(reply: Any, name: str, what: str) -> None:
    outputs = reply if isinstance(reply, list) else [reply]
    for out in outputs:
        if not isinstance(out, dict) or "error" in out:
            raise RuntimeError(f"{name} refused {what}: {str(out)[:500]}")
        finish = (out.get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            raise RuntimeError(f"{name} aborted {what}: {finish.get('message')}")


def _check_ticket(t: Ticket | None, rows: int, name: str, what: str) -> None:
    if t is not None and t.status == DONE and t.written == rows:
        return
    if t is not None and t.status == FAILED:
        raise RuntimeError(f"{name} could not capture {what}: {t.error}")
    raise RuntimeError(
        f"{name} answered {what} but wrote no features: is specforge_dspark installed in "
        f"the server's environment (entry point sglang.srt.plugins:{PLUGIN_NAME}) and not "
        "excluded by SGLANG_PLUGINS?"
    )
