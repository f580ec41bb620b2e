"""An SGLang server that serves a drafter: `sglang.launch_server --speculative-algorithm
DSPARK|DFLASH --speculative-draft-model-path EXPORT_DIR` (the algorithm named by the
export's `architectures`, drafters.registry.kind_of_dir) for a target, greedily, on SGLang's
CPU engine when `device` is cpu (fp32 there, where it is exact). The serving engine the
judge (evaluation/serve_check.py) and the closed loop (cli/loop.py) both start; the vLLM
counterpart is vllm.py."""

from __future__ import annotations

from pathlib import Path

from specforge_dspark.config.servers import SGLangServer
from specforge_dspark.drafters.registry import KINDS, kind_of_dir
from specforge_dspark.engines.inkling_layout import needs_radix_cache, sglang_layout
from specforge_dspark.engines.launch import cli_flag
from specforge_dspark.engines.server import http_ok
from specforge_dspark.engines.sglang import ServerProcess, cpu_engine_args

START_TIMEOUT_S = 600.0


def spec_server_args(
    target: str,
    draft: str | None,
    port: int,
    dtype: str,
    device: str,
    sts: Path | None = None,
    tp_size: int = 1,
) -> list[str]:
    """`sglang.launch_server` arguments that serve `draft` for `target` greedily (with the
    confidence calibration `sts` when given) at tensor-parallel size `tp_size`; with no
    `draft`, the target alone (plain decoding: the target's own answers)."""
    served = sglang_layout(target, log=lambda *a: None)  # a transformers Inkling: converted
    args = ["--model-path", str(served), "--port", str(port), "--host", "127.0.0.1"]
    if draft is not None:
        algorithm = KINDS[kind_of_dir(draft)].algorithm
        args += ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", draft]
    if sts is not None:
        args += ["--speculative-dspark-confidence-sts-path", str(sts)]
    args += ["--dtype", dtype, "--disable-overlap-schedule"]
    if not needs_radix_cache(served):  # SGLang's Inkling asserts it on
        args += ["--disable-radix-cache"]
    engine = cpu_engine_args(served) if device == "cpu" else {}
    for key, value in {**engine, "tp_size": tp_size}.items():
        args += cli_flag(key, value)
    return args


def start_spec_server(
    target: str | Path,
    draft: str | Path | None,
    port: int,
    log_path: Path,
    device: str = "cpu",
    dtype: str = "float32",
    sglang_python: str = SGLangServer.python,
    tp_size: int = 1,
) -> tuple[ServerProcess, str]:
    """(the server, its URL) once healthy; DRAFT/sts_calibration.json is served with it. No
    `draft`: the target alone."""
    from specforge_dspark.decoding.sts import STS_FILE

    sts = None if draft is None else Path(draft) / STS_FILE
    server = ServerProcess(
        sglang_python,
        spec_server_args(
            str(target),
            None if draft is None else str(draft),
            port,
            dtype,
            device,
            sts if sts is not None and sts.is_file() else None,
            tp_size,
        ),  # fmt: skip
        log_path,
        cpu_engine=device == "cpu",
        key="--sglang-python",
    )
    url = f"http://127.0.0.1:{port}"
    server.wait_up(lambda: http_ok(f"{url}/health_generate"), f"SGLang server at {url}",
                   START_TIMEOUT_S)  # fmt: skip
    return server, url
