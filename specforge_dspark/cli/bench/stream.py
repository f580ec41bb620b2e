"""Stream benchmark on the tiny target (CPU), two figures:

1. `stream bytes_per_s=<x> memcpy_bytes_per_s=<y> ratio=<x/y>`: x = feature bytes
   (aux + last hidden) per second that one rank receives from its hf worker through the
   stream with the worker in transport-only mode (engines.hf.REPLAY_FEATURES: after the
   first forward it re-writes those features into each shared-memory slot instead of
   recomputing), the consumer reading every element once; y = the same bytes copied
   in process (`Tensor.copy_`) and then read once; --transfer-seq-len tokens a batch
   (2048: 4 MB of features). The end-to-end rate with the tiny target's forward in the
   loop (--seq-len tokens a batch) is printed on stderr.
2. `stream wait_fraction=<f>`: 2 ranks, each its own process with its own hf worker,
   each consuming its batches with a simulated trainer step; f = the mean over ranks of
   (seconds blocked in `iterate`) / (seconds in the loop). The simulated step is the
   tiny recipe's draft at its sizes: fc (m*H -> H), two SwiGLU MLP blocks (H -> 2H -> H),
   a final norm, draft logits over the LM head's rows for every position, teacher logits
   from last_hidden, an L1 loss between their softmaxes, backward and an SGD update.
Inputs are random token ids (seeded), --seq-len tokens each, batch size 1.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from specforge_dspark.cli.bench import bench_parser, tiny_target
from specforge_dspark.engines import hf
from specforge_dspark.training.stream import FeatureStream
from specforge_dspark.transport.features import TargetFeatures

TARGET = ".cache/tiny_target"


def recipes(workdir: Path, target: str = TARGET) -> list:
    """The recipe of the bench's feature streams (the hf backend)."""
    from specforge_dspark.config.recipe import recipe_from_dict

    target_section = {"path": target, "prefetch": 2, "batch_size": 1, "timeout_s": 300}
    draft = {"target_layer_ids": [0, 1, 2], "num_target_layers": 4, "vocab_size": 1088}
    train = {"output_dir": str(workdir)}
    return [recipe_from_dict({"target": target_section, "draft": draft, "train": train})]


def _bench_batches(n: int, seq_len: int, seed: int) -> list[list[Any]]:
    import torch

    from specforge_dspark.transport.features import Sample

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 1000, (n, seq_len), generator=g)
    return [[Sample(seed * n + i, ids[i], torch.ones(seq_len, dtype=torch.long))] for i in range(n)]


class _SimulatedDraftStep:
    """Forward + backward + SGD of a draft-sized network on one batch of features."""

    def __init__(self, hidden: int, aux_width: int, vocab: int):
        import torch

        g = torch.Generator().manual_seed(0)
        shapes = {"fc": (hidden, aux_width), "head": (vocab, hidden)}
        for i in range(2):
            shapes |= {f"up{i}": (2 * hidden, hidden), f"gate{i}": (2 * hidden, hidden)}
            shapes |= {f"down{i}": (hidden, 2 * hidden)}
        self.w = {
            k: (torch.randn(s, generator=g) * s[1] ** -0.5).requires_grad_()
            for k, s in shapes.items()
        }

    def __call__(self, feats: TargetFeatures) -> None:
        import torch

        w = self.w
        h = torch.nn.functional.rms_norm(feats.aux_hidden @ w["fc"].T, (w["fc"].shape[0],))
        for i in range(2):
            mlp = torch.nn.functional.silu(h @ w[f"gate{i}"].T) * (h @ w[f"up{i}"].T)
            h = h + mlp @ w[f"down{i}"].T
        h = torch.nn.functional.rms_norm(h, (h.shape[-1],))
        q = torch.softmax(h @ w["head"].T, -1)
        with torch.no_grad():
            p = torch.softmax(feats.last_hidden @ w["head"].T, -1)
        loss = (q - p).abs().sum(-1).mean()
        loss.backward()
        with torch.no_grad():
            for t in w.values():
                t -= 1e-3 * t.grad
                t.grad = None


def _bench_rank(rank: int, world: int, target: str, n: int, seq_len: int, conn) -> None:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // (2 * world)))
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    recipe = recipes(Path("runs/bench"), target)[0]
    step = None
    with FeatureStream(recipe, rank=rank, world_size=world) as stream:
        batches = _bench_batches(n, seq_len, seed=rank + 1)
        for feats in stream.iterate(batches[:1]):  # warm-up, not timed
            step = _SimulatedDraftStep(
                feats.last_hidden.shape[-1], feats.aux_hidden.shape[-1], 1088
            )
            step(feats)
        stream.wait_seconds = 0.0
        t0 = time.monotonic()
        for feats in stream.iterate(batches[1:]):
            step(feats)
        conn.send((stream.wait_seconds, time.monotonic() - t0))


def _bench_transfer(target: str, n: int, seq_len: int, transfer_len: int) -> tuple[float, float]:
    """(stream bytes/s, in-process copy bytes/s) for one rank with an idle consumer."""
    import torch

    torch.set_num_threads(1)  # one trainer rank; threads spinning on a busy box skew copy_
    end_to_end = _stream_rate(target, n, seq_len)[0]
    hf.REPLAY_FEATURES = True
    try:
        stream_bps, src = _stream_rate(target, n, transfer_len)
    finally:
        hf.REPLAY_FEATURES = False
    print(f"  end to end (target forward included): {end_to_end:.4g} bytes/s", file=sys.stderr)
    dst = [torch.empty_like(t) for t in src]
    nbytes = sum(t.numel() * t.element_size() for t in src)
    reps = max(10, int(2e8 // max(1, nbytes)))
    total = 0.0
    t0 = time.monotonic()
    for _ in range(reps):
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
        total += float(dst[0].sum() + dst[1].sum())  # read it all, as the stream consumer
    return stream_bps, nbytes * reps / (time.monotonic() - t0)


def _stream_rate(target: str, n: int, seq_len: int):
    """(bytes/s one rank receives, the last batch's tensors) for n timed batches."""
    with FeatureStream(recipes(Path("runs/bench"), target)[0]) as stream:
        batches = _bench_batches(n + 1, seq_len, seed=0)
        next(iter(stream.iterate(batches[:1])))  # warm-up
        stream.bytes_out, stream.wait_seconds, stream.engine.forward_seconds = 0, 0.0, 0.0
        total = 0.0
        t0 = time.monotonic()
        for feats in stream.iterate(batches[1:]):
            total += float(feats.aux_hidden.sum() + feats.last_hidden.sum())  # read it all
        wall = time.monotonic() - t0
        stream_bps = stream.bytes_out / wall
        forward = stream.engine.forward_seconds
        src = [feats.aux_hidden.clone(), feats.last_hidden.clone()]
    print(
        f"  1 rank: {n} batches in {wall:.2f}s, worker forward {forward:.2f}s, "
        f"waited {stream.wait_seconds:.2f}s",
        file=sys.stderr,
    )
    return stream_bps, src


def bench_main(argv: list[str] | None = None) -> int:
    import multiprocessing as mp

    ap = bench_parser("stream", __doc__)
    ap.add_argument("--target", default=TARGET, help="built here if missing")
    ap.add_argument("--batches", type=int, default=24, help="timed batches per rank")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument(
        "--transfer-seq-len", type=int, default=2048, help="tokens per batch, transport-only"
    )
    a = ap.parse_args(argv)
    target = tiny_target(a.target)
    x, y = _bench_transfer(target, a.batches, a.seq_len, a.transfer_seq_len)
    print(f"stream bytes_per_s={x:.4g} memcpy_bytes_per_s={y:.4g} ratio={x / y:.4g}", flush=True)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(2):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_bench_rank, args=(rank, 2, target, a.batches + 1, a.seq_len, child))
        p.start()
        pipes.append(parent)
        procs.append(p)
    try:
        results = [conn.recv() for conn in pipes]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    fraction = sum(w / t for w, t in results) / len(results)
    print(f"stream wait_fraction={fraction:.4g}", flush=True)
    for rank, (w, t) in enumerate(results):
        print(f"  rank {rank}: waited {w:.2f}s of {t:.2f}s", file=sys.stderr)
    return 0
