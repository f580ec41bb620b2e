"""The recipe sections that reach a server: `target.sglang`, `target.vllm` and
`data.regenerate` (beside recipe.py, which holds the others)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class SGLangServer:
    """How the `sglang` backend reaches its server."""

    url: str | None = None
    """Attach to a running server at this base URL instead of starting one."""
    urls: list[str] = field(default_factory=list)
    """Attach to a pool of running servers instead (each rank balances its requests over
    them by outstanding tokens; a lost one's requests go to the others: engines/pool.py)."""
    servers_per_node: int = 1
    """Servers the node's local rank 0 starts (without url/urls): server i listens on
    port + 16 i and takes the GPUs from base_gpu_id + i x (tp x dp x pp); every rank of
    the node balances its requests over them, and a lost one's requests go to the others
    while its keeper starts it again (engines/pool.py)."""
    host: str = "127.0.0.1"
    port: int = 30000
    python: str = ".venv-sglang/bin/python"
    """The interpreter of SGLang's own environment, where the server runs (its torch, its
    kernels; our plugin installed there with `pip install --no-deps -e .`): a path,
    relative to the working directory, or a name on PATH. `make sglang-venv` creates this
    one; in SGLang's image it is the image's `python3`. The trainer keeps its own."""
    startup_timeout_s: float = 1800.0
    """Longest wait for the server to answer: at start-up, after a restart, and for an
    attached server (url) to come back after a failure before the run stops. A server
    the run starts: target.timeout_s + target.max_restarts x (this + target.timeout_s)
    (+ backoff) must fit in dist.timeout_s, the longest the other ranks wait in a
    collective meanwhile (config/validate.py)."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """Extra `sglang.launch_server` arguments by ServerArgs field name (tp_size, ...)."""
    api_key_env: str = ""
    """Name of an environment variable holding the server's API key (Authorization:
    Bearer). A server the run starts listens with this key (without it: a key generated
    per job, shared by the node's ranks through a file only the job's user can
    read, <train.output_dir>/<engine>_server_rank<node>.key); an attached server (url, urls)
    gets it on every request, and one that is not on this host's loopback must have one
    (docs/production.md)."""


@dataclass
class MooncakeTransport:
    """`target.transport: mooncake`: the trainer's side of Mooncake's Transfer Engine
    (transport/mooncake.py); a server's writer takes its own RDMA devices and address from
    its environment (SFDSPARK_MOONCAKE_DEVICE, SFDSPARK_MOONCAKE_HOST)."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    device: str = ""
    """RDMA devices of the trainer's host (e.g. "mlx5_0,mlx5_1"); "" with tcp."""
    host: str = ""
    """The trainer's address the servers write to; "" = the local address on the route
    to the server's host."""


@dataclass
class VLLMServer:
    """How the `vllm` backend reaches its server (engines/vllm.py)."""

    url: str | None = None
    """Attach to a running vLLM server at this base URL instead of starting one (it must
    run extract_hidden_states and our connector: engines/vllm.py `launch_args`)."""
    host: str = "127.0.0.1"
    port: int = 30200
    python: str = ".venv-vllm/bin/python"
    """The interpreter whose environment has vLLM and this package: a path (relative to
    the working directory; `make vllm-venv` creates this one) or a name on PATH."""
    startup_timeout_s: float = 1800.0
    """Longest wait for the server to answer at start-up."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """Extra vLLM server arguments by name (tensor_parallel_size, max_model_len, ...)."""
    api_key_env: str = ""
    """Name of an environment variable holding the server's API key (Authorization:
    Bearer). A server the run starts listens with this key (without it: a key generated
    per job, shared by the node's ranks through a file only the job's user can
    read, <train.output_dir>/<engine>_server_rank<node>.key); an attached server (url)
    gets it on every request, and one that is not on this host's loopback must have one
    (docs/production.md)."""


@dataclass
class RegenerateRecipe:
    """On-policy regeneration: the target answers the training prompts itself."""

    backend: Literal["hf", "openai", "sglang"] = "hf"
    """hf: the target generates in the regenerating process; openai: an OpenAI-compatible
    chat server at `url`; sglang: an SGLang server's /generate at `url`, on token ids
    rendered here with target.path's tokenizer (data_pipelines/backends.py)."""
    url: str = ""
    """Base URL of the server, backends openai and sglang."""
    model: str = "default"
    concurrency: int = 8
    batch_size: int = 8
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    samples: int = 1
    """Answers per prompt. The first is decoded as configured; each further one opens
    with `opening_tokens` tokens sampled at `opening_temperature`, then continues as
    configured (hf and sglang backends): more of the target's own greedy trajectories,
    its loops included, which sampling at T > 0 rarely shows (docs/data.md)."""
    opening_tokens: int = 0
    opening_temperature: float = 1.0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 600.0
    api_key_env: str = ""
    """Name of an environment variable holding the server's API key (backends openai and
    sglang): every request carries it (Authorization: Bearer)."""
