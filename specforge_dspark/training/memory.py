"""Per-rank memory of a training run, estimated from shapes alone (`train.py --dry-run`).

Estimates, not measurements: they count the big tensors the code holds and ignore
allocator slack, CUDA context and kernel workspaces. Per rank, with W data-parallel ranks:
- frozen head: target embedding + LM head, 2 * V * H in the target dtype (replicated).
- draft weights: n params in the compute precision (bf16 on GPU, fp32 on CPU).
- gradients: n in the compute precision, / W under ZeRO >= 2.
- optimizer: AdamW m and v in fp32 (8 bytes) plus the fp32 master copy when computing in
  bf16 (4 bytes), / W under ZeRO >= 1.
- activations of one micro-batch (mb sequences of S tokens, N anchors, blocks of G rows
  of which P are drafted: P = G for DSpark, G - 1 for DFlash; C blocks per chunk):
  features (aux m*H + last H per token, target dtype); context (fc output and its norm);
  h of every block and its gradient (2 * mb*N*G*H); ONE decoder chunk recomputed under
  checkpointing (per layer ~ (8H + 3F) per query row and 4 * kv_heads * head_dim per
  context row, plus a bool mask [C*G, S + C*G] per attention type); ONE vocab chunk
  (~4 fp32 tensors of C*P*V: draft logits, teacher, softmax, gradient).
"""

from __future__ import annotations

from specforge_dspark.recipe import Recipe

GB = 1e9


def compute_bytes(recipe: Recipe) -> int:
    """Bytes per element of the draft's compute dtype (dist.precision, auto = by device)."""
    precision = recipe.dist.precision
    if precision == "auto":
        precision = "bf16" if recipe.target.device.startswith("cuda") else "fp32"
    return 2 if precision == "bf16" else 4


def estimate(recipe: Recipe, trainable_params: int, world: int) -> dict[str, float]:
    """Bytes per rank by component (module docstring); keys in print order."""
    d, o, n = recipe.draft, recipe.objective, trainable_params
    H, V, F = d.hidden_size, d.vocab_size, d.intermediate_size
    b_t = 2 if recipe.target.dtype == "bfloat16" else 4
    b_p = compute_bytes(recipe)
    mb, S, N, G = recipe.train.micro_batch_size, recipe.data.max_length, o.num_anchors, d.block_size
    P = G - 1 if d.kind == "dflash" else G
    X = mb * N
    C = X if o.chunk_size <= 0 else min(o.chunk_size, X)
    rows = C * G
    kv = d.num_key_value_heads * d.head_dim
    mask_kinds = len(set(d.layer_types)) or 1
    zero = recipe.dist.zero_stage
    acts = {
        "features": mb * S * (len(d.target_layer_ids) + 1) * H * b_t,
        "context": 2 * mb * S * H * b_p,
        "block hidden + grad": 2 * X * G * H * b_p,
        "decoder chunk": d.num_hidden_layers * (rows * (8 * H + 3 * F) + 4 * mb * S * kv) * b_p
        + mask_kinds * mb * rows * (S + rows),
        "vocab chunk": 4 * C * P * V * 4,
    }
    return {
        "frozen head": 2 * V * H * b_t,
        "draft weights": n * b_p,
        "gradients": n * b_p / (world if zero >= 2 else 1),
        "optimizer state": n * (8 + (4 if b_p == 2 else 0)) / (world if zero >= 1 else 1),
        **{f"activations: {k}": v for k, v in acts.items()},
        "activations": sum(acts.values()),
    }


def report(recipe: Recipe, trainable_params: int, world: int) -> list[str]:
    """Printable lines of `estimate` (GB = 1e9 bytes; MB for runs under 1 GB)."""
    est = estimate(recipe, trainable_params, world)
    total = sum(v for k, v in est.items() if not k.startswith("activations: "))
    scale, unit = (GB, "GB") if total >= GB else (1e6, "MB")
    lines = [
        f"memory per rank (estimate from shapes; {world} rank(s), ZeRO-{recipe.dist.zero_stage}, "
        f"draft in {'bf16' if compute_bytes(recipe) == 2 else 'fp32'}):"
    ]
    lines += [f"  {k:<34} {v / scale:>9.2f} {unit}" for k, v in est.items()]
    lines.append(f"  {'total':<34} {total / scale:>9.2f} {unit}")
    return lines


def dry_run_summary(recipe: Recipe, world: int = 1) -> list[str]:
    """What `train.py --dry-run` prints: the draft built on the meta device (parameter
    groups, trainable count), the objective, the backend and the memory estimate."""
    import torch

    from specforge_dspark.drafters.registry import new_draft

    with torch.device("meta"):
        draft = new_draft(recipe.draft)
    groups: dict[str, int] = {}
    for name, p in draft.named_parameters():
        key = name.split(".")[0] if not name.startswith("layers.") else "layers"
        groups[key] = groups.get(key, 0) + p.numel()
    n = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    d = recipe.draft
    heads = (
        f"markov {d.markov_head_type} r={d.markov_rank}"
        if d.kind == "dspark"
        else f"layers {sorted(set(draft.config.layer_types))}, window {d.sliding_window}"
    )
    lines = [f"recipe: {recipe.source}"]
    lines.append(
        f"draft ({d.kind}): {d.num_hidden_layers} layers, hidden {d.hidden_size}, heads "
        f"{d.num_attention_heads}/{d.num_key_value_heads}, block {d.block_size}, aux layers "
        f"{d.target_layer_ids} of {d.num_target_layers}, {heads}"
    )
    for k, v in groups.items():
        lines.append(f"  {k:<16} {v:>14,d}")
    o = recipe.objective
    lines.append(
        f"objective: {o.ce_weight} CE + {o.l1_weight} L1 + {o.bce_weight} BCE, "
        f"{o.num_anchors} anchors, gamma {o.gamma}, chunk {o.chunk_size}"
    )
    lines.append(f"target backend: {recipe.target.backend} ({recipe.target.path})")
    lines += report(recipe, n, world)
    lines.append(f"trainable_params: {n}")
    return lines
