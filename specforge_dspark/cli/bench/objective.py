"""objective: one forward+backward of the draft and the objective on CPU at the real Inkling
vocabulary (201024 LM-head rows, 200058 logical), hidden 256, 2 layers, 3 aux layers,
S=4096, random weights and features, for each block size G (DSpark, G = 7 and 16 by
default: the production DSpark and Inkling-Small blocks; `--kind dflash`, `dflash2`), anchor
count and chunk size in a fresh subprocess (peak RSS is per process). One line per
configuration:
  objective kind=<k> G=<g> dtype=<fp32|bf16> anchors=<N> chunk=<C> tokens_per_s=<x> peak_rss_mb=<y>
tokens = anchors x drafted slots (G for DSpark, G-1 for DFlash); chunk=0 is unchunked. An
unchunked run whose estimated peak exceeds --max-unchunked-gb (or 80% of the memory
available now) is skipped with a message. Then, per G and chunked size, one line
  objective kind=<k> G=<g> chunk=<C> rss_ratio anchors <max>/<min> = <r>
(peak RSS at the most anchors over the fewest: ~1 when chunking keeps memory flat).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

from specforge_dspark.cli.bench import bench_parser

VOCAB_ROWS, LOGICAL_VOCAB, MASK_TOKEN = 201024, 200058, 200064
SEQ_LEN, PROMPT_LEN, WARMUP_ANCHORS = 4096, 512, 16
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# Unchunked fp32 peak ~ BASE_MB + VOCAB_COPIES logical-vocab fp32 rows per slot (fitted to
# 3.1 GB at 128 and 5.3 GB at 256 anchors).
BASE_MB, VOCAB_COPIES = 930, 3.0


def draft_fields(kind: str, block_size: int) -> dict:
    """The draft section of a configuration (the rest: DraftRecipe's defaults)."""
    return dict(kind=kind, vocab_size=VOCAB_ROWS, mask_token_id=MASK_TOKEN,
                target_layer_ids=[1, 3, 5], num_target_layers=8, block_size=block_size)  # fmt: skip


def objective_fields(kind: str, num_anchors: int, chunk: int) -> dict:
    """The objective section of a configuration: only DSpark has a confidence head to train."""
    return dict(num_anchors=num_anchors, chunk_size=chunk, bce_weight=float(kind == "dspark"))


def recipes(
    workdir: Path,
    kind: str = "dspark",
    block_sizes=(7, 16),
    anchors=(32, 256),
    chunks=(32,),
) -> list:
    """Each configuration's draft and objective as a recipe through the strict loader (what
    a training run would be refused for is refused here first); the defaults' by default."""
    from specforge_dspark.config.recipe import recipe_from_dict

    return [
        recipe_from_dict({
            "draft": draft_fields(kind, G),
            "objective": objective_fields(kind, n, c),
            "train": {"output_dir": str(workdir)},
        })
        for G in block_sizes for n in anchors for c in chunks
    ]  # fmt: skip


def bench_main(argv: list[str] | None = None) -> int:
    """Runs each configuration in a fresh subprocess and prints its line."""
    ap = bench_parser("objective", __doc__)
    ap.add_argument("--anchors", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--chunks", type=int, nargs="+", default=[32])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[7, 16])
    ap.add_argument("--kind", choices=("dspark", "dflash", "dflash2"), default="dspark")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--max-unchunked-gb", type=float, default=16.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        line = _objective_once(a.kind, a.block_sizes[0], a.anchors[0], a.chunks[0], a.dtype)
        print(line, flush=True)
        return 0
    recipes(Path("runs/bench"), a.kind, a.block_sizes, a.anchors, a.chunks)  # refused early
    failed = 0
    for G in a.block_sizes:
        tag = f"objective kind={a.kind} G={G} dtype={a.dtype}"
        peaks: dict[int, dict[int, float]] = {}
        for n in a.anchors:
            for chunk in a.chunks:
                if chunk == 0:
                    est_gb = (BASE_MB + VOCAB_COPIES * n * G * LOGICAL_VOCAB * 4 / 2**20) / 1024
                    limit_gb = min(a.max_unchunked_gb, 0.8 * _available_gb())
                    if est_gb > limit_gb:
                        print(
                            f"{tag} anchors={n} chunk=0 skipped: estimated peak "
                            f"{est_gb:.1f} GB > {limit_gb:.1f} GB",
                            flush=True,
                        )
                        continue
                cmd = [sys.executable, "-m", "specforge_dspark.cli.bench", "objective", "--child"]
                cmd += ["--anchors", str(n), "--chunks", str(chunk), "--dtype", a.dtype]
                cmd += ["--block-sizes", str(G), "--kind", a.kind]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                lines = proc.stdout.strip().splitlines()
                if proc.returncode or not lines:
                    failed = 1
                    print(
                        f"{tag} anchors={n} chunk={chunk} failed (exit {proc.returncode}): "
                        f"{proc.stderr.strip()[-500:]}",
                        flush=True,
                    )
                    continue
                print(lines[-1], flush=True)
                peak = float(lines[-1].rsplit("peak_rss_mb=", 1)[1])
                peaks.setdefault(chunk, {})[n] = peak
        for chunk, by_n in peaks.items():
            if chunk > 0 and len(by_n) > 1:
                lo, hi = min(by_n), max(by_n)
                print(
                    f"objective kind={a.kind} G={G} chunk={chunk} rss_ratio anchors {hi}/{lo} "
                    f"= {by_n[hi] / by_n[lo]:.3f}",
                    flush=True,
                )
    return failed


def _available_gb() -> float:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) / 2**20


def _objective_once(
    kind: str, block_size: int, num_anchors: int, chunk: int, dtype_name: str
) -> str:
    """Build random weights and features, warm up, time one forward+backward."""
    import torch

    from specforge_dspark.config.recipe import DraftRecipe, ObjectiveRecipe
    from specforge_dspark.drafters.registry import loss_fn, new_draft
    from specforge_dspark.objective.frozen_head import FrozenHead

    dtype = getattr(torch, DTYPES[dtype_name])
    torch.manual_seed(0)
    recipe = DraftRecipe(**draft_fields(kind, block_size))
    draft = new_draft(recipe).to(dtype)
    compute_loss = loss_fn(kind)
    H = recipe.hidden_size
    head = FrozenHead(
        torch.randn(VOCAB_ROWS, H, dtype=dtype),
        torch.randn(VOCAB_ROWS, H, dtype=dtype) / H**0.5,
        LOGICAL_VOCAB,
    )
    ids_1S = torch.randint(0, LOGICAL_VOCAB, (1, SEQ_LEN))
    mask_1S = torch.ones(1, SEQ_LEN, dtype=torch.long)
    mask_1S[:, :PROMPT_LEN] = 0
    aux_1SD = torch.randn(1, SEQ_LEN, 3 * H, dtype=dtype)
    last_1SH = torch.randn(1, SEQ_LEN, H, dtype=dtype)
    generator = torch.Generator().manual_seed(0)

    def step(n: int, c: int) -> None:
        obj = ObjectiveRecipe(num_anchors=n, chunk_size=c)
        draft.zero_grad(set_to_none=True)
        out = compute_loss(draft, head, ids_1S, mask_1S, aux_1SD, last_1SH, obj, generator)
        out.loss.backward()

    # Warm-up on the same code path (two chunks when chunked), small enough not to set
    # the peak.
    step(WARMUP_ANCHORS, min(chunk, WARMUP_ANCHORS // 2))
    start = time.perf_counter()
    step(num_anchors, chunk)
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens = num_anchors * (block_size if kind == "dspark" else block_size - 1)
    return (
        f"objective kind={kind} G={block_size} dtype={dtype_name} anchors={num_anchors} "
        f"chunk={chunk} tokens_per_s={tokens / seconds:.1f} peak_rss_mb={peak_mb:.0f}"
    )
