"""Capture benchmark: what feature capture adds to a live SGLang server's prefill.

One CPU SGLang server for the tiny Qwen3 target, started by the sglang backend itself
(SGLangEngine: launch_args, ServerProcess, its keeper), then prefills of the same S token
ids, timed in turns (ABBA order, so drift cancels), after one warm-up of each:
  with:    one training request as the trainer sends it (SGLangEngine.submit + result:
           rids naming a shared-memory slot and ticket, return_hidden_states; the plugin
           writes the aux and last hidden rows into the slot)
  without: a plain `/generate` of the same ids, max_new_tokens 1, no hidden states
Prints `capture overhead=<median with / median without>` and both medians in ms. S is
the longest prompt the server takes (below `max_req_input_len` of its /server_info: its
context length or token pool, less SGLang's margin) unless --seq-len asks for fewer.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

from specforge_dspark.cli.bench import bench_parser, tiny_target
from specforge_dspark.engines.launch import free_port

TARGET = ".cache/tiny_qwen3"


def recipes(workdir: Path, target: str = TARGET, max_length: int = 0) -> list:
    """The recipe the bench serves its target with (max_length 0: the target's context)."""
    from specforge_dspark.engines.tap import read_target_config

    context = max_length or read_target_config(target)["max_position_embeddings"]
    return [bench_recipe(target, str(workdir), context)]


def bench_recipe(target: str, output_dir: str, max_length: int, transport="shm", **sglang):
    """A live CPU SGLang server's recipe for `target` (`sglang`: more of its section)."""
    from specforge_dspark.config.recipe import recipe_from_dict

    return recipe_from_dict(
        {
            "target": {
                "path": target,
                "backend": "sglang",
                "device": "cpu",
                "prefetch": 1,
                "timeout_s": 600,
                "transport": transport,
                "sglang": {"port": free_port(), **sglang},
            },
            "draft": {"target_layer_ids": [0, 1, 2], "num_target_layers": 4, "vocab_size": 1088},
            "data": {"max_length": max_length},
            "train": {"output_dir": output_dir},
        }
    )


def _get_json(url: str, key: str | None) -> dict:
    import urllib.request

    from specforge_dspark.engines.api_key import auth_headers

    req = urllib.request.Request(url, headers=auth_headers(key))
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _plain(url: str, key: str | None, ids: list[int]) -> None:
    """A prefill without capture: the same ids, one new token, no hidden states."""
    from specforge_dspark.engines.server import post_json

    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    fut: Future = Future()
    post_json(f"{url}/generate", json.dumps(body).encode(), 600.0, fut, key)
    fut.result()


def _captured(engine, seq: int, batch) -> None:
    """A prefill with capture, exactly as a training rank asks for one."""
    engine.submit(seq, batch)
    feats = engine.result(seq, batch, time.monotonic() + 600)  # raises unless ticket done
    assert int(feats.lengths[0]) == batch.shape[1]


def bench_main(argv: list[str] | None = None) -> int:

    import torch

    from specforge_dspark.engines.sglang import SGLangEngine
    from specforge_dspark.transport.features import PaddedBatch

    ap = bench_parser("capture", __doc__)
    ap.add_argument("--target", default=TARGET, help="built here if missing")
    ap.add_argument("--repeats", type=int, default=8, help="timed prefills of each kind")
    ap.add_argument("--seq-len", type=int, default=0, help="0: the longest the server takes")
    a = ap.parse_args(argv)
    log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731
    target = tiny_target(a.target, arch="qwen3")
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as out:
        engine = SGLangEngine(recipes(Path(out), target)[0], rank=0, world_size=1, num_slots=2)
        try:
            t0 = time.monotonic()
            engine.wait_ready()
            info = _get_json(f"{engine.url}/server_info", engine.api_key)
            longest = info["max_req_input_len"] - 1
            S = min(a.seq_len or longest, longest)
            log(f"server ready in {time.monotonic() - t0:.0f}s; prefills of {S} tokens")
            ids = torch.randint(10, 1000, (1, S), generator=torch.Generator().manual_seed(0))
            batch = PaddedBatch([0], ids, torch.ones_like(ids), torch.tensor([S]))
            runs = {
                "with": lambda i: _captured(engine, i, batch),
                "without": lambda i: _plain(engine.url, engine.api_key, ids[0].tolist()),
            }
            times: dict[str, list[float]] = {"with": [], "without": []}
            for i in range(a.repeats + 1):  # round 0 warms both up
                order = ("with", "without") if i % 2 else ("without", "with")
                for kind in order:
                    t = time.perf_counter()
                    runs[kind](i)
                    if i:
                        times[kind].append(time.perf_counter() - t)
        finally:
            engine.close()
    w, wo = (statistics.median(times[k]) * 1e3 for k in ("with", "without"))
    log(f"with (ms): {[round(t * 1e3) for t in times['with']]}")
    log(f"without (ms): {[round(t * 1e3) for t in times['without']]}")
    print(
        f"capture overhead={w / wo:.3f} (median {w:.0f} ms with, {wo:.0f} ms without; "
        f"{S} tokens, {a.repeats} each)",
        flush=True,
    )
    return 0
