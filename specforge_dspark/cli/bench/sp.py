"""sp: memory and time per rank of one training micro-step (the objective's forward and
backward, `objective.loss.compute_loss`) at long sequence lengths, with the positions of
the sequence on 1 rank and split over 2 (dist.sequence_parallel 2: DeepSpeed's Ulysses
over gloo). The 1-rank run is the baseline measured in the same invocation.

The draft is the recipe's (default recipes/smollm2_cpu.yaml with 8 heads of 64 and 4 KV
heads: SmolLM2's 9 heads do not split over 2 ranks), its objective as written; the frozen
head is random at the recipe's vocabulary (no target is loaded); one sequence of random
features per length, every position supervised. As in train.py, a rank receives only its
window of the sequence's features (its slice and block_size - 1 rows after it, as the
engine hands it: PaddedBatch.window). Lengths run in increasing order in one process per
rank, so the process's peak resident memory after a length is that length's peak.
One line per (ranks, length):
  sp ranks=<P> length=<S> peak_rss_growth_mb=<max over ranks, over the resident memory
     before the first length> s_per_step=<slowest rank> memory_vs_1_rank=<ratio>
and the lines as JSON in runs/bench/sequence_parallel.json (--out).
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch

from specforge_dspark.cli.bench import bench_parser

REPO = Path(__file__).resolve().parents[3]
HEADS = ["draft.num_attention_heads=8", "draft.num_key_value_heads=4"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(rank: int, ranks: int, store: str, recipe_path: str, overrides, lengths) -> None:
    torch.set_num_threads(1)
    shard = None
    if ranks > 1:
        import deepspeed
        import torch.distributed as dist

        from specforge_dspark.objective.sequence_parallel import SeqShard
        from specforge_dspark.training.distributed import skip_deepspeed_shm_build

        dist.init_process_group(
            "gloo", init_method=f"file://{store}/store", rank=rank, world_size=ranks
        )
        skip_deepspeed_shm_build()
        deepspeed.init_distributed(dist_backend="gloo")
        shard = SeqShard(dist.new_group(list(range(ranks))), rank, ranks)
    from types import SimpleNamespace

    from specforge_dspark.config.recipe import load_recipe
    from specforge_dspark.drafters.registry import new_draft
    from specforge_dspark.objective.frozen_head import FrozenHead
    from specforge_dspark.objective.loss import compute_loss
    from specforge_dspark.objective.sequence_parallel import shard_features

    recipe = load_recipe(recipe_path, overrides)
    d = recipe.draft
    torch.manual_seed(0)
    draft = new_draft(d)
    V, H, m = d.vocab_size, d.hidden_size, len(d.target_layer_ids)
    head = FrozenHead(torch.randn(V, H) * 0.02, torch.randn(V, H) * 0.02, V)
    base, rows = _rss_mb(), []
    for S in lengths:
        g = torch.Generator().manual_seed(S)
        ids = torch.randint(0, V, (1, S), generator=g)
        mask = torch.ones(1, S, dtype=torch.long)
        lo, W = (0, S) if shard is None else shard.window(S, d.block_size - 1)
        feats = SimpleNamespace(  # this rank's rows, as the stream delivers them
            input_ids=ids,
            aux_hidden=torch.randn(1, min(W, S - lo), m * H, generator=g),
            last_hidden=torch.randn(1, min(W, S - lo), H, generator=g),
            row0=lo,
        )
        aux, last = feats.aux_hidden, feats.last_hidden
        if shard is not None:
            aux, last = shard_features(feats, shard, d.block_size - 1)
        draft.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = compute_loss(
            draft, head, ids, mask, aux, last, recipe.objective, g.manual_seed(1), shard=shard
        )
        out.loss.backward()
        took = time.perf_counter() - t0
        del feats, aux, last, out
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rows.append({"length": S, "peak_rss_growth_mb": peak - base, "s_per_step": took})
    Path(store, f"rank{rank}.json").write_text(json.dumps(rows))


def recipes(workdir: Path, recipe: str = "recipes/smollm2_cpu.yaml", longest: int = 8192) -> list:
    """The recipe the benchmark sizes its draft and objective from, through the strict
    loader (`workdir`: unused, every benchmark's signature)."""
    from specforge_dspark.config.recipe import load_recipe

    path = recipe if Path(recipe).is_file() else str(REPO / recipe)
    return [load_recipe(path, overrides_for([], longest))]


def overrides_for(given: list[str], longest: int) -> list[str]:
    """The recipe overrides of a run: `given` (default HEADS) and the longest length."""
    return [*(given or HEADS), f"data.max_length={longest}"]


def measure(ranks: int, recipe_path: str, overrides: list[str], lengths: list[int]) -> list:
    """Per length: the largest peak growth and the slowest step over the ranks."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as store:
        args = (ranks, store, recipe_path, overrides, lengths)
        mp.spawn(_worker, args=args, nprocs=ranks, join=True)
        per_rank = [json.loads(Path(store, f"rank{r}.json").read_text()) for r in range(ranks)]
    return [
        {
            "ranks": ranks,
            "length": S,
            "peak_rss_growth_mb": max(r[i]["peak_rss_growth_mb"] for r in per_rank),
            "s_per_step": max(r[i]["s_per_step"] for r in per_rank),
        }
        for i, S in enumerate(lengths)
    ]


def bench_main(argv: list[str] | None = None) -> int:
    ap = bench_parser("sp", __doc__)
    ap.add_argument("--recipe", default="recipes/smollm2_cpu.yaml")
    ap.add_argument("--lengths", default="2048,4096,8192", help="comma-separated, increasing")
    ap.add_argument("--out", default="runs/bench/sequence_parallel.json")
    ap.add_argument("overrides", nargs="*", help=f"recipe overrides (default: {' '.join(HEADS)})")
    args = ap.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    overrides = overrides_for(args.overrides, max(lengths))
    recipe_path = str(REPO / args.recipe) if not Path(args.recipe).is_file() else args.recipe
    rows = measure(1, recipe_path, overrides, lengths) + measure(2, recipe_path, overrides, lengths)
    one = {r["length"]: r["peak_rss_growth_mb"] for r in rows if r["ranks"] == 1}
    for r in rows:
        r["memory_vs_1_rank"] = r["peak_rss_growth_mb"] / one[r["length"]]
        print(
            f"sp ranks={r['ranks']} length={r['length']} "
            f"peak_rss_growth_mb={r['peak_rss_growth_mb']:.0f} s_per_step={r['s_per_step']:.2f} "
            f"memory_vs_1_rank={r['memory_vs_1_rank']:.2f}",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"recipe": args.recipe, "overrides": overrides, "cpu_threads_per_rank": 1}
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0
