"""step: one whole training step (draft context, draft layers, objective, backward) at
bench shapes with random weights and features, for each block size G and anchor count in
a fresh subprocess (peak RSS is per process); after a warm-up, the fastest of --repeats
steps counts. One line per configuration:
  step kind=<k> G=<g> anchors=<N> tokens_per_s=<x> peak_rss_mb=<y> recompute=<on|off>
tokens = anchors x drafted slots (G for DSpark, G-1 for DFlash); recompute is the decoder's
activation recompute the step ran with (`objective.recompute`, auto resolved by
`training/memory.py` against this machine's memory). On cuda the line goes on with
` mfu=<model FLOPs / time / --peak-tflops> peak_cuda_mb=<z>`.

Shapes: `--shape cpu` (default; the real Inkling vocabulary of 201024 LM-head rows, S=4096,
hidden 256, 2 layers, 3 aux layers, 128 anchors, vocab chunks of 32 blocks, fp32) or
`--shape inkling` (the Inkling-NVFP4 drafter of recipes/inkling_nvfp4.yaml: 5 layers,
hidden 6144, 64/16 heads of 64, FFN 12288, 5 aux layers, 512 anchors, chunks of 64, bf16;
for a GPU); single sizes can be overridden by flag.

`--baseline-tree PATH` also runs each configuration with the `specforge_dspark` package of
another checkout (e.g. `git worktree add /tmp/base_step <commit>`): the child is started as
this file's path with PYTHONPATH=PATH, says which package it imported, and only what that
code knows is passed (it has no objective.recompute or decode_chunk_size and checkpoints
the decoder whenever there is more than one chunk). Its lines end in ` tree=baseline`,
ours in ` tree=new`, then one line per configuration
  step kind=<k> G=<g> anchors=<N> speedup=<new tokens_per_s / baseline tokens_per_s>
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from specforge_dspark.cli.bench import bench_parser
from specforge_dspark.cli.bench.objective import objective_fields

LOGICAL_VOCAB, MASK_TOKEN, PROMPT_LEN, WARMUP_ANCHORS = 200058, 200064, 512, 16
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
SHAPES = {
    "cpu": dict(
        hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512, aux=3,
        markov_rank=64, vocab=201024, seq_len=4096, anchors=128, chunk=32, dtype="fp32",
    ),
    "inkling": dict(
        hidden=6144, layers=5, heads=64, kv_heads=16, head_dim=64, intermediate=12288, aux=5,
        markov_rank=256, vocab=201024, seq_len=4096, anchors=512, chunk=64, dtype="bf16",
    ),
}  # fmt: skip
REPO = Path(__file__).resolve().parents[3]


def draft_fields(kind: str, G: int, shape: dict) -> dict:
    """The draft section of a configuration at `shape` (SHAPES)."""
    V = shape["vocab"]
    return dict(
        kind=kind, hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], intermediate_size=shape["intermediate"], vocab_size=V,
        mask_token_id=min(MASK_TOKEN, V - 1), markov_rank=shape["markov_rank"],
        target_layer_ids=list(range(shape["aux"])), num_target_layers=shape["aux"] + 2,
        block_size=G,
    )  # fmt: skip


def recipes(workdir: Path, shape=None, kind: str = "dspark", block_sizes=(7,), anchors=None):
    """Each configuration as a recipe through the strict loader (what a training run would
    be refused for is refused here first); the defaults' (the cpu shape) by default."""
    from specforge_dspark.config.recipe import recipe_from_dict

    shape = shape or SHAPES["cpu"]
    return [
        recipe_from_dict({
            "draft": draft_fields(kind, G, shape),
            "objective": objective_fields(kind, n, shape["chunk"]),
            "data": {"max_length": shape["seq_len"]},
            "dist": {"precision": shape["dtype"]},
            "train": {"output_dir": str(workdir)},
        })
        for G in block_sizes for n in anchors or [shape["anchors"]]
    ]  # fmt: skip


def bench_main(argv: list[str] | None = None) -> int:
    """Runs each configuration (and its baseline) in a fresh subprocess, prints its line."""
    ap = bench_parser("step", __doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    ap.add_argument("--kind", choices=("dspark", "dflash"), default="dspark")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[7])
    ap.add_argument("--anchors", type=int, nargs="+", help="default: the shape's")
    ap.add_argument("--recompute", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: the shape's")
    ap.add_argument("--decode-chunk", type=int, help="blocks; default: the recipe's")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="H200 bf16 dense")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps; the fastest counts")
    ap.add_argument("--baseline-tree", type=Path)
    for key in [k for k in SHAPES["cpu"] if k not in ("anchors", "dtype")]:  # single sizes
        ap.add_argument(f"--{key.replace('_', '-')}", type=int)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    shape = {k: v if getattr(a, k) is None else getattr(a, k) for k, v in SHAPES[a.shape].items()}
    shape["anchors"] = a.anchors[0] if a.anchors else shape["anchors"]
    if a.child:
        line = step_once(a, a.block_sizes[0], shape)
        print(line, flush=True)
        return 0
    recipes(Path("runs/bench"), shape, a.kind, a.block_sizes, a.anchors)  # refused early
    failed = 0
    trees = [("baseline", a.baseline_tree.resolve())] if a.baseline_tree else []
    trees.append(("new", REPO))
    for G in a.block_sizes:
        for n in a.anchors or [shape["anchors"]]:
            tag = f"step kind={a.kind} G={G} anchors={n}"
            speed = {}
            for name, tree in trees:
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child"]
                cmd += ["--kind", a.kind, "--block-sizes", str(G), "--recompute", a.recompute]
                cmd += ["--device", a.device, "--peak-tflops", str(a.peak_tflops)]
                cmd += ["--repeats", str(a.repeats)]
                cmd += [f"--{k.replace('_', '-')}={v}" for k, v in {**shape, "anchors": n}.items()]
                cmd += [] if a.decode_chunk is None else [f"--decode-chunk={a.decode_chunk}"]
                env = {**os.environ, "PYTHONPATH": str(tree)}
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                lines = proc.stdout.strip().splitlines()
                said = [x.split("=", 1)[1] for x in lines if x.startswith("step package=")]
                package = Path(said[0]) if said else None
                if proc.returncode or not package or tree not in package.parents:
                    failed = 1
                    print(f"{tag} tree={name} failed (exit {proc.returncode}, package "
                          f"{package}): {proc.stderr.strip()[-800:]}", flush=True)  # fmt: skip
                    continue
                if len(trees) > 1:
                    print(f"step tree={name} package={package}", flush=True)
                print(lines[-1] + (f" tree={name}" if len(trees) > 1 else ""), flush=True)
                speed[name] = float(lines[-1].split("tokens_per_s=", 1)[1].split()[0])
            if len(speed) == 2:
                print(f"{tag} speedup={speed['new'] / speed['baseline']:.3f}", flush=True)
    return failed


def step_once(a: argparse.Namespace, G: int, shape: dict) -> str:
    """Build random weights and features on the device, warm up, time `a.repeats` training
    steps and keep the fastest (with whichever `specforge_dspark` is importable: ours or a
    baseline tree's). `a`: the parsed flags."""
    kind, recompute, decode_chunk, device_name = a.kind, a.recompute, a.decode_chunk, a.device
    import dataclasses

    import torch

    import specforge_dspark
    from specforge_dspark.config.recipe import DraftRecipe, ObjectiveRecipe
    from specforge_dspark.drafters.registry import loss_fn, new_draft
    from specforge_dspark.objective.frozen_head import FrozenHead

    print(f"step package={Path(specforge_dspark.__file__).resolve()}", flush=True)
    device, dtype = torch.device(device_name), getattr(torch, DTYPES[shape["dtype"]])
    S, H, V, N = shape["seq_len"], shape["hidden"], shape["vocab"], shape["anchors"]
    draft_recipe = DraftRecipe(**draft_fields(kind, G, shape))
    torch.manual_seed(0)
    with device:
        draft = new_draft(draft_recipe).to(dtype)
        logical = min(LOGICAL_VOCAB, V)
        lm_head_VH = torch.randn(V, H, dtype=dtype) / H**0.5
        head = FrozenHead(torch.randn(V, H, dtype=dtype), lm_head_VH, logical)
        ids_1S = torch.randint(0, logical, (1, S))
        mask_1S = torch.ones(1, S, dtype=torch.long)
        mask_1S[:, : min(PROMPT_LEN, S // 2)] = 0
        aux_1SD = torch.randn(1, S, shape["aux"] * H, dtype=dtype)
        last_1SH = torch.randn(1, S, H, dtype=dtype)
    objective = ObjectiveRecipe(num_anchors=N, chunk_size=shape["chunk"])
    keys = {f.name for f in dataclasses.fields(ObjectiveRecipe)}
    if "recompute" in keys:  # this code decides recompute; the baseline's has no such key
        from specforge_dspark.config.recipe import DataRecipe, DistRecipe, Recipe, TargetRecipe
        from specforge_dspark.training.memory import resolve_recompute

        if decode_chunk is not None:
            objective = dataclasses.replace(objective, decode_chunk_size=decode_chunk)
        recipe = Recipe(
            target=TargetRecipe(device=device_name, dtype=DTYPES[shape["dtype"]]),
            draft=draft_recipe,
            data=DataRecipe(max_length=S),
            objective=dataclasses.replace(objective, recompute=recompute),
            dist=DistRecipe(precision=shape["dtype"]),
        )
        objective = resolve_recompute(recipe, draft, 1, device).objective
        used = objective.recompute
    else:  # the baseline checkpoints whenever the decoder runs in more than one chunk
        used = "on" if 0 < shape["chunk"] < N else "off"
    compute_loss = loss_fn(kind)

    def step(obj) -> None:
        draft.zero_grad(set_to_none=True)
        generator = torch.Generator().manual_seed(0)
        out = compute_loss(draft, head, ids_1S, mask_1S, aux_1SD, last_1SH, obj, generator)
        out.loss.backward()

    # Warm-up on the same code path (more than one chunk), small enough not to set the peak.
    warm = min(WARMUP_ANCHORS, N)
    step(dataclasses.replace(objective, num_anchors=warm, chunk_size=max(warm // 2, 1)))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = math.inf
    for _ in range(max(a.repeats, 1)):
        start = time.perf_counter()
        step(objective)
        if device.type == "cuda":
            torch.cuda.synchronize()  # kernels are asynchronous: wait before reading the clock
        seconds = min(seconds, time.perf_counter() - start)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    P = G - 1 if kind == "dflash" else G
    line = (
        f"step kind={kind} G={G} anchors={N} tokens_per_s={N * P / seconds:.1f} "
        f"peak_rss_mb={peak_mb:.0f} recompute={used}"
    )
    if device.type == "cuda":
        line += f" mfu={model_flops(kind, G, shape) / seconds / (a.peak_tflops * 1e12):.3f}"
        line += f" peak_cuda_mb={torch.cuda.max_memory_allocated() / 2**20:.0f}"
    return line


def model_flops(kind: str, G: int, shape: dict) -> float:
    """Matmul FLOPs of one training step, each computed once (no recompute): fc, every
    layer's context K/V, every block row's layers, attention over the visible keys (on
    average the supervised half of the context, as anchors are), the draft's and the
    teacher's LM-head logits, the Markov head; forward 2mnk, backward 4mnk (2mnk for a
    frozen weight or an input needing no gradient)."""
    H, F, L = shape["hidden"], shape["intermediate"], shape["layers"]
    S, V, N, R = shape["seq_len"], shape["vocab"], shape["anchors"], shape["markov_rank"]
    qe, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    P, rows = (G - 1 if kind == "dflash" else G), N * G
    fc = 4 * S * shape["aux"] * H * H
    ctx_kv = 6 * S * H * 2 * kv
    per_row = 6 * (H * qe + H * 2 * kv + qe * H + 3 * H * F)
    visible = (min(PROMPT_LEN, S // 2) + S) / 2 + G
    attention = 12 * qe * visible  # per query: QK and PV, forward + backward
    vocab = 4 * H * V + 2 * H * V + (0 if kind == "dflash" else 6 * R * V)
    return fc + L * (ctx_kv + rows * (per_row + attention)) + N * P * vocab


if __name__ == "__main__":
    # Started by path (`--baseline-tree`): drop this file's folder from the import path so
    # that `import specforge_dspark` finds the package of PYTHONPATH only.
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.exit(bench_main())
