"""The `sglang` backend: a live SGLang server for the target, features by shared memory.

The trainer's local rank 0 starts `python -m sglang.launch_server` with `launch_args`
(or every rank attaches to `target.sglang.url`). With `target.device: cpu` the server
runs SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`, `CPU_ENGINE_ARGS`, and the import
shims of cpu/shims/ on its PYTHONPATH); that is how CI and the embedded default run the
real server. Each batch becomes one `/generate` request (max_new_tokens 1,
return_hidden_states) whose rids name a shared-memory slot and a ticket per sequence;
our SGLang plugin (sglang_plugin.py, loaded in the server through its entry point)
writes the aux and last hidden states there instead of returning JSON lists. The reply
only says "done"; the tickets say what was written.

What every served engine shares (readiness, replies, tickets, the keeper that restarts a
dead server, a hung server's process group killed by the rank that finds it) is
served.py and server.py; this module holds what only SGLang knows: its arguments, its
environment, its request. A dead or hung server comes back (`restart()`, served.py);
an attached one (`target.sglang.url`) is waited for, not restarted.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from specforge_dspark.engines.api_key import KEY_ENV
from specforge_dspark.engines.inkling_layout import needs_radix_cache, sglang_layout
from specforge_dspark.engines.launch import (
    cli_flag,
    cpu_thread_binding,
    engine_python,
    launch_env,
    prepend_path,
)
from specforge_dspark.engines.served import ServedEngine
from specforge_dspark.engines.server import EngineServer, post_json
from specforge_dspark.engines.sglang_plugin import PLUGIN_NAME, make_rid
from specforge_dspark.engines.tap import check_layer_ids
from specforge_dspark.transport import mooncake
from specforge_dspark.transport.features import PaddedBatch
from specforge_dspark.transport.shm import ShmSlot

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
    "api_key": "target.sglang.api_key_env (or a key generated per job: engines/api_key.py)",
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
    "max_mamba_cache_size": 256,
    "mem_fraction_static": 0.5,
    "skip_server_warmup": True,
    "sleep_on_idle": True,
}
"""Defaults for a CPU-engine server (`target.device: cpu`); `target.sglang.server_args`
overrides any of them. On a CPU SGLang sizes its pools from the host's free memory twice,
before and after loading weights (kv_cache_configurator `_profile_available_bytes`), and
keeps `mem_fraction_static` of the first as room for the difference: at 0.05 another process
taking 1 GB in between left no room ("Not enough GPU memory for hybrid ... state cache").
Half of it, with the KV pool capped by `max_total_tokens` and the Mamba pool fixed by
`max_mamba_cache_size` (ignored by models without one), sizes both the same on every run."""
CPU_SHIMS = Path(__file__).resolve().parent / "cpu" / "shims"
KEYED_LAUNCH = "specforge_dspark.engines.keyed_launch"


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
    cpu_engine: bool,
    base: dict[str, str] | None = None,
    interpret_triton: bool = False,
    ranks: int = 1,
    cores: list[int] | None = None,
) -> dict[str, str]:
    """The environment of a server we start (launch.launch_env): our plugin allowed, and
    for the CPU engine `SGLANG_USE_CPU_ENGINE=1` with the import shims first on PYTHONPATH
    (inherited by the scheduler and detokenizer processes it spawns). A GPU server gets
    neither: nothing of engines/cpu/ reaches it."""
    env = launch_env(base)
    allowed = env.get("SGLANG_PLUGINS")
    if allowed and PLUGIN_NAME not in allowed.split(","):
        env["SGLANG_PLUGINS"] = f"{allowed},{PLUGIN_NAME}"
    if cpu_engine:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        prepend_path(env, CPU_SHIMS)
        if interpret_triton:  # Triton kernels (Inkling's) run in Triton's interpreter
            env["TRITON_INTERPRET"] = "1"
        if THREADS_BIND not in env and (ranks > 1 or cores or "OMP_NUM_THREADS" in env):
            env[THREADS_BIND] = cpu_thread_binding(ranks, THREADS_BIND, env, cores)
    return env


def node_share(index: int, count: int) -> list[int]:
    """Server `index` of the `count` a node starts on the CPU engine: its contiguous share
    of this process's cores (shares overlap only where there are fewer cores than servers)."""
    cores = sorted(os.sched_getaffinity(0))
    if count > len(cores):
        return [cores[index % len(cores)]]
    size, extra = divmod(len(cores), count)
    start = index * size + min(index, extra)
    return cores[start : start + size + (index < extra)]


THREADS_BIND = "SGLANG_CPU_OMP_THREADS_BIND"
"""The cores of each CPU-engine rank, `a-b|c-d` (utils/numa_utils.py: without it SGLang
refuses more ranks than NUMA nodes, and one rank takes every core of its node)."""


def server_ranks(args: list[str]) -> int:
    """tp x dp x pp of `sglang.launch_server` arguments (each 1 unless given)."""
    ranks = 1
    for flag in ("--tp-size", "--tp", "--dp-size", "--dp", "--pp-size"):
        if flag in args:
            ranks *= int(args[args.index(flag) + 1])
    return ranks


def request_body(rids: list[str], input_ids: list[list[int]]) -> dict[str, Any]:
    """The `/generate` request for one batch: prefill only, hidden states requested."""
    return {
        "rid": rids,
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_hidden_states": True,
        "stream": False,
    }


class ServerProcess(EngineServer):
    """A `sglang.launch_server` child in its own process group, logging to a file."""

    def __init__(
        self,
        python: str,
        args: list[str],
        log_path: Path,
        cpu_engine: bool = False,
        key: str = "target.sglang.python",
        cores: list[int] | None = None,
        api_key: str | None = None,
    ):
        """`python`: the interpreter of SGLang's own environment (checked: sglang imports
        there and our plugin is registered there); `key` names where it came from;
        `cores`: the CPU engine's share of this host's cores (default: all of them);
        `api_key`: the key it listens with, through keyed_launch (api_key.py)."""
        exe = engine_python(python, key, "sglang", "sglang.srt.plugins")
        triton = "--attention-backend triton" in " ".join(args)
        env = server_env(
            cpu_engine,
            interpret_triton=cpu_engine and triton,
            ranks=server_ranks(args),
            cores=cores,
        )
        host = args[args.index("--host") + 1] if "--host" in args else ""
        if host not in ("", "0.0.0.0", "::"):  # Mooncake writers go out from the server's address
            env.setdefault(mooncake.HOST_ENV, host)
        launcher = "sglang.launch_server"
        if api_key:
            env[KEY_ENV] = api_key
            launcher, args = KEYED_LAUNCH, [launcher, *args]
        super().__init__(exe, launcher, args, log_path, env, api_key=api_key)


class SGLangEngine(ServedEngine):
    """Trainer side of the sglang backend for one rank (served.ServedEngine)."""

    engine = "sglang"
    health_path = "/health_generate"
    identity_path = "/server_info"  # the resolved server args (and live scheduler state)
    identity_fields = ("model_path", "dtype", "quantization")
    no_features_hint = (
        ": is specforge_dspark installed in the server's environment (entry point "
        f"sglang.srt.plugins:{PLUGIN_NAME}) and not excluded by SGLANG_PLUGINS?"
    )

    def __init__(
        self, recipe, rank: int, world_size: int, num_slots: int, shared=None, index: int = 0
    ):
        self._args: list[str] | None = None
        super().__init__(recipe, rank, num_slots, restarts=True, shared=shared, index=index)

    def launch(self, log_path: Path) -> ServerProcess:
        if self._args is None:  # once, by the starting rank only (it may convert Inkling)
            self._args = launch_args(self.recipe)
        s, cpu = self.recipe.target.sglang, is_cpu_engine(self.recipe)
        several = cpu and s.servers_per_node > 1
        cores = node_share(self.index, s.servers_per_node) if several else None
        return ServerProcess(s.python, self._args, log_path, cpu, cores=cores, api_key=self.api_key)

    def post(self, seq: int, slot: ShmSlot, batch: PaddedBatch) -> Future:
        rids, ids = [], []
        for b in range(batch.shape[0]):
            n = int(batch.lengths[b])
            rids.append(make_rid(slot.read_ticket(b).nonce, b, slot.location))
            ids.append(batch.input_ids[b, :n].tolist())
        fut: Future = Future()
        body = json.dumps(request_body(rids, ids)).encode()
        threading.Thread(
            target=post_json,
            args=(f"{self.url}/generate", body, self.timeout_s + 30.0, fut, self.api_key),
            daemon=True,
            name=f"sglang-req-{seq}",
        ).start()
        return fut
