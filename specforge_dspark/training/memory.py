"""Per-rank memory of a training run, estimated from shapes alone (`train.py --dry-run`),
and the `objective.recompute: auto` decision made from it.

Estimates, not measurements: they count the big tensors the code holds and ignore
allocator slack, CUDA context and kernel workspaces. Per rank, with W data-parallel ranks:
- frozen head: target embedding + LM head, 2 * V * H in the target dtype (replicated).
- draft weights: n params in the compute precision (bf16 on GPU, fp32 on CPU).
- gradients: n in the compute precision, / W under ZeRO >= 2.
- optimizer: AdamW m and v in fp32 (8 bytes) plus the fp32 master copy when computing in
  bf16 (4 bytes), / W under ZeRO >= 1.
- activations of one micro-batch (mb sequences of S tokens, N anchors, blocks of G rows
  of which P are drafted: P = G for DSpark, G - 1 for DFlash; Cd blocks per decoder chunk,
  C per vocab chunk): features (aux m*H + last H per token, target dtype); context (fc
  output and its norm); every layer's context K/V, computed once and kept for the
  micro-step (~ 2 * heads * head_dim + 6 * kv_heads * head_dim per context row); h of
  every block and its gradient (2 * mb*N*G*H); the decoder: per chunk and layer
  ~ (8H + 3F) per query row, that chunk's keys and values (2 * heads * head_dim per key)
  and a bool mask [Cd*G, S + Cd*G] per attention type; ONE chunk when recomputing
  (checkpointed chunks keep only their inputs), EVERY chunk when not; ONE vocab chunk
  (~4 fp32 tensors of C*P*V: draft logits, teacher, softmax, gradient).
- dist.sequence_parallel sp: a rank holds S/sp context rows and N/sp anchors; Ulysses
  adds every rank's keys and values for 1/sp of the heads, and the masks span every
  rank's blocks and keys. The engine hands a rank only its slice of the features (S/sp
  rows and block_size - 1 after them); with data.pack they arrive whole and are cut.

`objective.recompute: auto` is off when the whole estimate with every decoder chunk kept
fits in FIT_FRACTION of the memory the trainer has (`available_bytes`), else on
(`recompute_choice`; `resolve_recompute` applies it to a recipe before training). On a
GPU shared with a server the run starts (backend sglang or vllm, no url, target.device
not cpu: the node's server spans its GPUs) that is what the server leaves,
(1 - its share) x the GPU's memory: SGLang's mem_fraction_static, vLLM's
gpu_memory_utilization (`server_share`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from specforge_dspark.config.recipe import Recipe
from specforge_dspark.config.validate import attached

if TYPE_CHECKING:
    from torch import nn

GB = 1e9
FIT_FRACTION = 0.8
"""Share of the device's memory the estimate may use with recompute off (the rest is
slack for what the estimate ignores)."""

log = logging.getLogger(__name__)


def compute_bytes(recipe: Recipe) -> int:
    """Bytes per element of the draft's compute dtype (dist.precision, auto = by device)."""
    precision = recipe.dist.precision
    if precision == "auto":
        precision = "bf16" if recipe.target.device.startswith("cuda") else "fp32"
    return 2 if precision == "bf16" else 4


def estimate(
    recipe: Recipe, trainable_params: int, world: int, recompute: bool = True
) -> dict[str, float]:
    """Bytes per rank by component (module docstring); keys in print order. `recompute`:
    decoder chunks checkpointed (one chunk's activations live) or not (all of them)."""
    d, o, n = recipe.draft, recipe.objective, trainable_params
    H, V, F = d.hidden_size, d.vocab_size, d.intermediate_size
    b_t = 2 if recipe.target.dtype == "bfloat16" else 4
    b_p = compute_bytes(recipe)
    mb, S, G = recipe.train.micro_batch_size, recipe.data.max_length, d.block_size
    sp = recipe.dist.sequence_parallel  # a rank's share of the positions and the anchors
    N, Sr = math.ceil(o.num_anchors / sp), math.ceil(S / sp)
    fed = S if sp == 1 or recipe.data.pack else min(S, Sr + G - 1)  # feature rows per sequence
    P = G if d.kind == "dspark" else G - 1  # the DFlash kinds draft rows 1..G-1
    X, L = mb * N, d.num_hidden_layers
    C = X if o.chunk_size <= 0 else min(o.chunk_size, X)
    cols = N if o.decode_chunk_size <= 0 else min(max(o.decode_chunk_size // mb, 1), N)
    rows, kept = mb * cols * G, 1 if recompute else math.ceil(N / cols)  # per decoder chunk
    kv, qe = d.num_key_value_heads * d.head_dim, d.num_attention_heads * d.head_dim
    mask_kinds = len(set(d.layer_types)) or 1
    zero = recipe.dist.zero_stage
    # this rank's keys and values, and with sp > 1 every rank's for 1/sp of the heads
    keys = (Sr + rows) * (1 if sp == 1 else 2)
    decoder_chunk = L * (rows * (8 * H + 3 * F) + 2 * mb * keys * qe) * b_p
    decoder_chunk += mask_kinds * mb * sp * rows * sp * (Sr + rows)  # over every rank's keys
    acts = {
        "features": mb * fed * (len(d.target_layer_ids) + 1) * H * b_t,
        "context": 2 * mb * Sr * H * b_p,
        "context K/V": L * mb * Sr * (2 * qe + 6 * kv) * b_p,
        "block hidden + grad": 2 * X * G * H * b_p,
        DECODER[recompute]: kept * decoder_chunk,
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


DECODER = {True: "decoder (1 chunk)", False: "decoder (all chunks)"}
"""The decoder's activation entry of `estimate`, by recompute."""


def total_bytes(est: dict[str, float]) -> float:
    """Sum of an `estimate` (its per-activation detail entries left out)."""
    return sum(v for k, v in est.items() if not k.startswith("activations: "))


def recompute_choice(
    recipe: Recipe,
    trainable_params: int,
    world: int,
    available: int | None,
    what: str = "",
) -> tuple[bool, str]:
    """Whether to recompute the decoder's activations, and the dry-run line saying why.

    objective.recompute on / off are kept; auto is off when the estimate with every
    decoder chunk kept fits in FIT_FRACTION of `available` bytes (`available_bytes`;
    None = unknown, then on). `what`: `available_bytes`'s word on where they come from."""
    mode = recipe.objective.recompute
    if mode != "auto":
        return mode == "on", f"activation recompute: {mode} (objective.recompute: {mode})"
    est = estimate(recipe, trainable_params, world, recompute=False)
    decoder, total = est[f"activations: {DECODER[False]}"], total_bytes(est)
    if available is None:
        why = what or "the device's memory is unknown here"
        return True, f"activation recompute: on (auto: {why})"
    said = (
        f"decoder activations {_size(decoder)}, estimated total {_size(total)}, "
        f"{_size(available)} available{f' ({what})' if what else ''}"
    )
    if total <= FIT_FRACTION * available:
        return False, f"activation recompute: off (auto: {said}: fits)"
    return True, f"activation recompute: on (auto: {said}: over {FIT_FRACTION:.0%} of it)"


def _size(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 1e6:.0f} MB"


SERVER_SHARE = {"sglang": ("mem_fraction_static", None), "vllm": ("gpu_memory_utilization", 0.92)}
"""Per served backend: the server argument that sizes its share of each GPU, and the
engine's default for it (None: SGLang picks one from the GPU, not known here)."""


def server_share(recipe: Recipe) -> tuple[float | None, str] | None:
    """(share of the GPU, recipe key) of a server the run starts beside the trainer on
    its GPUs; None when there is none (hf / offline, an attached server, a CPU server)."""
    t = recipe.target
    if t.backend not in SERVER_SHARE or t.device == "cpu" or attached(t):
        return None
    name, default = SERVER_SHARE[t.backend]
    share = getattr(t, t.backend).server_args.get(name, default)
    return share, f"target.{t.backend}.server_args.{name}"


def available_bytes(device: str, recipe: Recipe | None = None) -> tuple[int | None, str]:
    """Memory a run on `device` may use, and what it is ("" for the plain case): the
    GPU's total memory for cuda, less a co-located server's share (`server_share` of
    `recipe`); MemAvailable of /proc/meminfo for the CPU; None when it cannot be known."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None, ""
        index = torch.device(device).index
        total = torch.cuda.get_device_properties(index or 0).total_memory
        server = server_share(recipe) if recipe is not None else None
        if server is None:
            return total, ""
        share, key = server
        if share is None:
            return None, f"the co-located server's share of the GPU is unknown: set {key}"
        left = int(max(0.0, 1.0 - float(share)) * total)
        return left, f"left of the GPU's {_size(total)} by the co-located server, {key} {share}"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024, ""
    except (OSError, KeyError, ValueError):
        return None, ""


def resolve_recompute(
    recipe: Recipe, draft: nn.Module, world: int, device: object, say=log.info
) -> Recipe:
    """The recipe with objective.recompute "on" or "off" (`recompute_choice` for `draft`'s
    trainable parameters on `device`), for the objective of a run; `say` gets the reason."""
    n = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    on, why = recompute_choice(recipe, n, world, *available_bytes(str(device), recipe))
    say(why)
    objective = dataclasses.replace(recipe.objective, recompute="on" if on else "off")
    return dataclasses.replace(recipe, objective=objective)


def report(recipe: Recipe, trainable_params: int, world: int, recompute: bool = True) -> list[str]:
    """Printable lines of `estimate` (GB = 1e9 bytes; MB for runs under 1 GB)."""
    est = estimate(recipe, trainable_params, world, recompute)
    total = total_bytes(est)
    scale, unit = (GB, "GB") if total >= GB else (1e6, "MB")
    lines = [
        f"memory per rank (estimate from shapes; {world} rank(s), ZeRO-{recipe.dist.zero_stage}, "
        f"draft in {'bf16' if compute_bytes(recipe) == 2 else 'fp32'}):"
    ]
    lines += [f"  {k:<34} {v / scale:>9.2f} {unit}" for k, v in est.items()]
    lines.append(f"  {'total':<34} {total / scale:>9.2f} {unit}")
    return lines


def slot_summary(recipe: Recipe) -> str:
    """The dry run's line on a rank's shared-memory feature slots at their largest
    (transport/slot_budget.py; the target's hidden size taken as draft.hidden_size)."""
    from specforge_dspark.transport.shm import last_rows_dtype
    from specforge_dspark.transport.slot_budget import request_budget, slot_bytes, wire_dtype

    d, budget, dtype = recipe.draft, request_budget(recipe), wire_dtype(recipe)
    aux = len(d.target_layer_ids) * d.hidden_size
    per_slot = slot_bytes(recipe, aux, d.hidden_size, dtype)
    name = lambda t: str(t).removeprefix("torch.")  # noqa: E731
    rows = f"{name(dtype)} rows"
    if last_rows_dtype(dtype) != dtype:  # fp8: the last hidden rows are not quantized
        rows = f"{name(dtype)} aux rows ({name(last_rows_dtype(dtype))} last hidden rows)"
    return (
        f"feature slots (/dev/shm, per rank): {recipe.target.prefetch + 1} x "
        f"{per_slot / 2**20:.1f} MiB of {rows}; a target request holds at most "
        f"{budget.tokens} tokens / {budget.seqs} sequences ({budget.keys})"
    )


def implied_world_size(recipe: Recipe, asked: int | None) -> tuple[int, str]:
    """The ranks a dry run sizes for, and where the number came from: `--world-size`, else
    torchrun's WORLD_SIZE, else the launch line in the recipe file's header (`torchrun
    [--nnodes M] --nproc_per_node N`: M x N), else 1. ValueError when
    dist.sequence_parallel does not divide it."""
    from specforge_dspark.training.distributed import check_world

    world, source = _implied_world_size(recipe, asked)
    check_world(recipe, world)
    return world, source


def _implied_world_size(recipe: Recipe, asked: int | None) -> tuple[int, str]:
    if asked is not None:
        return asked, "--world-size"
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"]), "WORLD_SIZE"
    path = Path(recipe.source) if recipe.source else None
    if path is not None and path.is_file():
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line)
        launch = next((line for line in header if "torchrun" in line), "")
        per_node = re.search(r"--nproc[_-]per[_-]node[ =](\d+)", launch)
        nodes = re.search(r"--nnodes[ =](\d+)", launch)
        if per_node:
            world = int(per_node.group(1)) * (int(nodes.group(1)) if nodes else 1)
            return world, f"the launch in {path.name}'s header"
    return 1, "no launch given: --world-size W sizes for W ranks"


def dry_run_summary(recipe: Recipe, world: int = 1) -> list[str]:
    """What `train.py --dry-run` prints: the draft built on the meta device (parameter
    groups, trainable count), the objective, the backend and the memory estimate; with
    companion drafters (config/companions.py) each one's, then the whole set's per rank."""
    from specforge_dspark.config.companions import companion_recipe

    (network, objective, memory), estimates = drafter_summary(recipe, world)
    lines = [f"recipe: {recipe.source}", *network, *objective]
    lines.append(f"target backend: {recipe.target.backend} ({recipe.target.path})")
    if recipe.target.backend == "sglang" and recipe.target.sglang.servers_per_node > 1:
        from specforge_dspark.engines.pool import started_servers

        lines.append(started_servers(recipe))
    if recipe.target.backend != "offline":
        lines.append(slot_summary(recipe))
    lines += memory
    for i, c in enumerate(recipe.companions):
        more, est = drafter_summary(companion_recipe(recipe, i), world)
        lines += [f"companion {c.name}:", *(f"  {x}" for part in more for x in part)]
        estimates += est
    if recipe.companions:
        names = ["main", *(c.name for c in recipe.companions)]
        lines += set_report(dict(zip(names, estimates, strict=True)), world)
    return lines


def drafter_summary(recipe: Recipe, world: int) -> tuple[list[list[str]], list[dict]]:
    """One drafter's dry-run lines (its network, its objective, its memory) and estimate."""
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
    if d.kind == "dflash2":
        heads += f", selector r={d.selector_rank} top-{d.selector_top_k}"
    network = [
        f"draft ({d.kind}): {d.num_hidden_layers} layers, hidden {d.hidden_size}, heads "
        f"{d.num_attention_heads}/{d.num_key_value_heads}, block {d.block_size}, aux layers "
        f"{d.target_layer_ids} of {d.num_target_layers}, {heads}"
    ]
    network += [f"  {k:<16} {v:>14,d}" for k, v in groups.items()]
    o = recipe.objective
    selector = f" + {o.selector_weight} selector CE" if d.kind == "dflash2" else ""
    weighting = "" if o.slot_weighting == "decay" else f", {o.slot_weighting} slot weights"
    objective = [
        f"objective: {o.ce_weight} CE + {o.l1_weight} {o.divergence.upper()} + {o.bce_weight} "
        f"BCE{selector}, {o.num_anchors} anchors, gamma {o.gamma}{weighting}, chunk "
        f"{o.chunk_size}, decoder chunk {o.decode_chunk_size}"
    ]
    available, what = available_bytes(recipe.target.device, recipe)
    recompute, why = recompute_choice(recipe, n, world, available, what)
    memory = [why, *report(recipe, n, world, recompute), f"trainable_params: {n}"]
    return [network, objective, memory], [estimate(recipe, n, world, recompute)]


SHARED = ("frozen head", "activations: features")
"""Entries of `estimate` that the drafters of one run hold once: the target's head and
the micro-batch's features."""


def set_report(by_drafter: dict[str, dict[str, float]], world: int) -> list[str]:
    """Per rank for several drafters of one run: the shared entries once, each drafter's
    weights, gradients and optimizer state, and the largest drafter's other activations
    (the drafters run one after another, each freeing its activations in backward)."""
    estimates = list(by_drafter.values())
    shared = sum(estimates[0][k] for k in SHARED)
    states = [total_bytes(e) - e["activations"] - e["frozen head"] for e in estimates]
    acts = max(e["activations"] - e["activations: features"] for e in estimates)
    total = shared + sum(states) + acts
    scale, unit = (GB, "GB") if total >= GB else (1e6, "MB")
    return [
        f"memory per rank for the {len(estimates)} drafters (estimate; {world} rank(s)):",
        f"  {'frozen head + features (once)':<34} {shared / scale:>9.2f} {unit}",
        *(f"  {name + ': weights, grads, optimizer':<34} {b / scale:>9.2f} {unit}"
          for name, b in zip(by_drafter, states, strict=True)),
        f"  {'activations (the largest drafter)':<34} {acts / scale:>9.2f} {unit}",
        f"  {'total':<34} {total / scale:>9.2f} {unit}",
    ]  # fmt: skip
