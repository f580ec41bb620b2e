"""Transport benchmark: /dev/shm against Mooncake's Transfer Engine (TCP), and the trainer's
side of bf16 against fp8 rows, same run.

1. `transport write shm_gb_per_s=<x> mooncake_gb_per_s=<y> ratio=<y/x>`: a writer
   process (spawned, as a server's scheduler is its own process) hands one request of
   --seq-len tokens at the tiny Qwen3 target's shapes (aux 3 x H, last H, fp32) to a
   trainer slot through slot_writer.write_features, the shm path (the slot mapped there)
   and the Mooncake location (the writer's engine on 127.0.0.2, the trainer's on
   127.0.0.1) in alternating turns; x, y = feature bytes / median seconds per request
   (ticket read and write included).
2. `transport request shm_s=<a> mooncake_s=<b> ratio=<b/a>`: one live CPU SGLang server
   on 127.0.0.2, and per transport a trainer engine (SGLangEngine, as a rank uses it)
   fetching one training step's features (one request of --seq-len tokens: prefill,
   capture, handoff, tickets), in ABBA turns after one warm-up each; medians.
3. `transport trainer bf16_s=<a> fp8_s=<b> ratio=<b/a>`: the trainer's side of one
   micro-batch (one sequence of --seq-len tokens at the tiny target's shapes, written into
   a slot of each wire dtype by slot_writer.write_features): its features from the slot
   (request.slot_features) moved to the trainer's device (`TargetFeatures.to`: a CUDA GPU
   when there is one, fp8 rows dequantized there; else the CPU), until they are there;
   bf16 and fp8 in alternating turns after one warm-up each; medians.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from specforge_dspark.cli.bench import bench_parser, tiny_target

LAYERS = [0, 1, 2]
TARGET = ".cache/tiny_qwen3"
SEQ_LEN = 2048
KEY_ENV = "SFDSPARK_BENCH_API_KEY"
"""The environment variable holding the API key of the bench's server (made when unset)."""


def recipes(workdir: Path, target: str = TARGET, seq_len: int = SEQ_LEN, url: str = "") -> list:
    """The recipes of the bench's two engines (capture.bench_recipe at `seq_len`): the one
    that starts the live server at 127.0.0.2 (features by /dev/shm), and the one that
    attaches to it at `url` (default: that server's address) by Mooncake."""
    from specforge_dspark.cli.bench.capture import bench_recipe

    keyed = {"api_key_env": KEY_ENV}  # the attaching engine must hold the started one's key
    started = bench_recipe(target, str(workdir), seq_len, host="127.0.0.2", **keyed)
    url = url or f"http://127.0.0.2:{started.target.sglang.port}"
    return [started, bench_recipe(target, str(workdir), seq_len, "mooncake", url=url, **keyed)]


def _writer(location: str, path: str, rows: int, aux_w: int, hidden: int, reps: int, conn):
    """Spawned: time `reps` writes of one request to each location, in turns."""

    import torch

    from specforge_dspark.transport import mooncake
    from specforge_dspark.transport.slot_writer import write_features

    os.environ[mooncake.HOST_ENV] = "127.0.0.2"
    torch.set_num_threads(1)
    aux, last = torch.randn(rows, aux_w), torch.randn(rows, hidden)
    times: dict[str, list[float]] = {"shm": [], "mooncake": []}
    for i in range(reps + 1):  # round 0 warms both up
        for kind in ("shm", "mooncake") if i % 2 else ("mooncake", "shm"):
            t = time.perf_counter()
            write_features(path if kind == "shm" else location, 0, 7, 0, aux, last)
            if i:
                times[kind].append(time.perf_counter() - t)
    conn.send(times)


def _write_rates(target: str, rows: int, reps: int) -> tuple[float, float]:
    import torch

    from specforge_dspark.engines.tap import read_target_dims
    from specforge_dspark.transport.features import PaddedBatch
    from specforge_dspark.transport.mooncake import Exposer
    from specforge_dspark.transport.request import issue_tickets
    from specforge_dspark.transport.shm import ShmSlot
    from specforge_dspark.transport.tickets import DONE

    dims = read_target_dims(target, LAYERS)
    exposer = Exposer("http://127.0.0.2:1")
    slot = ShmSlot("bench", dims.aux_width, dims.hidden_size, torch.float32, exposer=exposer)
    ids = torch.ones(1, rows, dtype=torch.long)
    issue_tickets(slot, PaddedBatch([0], ids, ids, torch.tensor([rows])))
    t = slot.read_ticket(0)
    t.nonce = 7
    slot.write_ticket(0, t)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    args = (slot.location, str(slot.path), rows, dims.aux_width, dims.hidden_size, reps, child)
    proc = ctx.Process(target=_writer, args=args)
    proc.start()
    times = parent.recv()
    proc.join(60)
    assert slot.read_ticket(0).status == DONE, "the writer wrote nothing"
    nbytes = rows * (dims.aux_width + dims.hidden_size) * 4
    slot.close()
    return tuple(nbytes / statistics.median(times[k]) / 1e9 for k in ("shm", "mooncake"))


def _request_seconds(target: str, rows: int, reps: int) -> tuple[float, float]:
    import torch

    from specforge_dspark.engines.sglang import SGLangEngine
    from specforge_dspark.transport.features import PaddedBatch

    ids = torch.randint(10, 1000, (1, rows), generator=torch.Generator().manual_seed(0))
    batch = PaddedBatch([0], ids, torch.ones_like(ids), torch.tensor([rows]))
    os.environ.setdefault(KEY_ENV, secrets.token_urlsafe(32))
    with tempfile.TemporaryDirectory(prefix="bench-transport-") as out:
        started, _ = recipes(Path(out), target, rows)
        starter = SGLangEngine(started, rank=0, world_size=1, num_slots=1)
        engines = {"shm": starter}
        try:
            starter.wait_ready()
            attached = recipes(Path(out), target, rows, url=starter.url)[1]
            engines["mooncake"] = SGLangEngine(attached, rank=0, world_size=1, num_slots=1)
            engines["mooncake"].wait_ready()
            times: dict[str, list[float]] = {"shm": [], "mooncake": []}
            for i in range(reps + 1):
                for kind in ("shm", "mooncake") if i % 2 else ("mooncake", "shm"):
                    t = time.perf_counter()
                    engines[kind].submit(i, batch)
                    engines[kind].result(i, batch, time.monotonic() + 600)
                    if i:
                        times[kind].append(time.perf_counter() - t)
        finally:
            for engine in engines.values():
                engine.close()
    return tuple(statistics.median(times[k]) for k in ("shm", "mooncake"))


def _trainer_seconds(target: str, rows: int, reps: int) -> tuple[float, float, str]:
    """(bf16 seconds, fp8 seconds, device) of section 3 of the module docstring."""
    import torch

    from specforge_dspark.engines.tap import read_target_dims
    from specforge_dspark.transport.features import PaddedBatch
    from specforge_dspark.transport.fp8_rows import FP8
    from specforge_dspark.transport.request import issue_tickets, slot_features
    from specforge_dspark.transport.shm import ShmSlot
    from specforge_dspark.transport.slot_writer import write_features

    dims = read_target_dims(target, LAYERS)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    aux, last = torch.randn(rows, dims.aux_width, generator=g), torch.randn(rows, dims.hidden_size)
    ids = torch.ones(1, rows, dtype=torch.long)
    batch = PaddedBatch([0], ids, ids, torch.tensor([rows]))
    slots, times = {}, {"bf16": [], "fp8": []}
    try:
        for kind, dtype in (("bf16", torch.bfloat16), ("fp8", FP8)):
            slot = slots[kind] = ShmSlot(f"bench{kind}", dims.aux_width, dims.hidden_size, dtype)
            issue_tickets(slot, batch)
            write_features(str(slot.path), 0, slot.read_ticket(0).nonce, 0, aux, last)
        for i in range(reps + 1):  # round 0 warms both up
            for kind in ("bf16", "fp8") if i % 2 else ("fp8", "bf16"):
                t = time.perf_counter()
                f = slot_features(slots[kind].views([rows]), batch, torch.bfloat16).to(device)
                if device == "cuda":
                    torch.cuda.synchronize()
                if i:
                    times[kind].append(time.perf_counter() - t)
                del f
    finally:
        for slot in slots.values():
            slot.close()
    bf16_s, fp8_s = (statistics.median(times[k]) for k in ("bf16", "fp8"))
    return bf16_s, fp8_s, device


def bench_main(argv: list[str] | None = None) -> int:

    ap = bench_parser("transport", __doc__)
    ap.add_argument("--target", default=TARGET, help="built here if missing")
    ap.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens per request")
    ap.add_argument("--repeats", type=int, default=20, help="timed requests per transport")
    a = ap.parse_args(argv)
    target = tiny_target(a.target, arch="qwen3")
    shm, mc = _write_rates(target, a.seq_len, a.repeats * 5)
    print(
        f"transport write shm_gb_per_s={shm:.3g} mooncake_gb_per_s={mc:.3g} "
        f"ratio={mc / shm:.3g} ({a.seq_len} tokens a request)",
        flush=True,
    )
    shm_s, mc_s = _request_seconds(target, a.seq_len, a.repeats)
    print(
        f"transport request shm_s={shm_s:.4g} mooncake_s={mc_s:.4g} ratio={mc_s / shm_s:.3g} "
        f"(one step's features, {a.seq_len} tokens, live CPU SGLang server, medians of "
        f"{a.repeats})",
        flush=True,
    )
    bf16_s, fp8_s, device = _trainer_seconds(target, a.seq_len, a.repeats * 5)
    print(
        f"transport trainer bf16_s={bf16_s:.4g} fp8_s={fp8_s:.4g} ratio={fp8_s / bf16_s:.3g} "
        f"(one micro-batch of {a.seq_len} tokens from the slot to {device}, fp8 dequantized "
        f"there; medians of {a.repeats * 5})",
        flush=True,
    )
    return 0
