"""A transformers Inkling checkpoint rewritten in the layout SGLang 0.5.23 loads.

SGLang registers Inkling only as `InklingForConditionalGeneration` with an
`inkling_mm_model` config (`sglang/srt/configs/inkling.py` InklingMMConfig), text weights
under `model.llm.*` with the original names, gate/up interleaved row by row into `w13`
tensors. transformers' `InklingForCausalLM` (what `targets/target.py` builds and the hf
backend reads) is the same network under other names: transformers maps the original
layout onto its own (`conversion_mapping.py`, "inkling_mm_model"); this module goes the
other way for the text model (no vision or audio tower):

    transformers (InklingForCausalLM)              SGLang (InklingForConditionalGeneration)
    model.embed_tokens.weight                      model.llm.embed.weight
    model.embed_tokens.embed_norm.weight           model.llm.embed_norm.weight
    model.norm.weight / lm_head.weight             model.llm.norm.weight / model.llm.unembed.weight
    layers.i.self_attn.{q,k,v,r,o}_proj.weight     layers.i.attn.{wq,wk,wv,wr,wo}_*.weight
    layers.i.self_attn.{k,v}_sconv.conv1d.weight   layers.i.attn.{k,v}_sconv.weight
    layers.i.{attn,mlp}_sconv.conv1d.weight        layers.i.{attn,mlp}_sconv.weight
    layers.i.input_layernorm / post_attention_...  layers.i.attn_norm / mlp_norm
    layers.i.mlp.{gate,up}_proj.weight (dense)     layers.i.mlp.w13_dn.weight   (interleaved rows)
    layers.i.mlp.down_proj.weight (dense)          layers.i.mlp.w2_md.weight
    layers.i.mlp.experts.gate_up_proj [E, 2F, H]   layers.i.mlp.experts.w13_weight (interleaved)
    layers.i.mlp.experts.down_proj                 layers.i.mlp.experts.w2_weight
    layers.i.mlp.shared_experts.{gate,up}_proj     layers.i.mlp.shared_experts.shared_w13_weight
    layers.i.mlp.shared_experts.down_proj          layers.i.mlp.shared_experts.shared_w2_weight
    layers.i.mlp.gate.e_score_correction_bias      layers.i.mlp.gate.bias

The hf backend keeps reading the transformers checkpoint; the sglang backend and
`evaluation.serve_check` serve `sglang_layout(target)`, written once beside it and
reused while the source's build key (or weights) are unchanged.

    python -m specforge_dspark.engines.inkling_layout --target .cache/tiny_target
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
from pathlib import Path

import torch

from specforge_dspark.config.command_line import command_parser

SGLANG_ARCH = "InklingForConditionalGeneration"
TRANSFORMERS_ARCH = "InklingForCausalLM"
SUFFIX = "_sglang"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)
RENAMES = (  # transformers name part -> SGLang's (checkpoint) name part, per layer
    (".self_attn.q_proj.", ".attn.wq_du."),
    (".self_attn.k_proj.", ".attn.wk_dv."),
    (".self_attn.v_proj.", ".attn.wv_dv."),
    (".self_attn.r_proj.", ".attn.wr_du."),
    (".self_attn.o_proj.", ".attn.wo_ud."),
    (".self_attn.q_norm.", ".attn.q_norm."),
    (".self_attn.k_norm.", ".attn.k_norm."),
    (".self_attn.k_sconv.conv1d.", ".attn.k_sconv."),
    (".self_attn.v_sconv.conv1d.", ".attn.v_sconv."),
    (".self_attn.rel_logits_proj.", ".attn.rel_logits_proj."),
    (".attn_sconv.conv1d.", ".attn_sconv."),
    (".mlp_sconv.conv1d.", ".mlp_sconv."),
    (".input_layernorm.", ".attn_norm."),
    (".post_attention_layernorm.", ".mlp_norm."),
    (".mlp.down_proj.weight", ".mlp.w2_md.weight"),
    (".mlp.experts.down_proj", ".mlp.experts.w2_weight"),
    (".mlp.shared_experts.down_proj", ".mlp.shared_experts.shared_w2_weight"),
    (".mlp.gate.e_score_correction_bias", ".mlp.gate.bias"),
)
TOP_LEVEL = {
    "model.embed_tokens.weight": "model.llm.embed.weight",
    "model.embed_tokens.embed_norm.weight": "model.llm.embed_norm.weight",
    "model.norm.weight": "model.llm.norm.weight",
    "lm_head.weight": "model.llm.unembed.weight",
}


def is_transformers_inkling(target: Path) -> bool:
    cfg = json.loads((Path(target) / "config.json").read_text())
    return TRANSFORMERS_ARCH in (cfg.get("architectures") or [])


def needs_radix_cache(model: str | Path) -> bool:
    """SGLang's Inkling asserts the radix cache on (`models/inkling.py` ~975); so does any
    model whose config cannot be read here (safe: our plugin keeps feature requests off
    the cache, sglang_plugin.max_prefix_len; turning it off only saves memory)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return True
    return json.loads(path.read_text()).get("model_type") == "inkling_mm_model"


def interleave(gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    """[g0, u0, g1, u1, ...] along `dim` (Inkling's w13 row order, undone by SGLang's
    `deinterleave_gate_up`)."""
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1).contiguous()


def text_config(hf: dict) -> dict:
    """SGLang's InklingModelConfig fields for a transformers InklingTextConfig dict."""
    kinds = hf["mlp_layer_types"]
    dense = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
    if any(kind == "dense" for kind in kinds[dense:]):
        raise ValueError(f"SGLang's Inkling puts dense MLPs first only; got {kinds}")
    keep = (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "d_rel", "rel_extent", "local_layer_ids", "sliding_window_size",
        "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim",
        "rms_norm_eps", "hidden_act", "chain_hidden_post_norm", "n_routed_experts",
        "n_shared_experts", "num_experts_per_tok", "route_scale", "shared_expert_sink",
        "log_scaling_n_floor", "log_scaling_alpha", "logits_mup_width_multiplier",
        "max_position_embeddings", "tie_word_embeddings",
    )  # fmt: skip
    out = {k: hf[k] for k in keep if k in hf}
    out.update(
        model_type="inkling_model",
        vocab_size=hf.get("unpadded_vocab_size") or hf["vocab_size"],
        padded_vocab_size=hf["vocab_size"],
        intermediate_size=hf["moe_intermediate_size"],  # SGLang: the experts' width
        dense_intermediate_size=hf["intermediate_size"],
        dense_mlp_idx=dense,
        use_sconv=True,
        sconv_kernel_size=hf.get("conv_kernel_size", 4),
        use_embed_norm=True,
        use_gate_bias=True,
        use_global_scale=True,
        gate_activation="sigmoid",
        norm_after_topk=True,
        shared_experts_size=1,
        inference_moe_w13_interleaved=True,
    )
    return out


def convert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers InklingForCausalLM tensors -> SGLang's checkpoint tensors."""
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in TOP_LEVEL:
            out[TOP_LEVEL[name]] = tensor
            continue
        if not name.startswith("model.layers."):
            raise ValueError(f"unexpected tensor {name} in an InklingForCausalLM checkpoint")
        new = "model.llm." + name.removeprefix("model.")
        if new.endswith((".mlp.gate_proj.weight", ".mlp.up_proj.weight")) or (
            ".mlp.shared_experts." in new and new.endswith(("gate_proj", "up_proj"))
        ):
            pending[new] = tensor  # paired below
            continue
        if new.endswith(".mlp.experts.gate_up_proj"):  # [E, 2F, H]: [gate; up] -> interleaved
            gate, up = tensor.chunk(2, dim=1)
            out[new.replace("gate_up_proj", "w13_weight")] = interleave(gate, up, dim=1)
            continue
        for old, repl in RENAMES:
            new = new.replace(old, repl)
        out[new] = tensor
    for name in [n for n in pending if n.endswith(("gate_proj.weight", "gate_proj"))]:
        up = pending.pop(name.replace("gate_proj", "up_proj"), None)
        if up is None:
            continue  # reported below
        gate = pending.pop(name)
        if name.endswith(".weight"):  # dense MLP [I, H]
            out[name.replace("gate_proj.weight", "w13_dn.weight")] = interleave(gate, up, 0)
        else:  # shared experts [n, F, H]
            out[name.replace("gate_proj", "shared_w13_weight")] = interleave(gate, up, 1)
    if pending:
        raise ValueError(f"gate/up projections without their pair: {sorted(pending)}")
    return out


def source_key(target: Path) -> str:
    """The source's build key (targets/target.py), else a hash of its config and weights."""
    marker = target / ".build_key"
    if marker.is_file():
        return marker.read_text().strip()
    h = hashlib.sha256((target / "config.json").read_bytes())
    for f in sorted(target.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def sglang_layout(target: str | Path, out: str | Path | None = None, log=print) -> Path:
    """The SGLang-layout copy of a transformers Inkling checkpoint (written on first use,
    reused while the source's key is unchanged); any other checkpoint is returned as is."""
    from safetensors.torch import load_file, save_file

    target = Path(target)
    if not (target / "config.json").is_file() or not is_transformers_inkling(target):
        return target
    out = Path(out) if out is not None else target.with_name(target.name + SUFFIX)
    key = source_key(target)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = out / ".source_key"
        if marker.is_file() and marker.read_text().strip() == key:
            return out
        hf = json.loads((target / "config.json").read_text())
        state: dict[str, torch.Tensor] = {}
        for f in sorted(target.glob("*.safetensors")):
            state.update(load_file(f))
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(convert_state(state), tmp / "model.safetensors", metadata={"format": "pt"})
        root = {
            "architectures": [SGLANG_ARCH],
            "model_type": "inkling_mm_model",
            "text_config": text_config(hf),
            "audio_config": {},
            "vision_config": {},
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "torch_dtype": hf.get("dtype") or hf.get("torch_dtype") or "float32",
        }
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if k in hf:
                root[k] = hf[k]
        (tmp / "config.json").write_text(json.dumps(root, indent=1) + "\n")
        for name in TOKENIZER_FILES:
            if (target / name).is_file():
                shutil.copy2(target / name, tmp / name)
        (tmp / ".source_key").write_text(key)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    log(f"inkling layout: wrote {out} (SGLang's {SGLANG_ARCH}) from {target}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(
        "specforge_dspark.engines.inkling_layout",
        __doc__.split("\n\n")[0],
        "python -m specforge_dspark.engines.inkling_layout --target .cache/tiny_target",
    )
    ap.add_argument("--target", required=True, type=Path, help="transformers Inkling checkpoint")
    ap.add_argument("--out", type=Path, default=None, help=f"default: <target>{SUFFIX}")
    args = ap.parse_args(argv)
    print(sglang_layout(args.target, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
