"""Write a training recipe for any target from its config.json and tokenizer files.

    python -m specforge_dspark.cli.init_recipe --target /models/Qwen3-8B --out recipes/qwen3_8b.yaml
    python -m specforge_dspark.cli.init_recipe --target DIR --kind dflash --gpus 8 --out R.yaml

The YAML is loaded back with `load_recipe` before it replaces `--out` (it passes
`train.py --dry-run`); a comment above each derived key says where it came from.
- Draft: hidden size, heads, KV heads and head_dim (hidden / heads when absent) are the
  target's, as in DFlash's public drafters (MLA targets, `kv_lora_rank`: head_dim 128,
  hidden / 128 heads, 8 KV heads); dense FFN = the target's dense size
  (`dense_intermediate_size`, else `intermediate_size` unless per expert), else 3 x hidden
  (gpt-oss); min(5, L // 2) layers. The Inkling seeds are narrower than their targets
  (Inkling-NVFP4: 64 heads of 64, 16 KV, FFN 2H): edit the draft section to match them.
- Aux layer ids (`aux_pool`, `aux_layer_ids`): DFlash's window, decoder layers 1 .. L-3
  (0 .. L-2 when that holds fewer than `count`); of a target interleaving sliding and full
  attention, only its full-attention layers there (the Inkling seed's choice); then `count`
  ids spread evenly, ends included: index round(i (n-1) / (m-1)), halves up. Qwen3-8B:
  [1, 9, 17, 25, 33] (z-lab's DFlash drafter); Inkling (66 layers, full attention every
  6th): the seed's [5, 17, 35, 47, 59] exactly. Inkling-Small's seed [1, 9, 17, 25, 33, 38]
  comes from a speculators config of a target whose depth and attention pattern are not
  published (recipes/inkling_small_nvfp4.yaml); no rule over a config reproduces it.
- vocab_size = LM-head rows (padded); the mask token: `choose_mask_token`. RoPE theta: the
  target's, else the Inkling seeds' 8e6 (Inkling has no RoPE); its RoPE scaling copied
  (`draft.rope_scaling`) where the draft reproduces it (linear, llama3, yarn), named and
  left out otherwise.
- `--gpus N` (default: visible CUDA devices): N > 0 sizes one N-GPU node like the seeds
  (bf16, nccl, ZeRO-2, SGLang at TP N where its tap is known, 8 sequences per step);
  N = 0 keeps the tiny CPU recipes' settings (fp32, gloo, hf backend, embedded GSM8K data).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml

from specforge_dspark.cli.mask_token import choose_mask_token
from specforge_dspark.config.command_line import command_parser
from specforge_dspark.config.recipe import load_recipe
from specforge_dspark.config.rope import rope_scaling_problems, rope_type, scaling_from_parameters
from specforge_dspark.engines.tap import check_layer_ids, tap_convention

# model_type -> what SGLang 0.5.23 does with aux layer k (paths under sglang/srt/)
SGLANG_TAPS = {
    "qwen3": "models/qwen3.py, hidden_states[k+1]; tested live on the tiny Qwen3 (CPU)",
    "qwen3_moe": "models/qwen3_moe.py, hidden_states[k+1] as Qwen3",
    "llama": "models/llama.py, hidden_states[k+1] as Qwen3",
    "inkling": "models/inkling.py, before the deferred MLP short conv (hf: same); the seeds' path",
}
SEED_ROPE_THETA = 8e6


def read_config(target: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(root config, text config): `text_config` when nested (Inkling), else the root."""
    path = target / "config.json"
    if not path.is_file():
        raise ValueError(f"--target: no config.json at {path}")
    root = json.loads(path.read_text())
    text = root.get("text_config") or root
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(text.get(key), int):
            raise ValueError(f"--target: {path} has no integer {key}")
    return root, text


def full_attention_layers(text: dict[str, Any], fam: str) -> set[int] | None:
    """Full-attention layers of a target that interleaves sliding and full attention, else
    None. From `layer_types` (sliding = a type naming "sliding"), else `local_layer_ids`,
    else for Inkling transformers' default (full attention at layers with (k+1) % 6 == 0)."""
    n = text["num_hidden_layers"]
    if text.get("layer_types"):
        sliding = {k for k, t in enumerate(text["layer_types"]) if "sliding" in t}
    elif text.get("local_layer_ids") is not None:
        sliding = set(text["local_layer_ids"])
    elif fam == "inkling":
        sliding = {k for k in range(n) if (k + 1) % 6}
    else:
        return None
    full = set(range(n)) - sliding
    return full if sliding and full else None


def aux_pool(num_layers: int, full_attention: set[int] | None, count: int) -> list[int]:
    """The layers aux ids are spread over (module docstring, "Aux layer ids")."""
    pool = list(range(1, num_layers - 2))
    if len(pool) < count:  # shallow targets: every layer but the last can be tapped
        pool = list(range(num_layers - 1))
    full = [k for k in pool if full_attention is not None and k in full_attention]
    return full if len(full) >= count else pool


def aux_layer_ids(num_layers: int, full_attention: set[int] | None, count: int = 5) -> list[int]:
    """`count` aux layers spread evenly over `aux_pool`, its ends included."""
    pool = aux_pool(num_layers, full_attention, count)
    m, n = min(count, len(pool)), len(pool)
    # floor(i (n-1) / (m-1) + 1/2) in integers: halves round up (Inkling's 4.5 -> 5)
    spread = [pool[(2 * i * (n - 1) + m - 1) // (2 * (m - 1))] for i in range(m)] if m > 1 else []
    return spread or [pool[(n - 1) // 2]]


def draft_section(
    text: dict[str, Any], fam: str, kind: str, gpus: int, aux_count: int, mask: int
) -> dict[str, Any]:
    """The draft's sizes from the target's text config (module docstring)."""
    H, L = text["hidden_size"], text["num_hidden_layers"]
    if text.get("kv_lora_rank"):  # MLA: no GQA shape to copy
        heads, kv, head_dim = H // 128, 8, 128
    else:
        heads = text["num_attention_heads"]
        kv, head_dim = text.get("num_key_value_heads") or heads, text.get("head_dim") or H // heads
    dense = None if ffn_is_experts(text) else text.get("intermediate_size")
    ffn = text.get("dense_intermediate_size") or dense
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    layers = min(5, max(1, L // 2))
    theta = float(rope.get("rope_theta") or text.get("rope_theta") or SEED_ROPE_THETA)
    draft: dict[str, Any] = {
        "kind": kind, "hidden_size": H, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "intermediate_size": ffn or 3 * H, "hidden_act": "silu",
        "rms_norm_eps": float(text.get("rms_norm_eps") or 1e-6), "rope_theta": theta,
        "max_position_embeddings": text.get("max_position_embeddings") or 32768,
        "vocab_size": text["vocab_size"], "block_size": 7 if kind == "dspark" else 16,
        "target_layer_ids": aux_layer_ids(L, full_attention_layers(text, fam), aux_count),
        "num_target_layers": L, "mask_token_id": mask,
    }  # fmt: skip
    if rope_type(rope) != "default" and not rope_scaling_problems(rope, "rope"):
        draft["rope_scaling"] = scaling_from_parameters(rope)
    if kind == "dspark":
        draft.update(markov_rank=min(256, H // 4), markov_head_type="vanilla",
                     enable_confidence_head=True, confidence_head_with_markov=True,
                     init="normal_backbone", norm_from_target=True)  # fmt: skip
    else:  # served window 4096 as the seed, 64 as the tiny recipe; the selector of dflash2.yaml
        selector = {"selector_rank": 64, "selector_top_k": 16} if kind == "dflash2" else {}
        draft.update(layer_types=["sliding_attention"] * layers, **selector)
        draft["sliding_window"] = 4096 if gpus else 64
    return draft


def ffn_is_experts(text: dict[str, Any]) -> bool:
    """True when `intermediate_size` is the experts' size (MoE without a dense size)."""
    experts = any(text.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    return experts and text.get("moe_intermediate_size") is None


def target_section(
    target: Path, root: dict[str, Any], fam: str, gpus: int, max_length: int
) -> dict[str, Any]:
    """hf on CPU (the tiny recipes); on GPUs SGLang at TP `gpus` where its aux tap is known
    (SGLANG_TAPS), else the hf backend on each rank's GPU."""
    if not gpus:
        return {"path": str(target), "backend": "hf", "dtype": "float32", "device": "cpu",
                "prefetch": 2, "batch_size": 1, "timeout_s": 120}  # fmt: skip
    known = fam in SGLANG_TAPS
    section: dict[str, Any] = {
        "path": str(target), "backend": "sglang" if known else "hf", "dtype": "bfloat16",
        "device": "cuda", "prefetch": 4, "batch_size": 1, "timeout_s": 600,
    }  # fmt: skip
    if known:
        # a prefill split into chunks still delivers whole aux rows (docs/engines.md)
        args: dict[str, Any] = {"tp_size": gpus, "mem_fraction_static": 0.55,
            "context_length": 2 * max_length, "chunked_prefill_size": 2 * max_length}  # fmt: skip
        if (root.get("quantization_config") or {}).get("quant_algo") == "NVFP4":
            args["quantization"] = "modelopt_fp4"
        if fam == "inkling":
            args["attention_backend"] = "fa4"
        if fam == "inkling" or "auto_map" in root:
            args["trust_remote_code"] = True
        section["sglang"] = {"host": "127.0.0.1", "port": 30000, "startup_timeout_s": 3600,
                             "server_args": args}  # fmt: skip
    return section


def data_section(stem: str, gpus: int) -> dict[str, Any]:
    if not gpus:  # the embedded data of the tiny CPU recipes
        return {
            "train_files": ["../shared/data/train/gsm8k_train.jsonl"],
            "eval_files": ["../shared/data/eval/gsm8k_test.jsonl"],
            "format": "pairs", "prompt_field": "question", "response_field": "answer",
            "max_length": 384, "max_rows": 1200, "cache_dir": ".cache/prepared",
        }  # fmt: skip
    # any SGLang server generates; only its aux tap is per architecture
    regenerate = {"backend": "openai", "url": "http://127.0.0.1:30000", "concurrency": 256}
    return {
        "train_files": [f"data/{stem}_regenerated.jsonl"],
        "eval_files": [f"data/{stem}_regenerated_eval.jsonl"],
        "format": "messages", "max_length": 4096, "cache_dir": ".cache/prepared", "num_proc": 16,
        "regenerate": {**regenerate, "max_new_tokens": 4096, "temperature": 0.0},
    }  # fmt: skip


def build(
    target: Path, out: Path, kind: str, gpus: int, mask_token_id: int | None, aux_count: int
) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """(recipe sections, notes by dotted key, header lines) for `target`."""
    root, text = read_config(target)
    types = [t for t in (text.get("model_type"), root.get("model_type")) if t] or ["unknown"]
    fam = "inkling" if any(t.startswith("inkling") for t in types) else types[0]
    L = text["num_hidden_layers"]
    mask, why = choose_mask_token(target, text, mask_token_id)
    draft = draft_section(text, fam, kind, gpus, aux_count, mask)
    check_layer_ids(draft["target_layer_ids"], L)
    data = data_section(out.stem, gpus)
    dspark = kind == "dspark"
    sections = {
        "target": target_section(target, root, fam, gpus, data["max_length"]),
        "draft": draft,
        "data": data,
        "objective": {
            "num_anchors": 512 if gpus else 64, "ce_weight": 0.1, "l1_weight": 0.9,
            "bce_weight": 1.0 if dspark else 0.0, "gamma": 4.0 if dspark else 7.0,
            "chunk_size": (64 if dspark else 32) if gpus else (32 if dspark else 16),
            "slot_weighting": "decay" if dspark else "dpace", "confidence_detach": dspark},
        "optim": {"lr": 6e-4 if gpus else 2e-3, "weight_decay": 0.0, "betas": [0.9, 0.95],
                  "scheduler": "cosine", "warmup_ratio": 0.04 if gpus else 0.05, "grad_clip": 1.0},
        "train": {"seed": 0, "epochs": 10 if gpus else 1, "max_steps": 0 if gpus else 300,
                  "micro_batch_size": 1, "grad_accum": max(1, 8 // gpus) if gpus else 1,
                  "log_interval": 10, "eval_interval": 1000 if gpus else 100,
                  "output_dir": f"runs/{out.stem}"},
        "dist": {"backend": "nccl" if gpus else "gloo", "zero_stage": 2,
                 "precision": "bf16" if gpus else "fp32"},  # sglang: 600 + 3 x (3600 + 600) s fit
        "checkpoint": {"save_interval": 1000 if gpus else 100, "keep_last": 3 if gpus else 2},
        "tracking": {"project": "specforge_dspark", "run_name": out.stem},
        "export": {"formats": ["sglang", "speculators"] if dspark else ["sglang"],
                   "verifier_name": target.resolve().name},
    }  # fmt: skip
    sections["dist"] |= {"timeout_s": 14400} if sections["target"]["backend"] == "sglang" else {}
    ranks = gpus or 2
    header = [
        f"Generated by: python -m specforge_dspark.cli.init_recipe --target {target} --kind {kind} "
        f"--gpus {gpus} --out {out}",
        f"Target: model_type {fam}, {L} layers, hidden {text['hidden_size']}, "
        f"{text['vocab_size']} LM-head rows, aux tap {tap_convention(root)} (engines/tap.py)",
        f"  torchrun --nproc_per_node {ranks} train.py --recipe {out}",
        f"  python train.py --recipe {out} --dry-run --world-size {ranks}",
    ]
    return sections, _notes(root, text, fam, draft, why, gpus), header


def _notes(
    root: dict[str, Any], text: dict[str, Any], fam: str, draft: dict[str, Any], why: str, gpus: int
) -> dict[str, str]:
    """Comments placed above recipe keys: where each derived value comes from."""
    get = lambda k: text.get(k, root.get(k))  # noqa: E731
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    logical, mult = get("unpadded_vocab_size"), get("logits_mup_width_multiplier")
    full, ids = full_attention_layers(text, fam), draft["target_layer_ids"]
    pool = aux_pool(draft["num_target_layers"], full, len(ids))
    tap = SGLANG_TAPS.get(fam)
    notes = {
        "target.backend": f"SGLang 0.5.23 aux tap for {fam}: {tap}." if tap else
        f"SGLang aux tap for {fam}: not verified; the hf backend is the known path.",
        "draft.hidden_size": "the target's, as are the heads, KV heads and head_dim" if not
        text.get("kv_lora_rank") else "the target's; MLA target: GQA, head_dim 128, hidden / "
        "128 heads, 8 KV heads",
        "draft.num_hidden_layers": "min(5, target layers // 2)",
        "draft.intermediate_size": "3 x hidden: the target's intermediate_size is per expert"
        if ffn_is_experts(text) and not get("dense_intermediate_size")
        else "the target's dense FFN size (the draft is dense)",
        "draft.rope_theta": ("the target's" if "rope_theta" in {**text, **rope} else
        "no RoPE in the target: the seeds'") + f" rope theta; rope type {rope_type(rope)}"
        + ("" if rope_type(rope) == "default" else ", its scaling copied to draft.rope_scaling"
           if "rope_scaling" in draft else ", not copied: the draft cannot reproduce it"),
        "draft.vocab_size": "LM-head rows ("
        + ("tied to the embedding" if get("tie_word_embeddings") else "untied head")
        + (f"; logical vocabulary {logical}, unpadded_vocab_size" if logical else "")
        + (f"; muP: logits = lm_head(h / {mult}), read from the target" if mult else "") + ")",
        "draft.target_layer_ids": f"{len(ids)} spread evenly over the target's "
        + ("full-attention " if full and set(pool) <= full else "")
        + f"layers in {pool[0]}..{pool[-1]} (init_recipe.aux_layer_ids); never the last layer",
        "draft.mask_token_id": why,
        "data.train_files": "on-policy: the target's own answers to your prompts "
        "(python -m data_pipelines.regenerate, docs/data.md)"
        if gpus else "the embedded GSM8K pairs of the tiny CPU recipes",
    }  # fmt: skip
    if gpus:
        notes["train.grad_accum"] = "8 sequences per optimizer step, as the seeds on 8 GPUs"
    else:
        notes["target.backend"] += " CPU: the hf backend, as the tiny recipes."
    return notes


def to_yaml(sections: dict[str, Any], notes: dict[str, str], header: list[str]) -> str:
    """Block YAML, one section per dataclass, each note as comment lines above its key."""
    lines = [f"# {h}" for h in header]
    for key, body in sections.items():
        _emit(lines, key, body, notes, "")
    return "\n".join(lines) + "\n"


def _emit(lines: list[str], key: str, value: Any, notes: dict[str, str], parent: str) -> None:
    dotted = f"{parent}.{key}" if parent else key
    pad = "  " * dotted.count(".")
    lines += [] if parent else [""]  # a blank line between sections
    if dotted in notes:
        lines += textwrap.wrap(notes[dotted], 96 - len(pad), initial_indent=f"{pad}# ",
                               subsequent_indent=f"{pad}#   ")  # fmt: skip
    if isinstance(value, dict) and value:
        lines.append(f"{pad}{key}:")
        for k, v in value.items():
            _emit(lines, k, v, notes, dotted)
        return
    flow = yaml.safe_dump(value, default_flow_style=True, width=10**6)
    lines.append(f"{pad}{key}: {flow.removesuffix(chr(10) + '...' + chr(10)).strip()}")


def main(argv: list[str] | None = None) -> int:
    ex = "python -m specforge_dspark.cli.init_recipe --target /models/Qwen3-8B --out qwen3.yaml"
    ap = command_parser("specforge_dspark.cli.init_recipe", __doc__.split("\n\n")[0], ex)
    ap.add_argument("--target", required=True, type=Path, help="checkpoint dir (config.json)")
    ap.add_argument("--kind", choices=["dspark", "dflash", "dflash2"], default="dspark")
    ap.add_argument("--gpus", type=int, help="GPUs to train on (default: visible; 0 = CPU)")
    ap.add_argument("--out", required=True, type=Path, help="recipe YAML to write")
    ap.add_argument("--mask-token-id", type=int, help="instead of choosing one from the tokenizer")
    ap.add_argument("--aux-layers", type=int, default=5, help="aux target layers to tap")
    args = ap.parse_args(argv)
    if args.gpus is None:
        args.gpus = __import__("torch").cuda.device_count()  # 0 without CUDA
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    try:
        if args.gpus < 0 or args.aux_layers < 1:
            raise ValueError("--gpus must be >= 0 and --aux-layers >= 1")
        sections, notes, header = build(
            args.target, args.out, args.kind, args.gpus, args.mask_token_id, args.aux_layers
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(to_yaml(sections, notes, header), encoding="utf-8")
        load_recipe(tmp)  # what lands on disk loads: a RecipeError names the key
        os.replace(tmp, args.out)
    except ValueError as e:  # RecipeError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        tmp.unlink(missing_ok=True)
    d = sections["draft"]
    print(f"wrote {args.out}: {d['kind']}, aux layers {d['target_layer_ids']} of "
          f"{d['num_target_layers']}, mask token {notes['draft.mask_token_id']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
