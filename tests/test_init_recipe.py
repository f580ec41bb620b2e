"""`python -m specforge_dspark.cli.init_recipe`: a recipe for any target from its config.json.

Unit tests write config.json (and minimal tokenizer files) with the public dimensions of
seven targets, generate a recipe and run `train.py --dry-run` on it in-process (the draft is
built on the meta device). The slow test generates recipes for the tiny Qwen3 and Inkling
targets and trains each for 20 steps with two gloo ranks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import train
from specforge_dspark.cli.init_recipe import aux_layer_ids, main
from specforge_dspark.config.recipe import load_recipe
from tests.helpers import DATA_HERE

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")

QWEN_TOKENS = [  # ids 151643.. of the Qwen3 tokenizer (151669 entries, 151936 LM-head rows)
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]  # fmt: skip
QWEN_SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
LLAMA_NAMED = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128004:
               "<|finetune_right_pad_id|>", 128006: "<|start_header_id|>", 128007:
               "<|end_header_id|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>",
               128010: "<|python_tag|>"}  # fmt: skip
HARMONY_NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                 200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>",
                 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
                 200018: "<|endofprompt|>"}  # fmt: skip
DEEPSEEK_NAMED = {0: "<｜begin▁of▁sentence｜>", 1: "<｜end▁of▁sentence｜>", 2: "<｜▁pad▁｜>",
                  128800: "<｜fim▁hole｜>", 128803: "<｜User｜>",
                  128804: "<｜Assistant｜>"}  # fmt: skip
INKLING_LAYERS = ["hybrid" if (k + 1) % 6 == 0 else "hybrid_sliding" for k in range(40)]


def _inkling(text: dict) -> dict:
    """Inkling's multimodal config.json around `text` (transformers' InklingConfig)."""
    text = {"model_type": "inkling_text", "vocab_size": 201024, "unpadded_vocab_size": 200058,
            "logits_mup_width_multiplier": 24.0, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "n_routed_experts": 256,
            "num_experts_per_tok": 6, "n_shared_experts": 2, "tie_word_embeddings": False,
            **text}  # fmt: skip
    return {"architectures": ["InklingForConditionalGeneration"], "model_type": "inkling_mm_model",
            "text_config": text, "image_token_id": 200054, "audio_token_id": 200053,
            "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}  # fmt: skip


# name: (config.json, added tokens by id, tokenizer_config.json)
TARGETS = {
    "qwen3_8b": (
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
         "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
         "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu"},
        dict(enumerate(QWEN_TOKENS, 151643)), QWEN_SPECIAL,
    ),
    "llama31_8b": (
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
         "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
         "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
         "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
        {**{128000 + k: f"<|reserved_special_token_{i}|>" for i, k in enumerate((2, 3, 5))},
         **LLAMA_NAMED,
         **{128011 + k: f"<|reserved_special_token_{k + 3}|>" for k in range(245)}},
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ),
    "qwen3_30b_a3b": (
        {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
         "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
         "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
         "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
         "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
        dict(enumerate(QWEN_TOKENS, 151643)), QWEN_SPECIAL,
    ),
    "gpt_oss_20b": (
        {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
         "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
         "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
         "num_experts_per_tok": 4, "vocab_size": 201088, "max_position_embeddings": 131072,
         "rope_theta": 150000, "sliding_window": 128, "rms_norm_eps": 1e-5,
         "layer_types": ["sliding_attention", "full_attention"] * 12, "tie_word_embeddings": False,
         "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                          "original_max_position_embeddings": 4096, "rope_type": "yarn"}},
        {**{k: f"<|reserved_{k}|>" for k in range(200000, 201088)}, **HARMONY_NAMED},
        {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
    ),
    "deepseek_v3": (
        {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
         "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
         "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
         "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
         "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
         "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
         "vocab_size": 129280, "max_position_embeddings": 163840, "rope_theta": 10000,
         "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
        {**{128000 + k: f"<｜place▁holder▁no▁{k}｜>" for k in range(4)}, **DEEPSEEK_NAMED},
        {"bos_token": DEEPSEEK_NAMED[0], "eos_token": DEEPSEEK_NAMED[1],
         "pad_token": DEEPSEEK_NAMED[2]},
    ),
    "inkling": (  # transformers' InklingTextConfig defaults ("thinkingmachines/Inkling")
        _inkling({"hidden_size": 6144, "num_hidden_layers": 66, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "head_dim": 128, "swa_num_attention_heads": 64,
                  "swa_num_key_value_heads": 16, "swa_head_dim": 128, "intermediate_size": 24576,
                  "moe_intermediate_size": 3072}),
        {199999: "<|endoftext|>", 200005: "<|image_bos|>", 200020: "<|audio_bos|>",
         200053: "<|audio|>", 200054: "<|image|>", 200057: "<|im_end|>"},
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    ),
    "inkling_small": (  # the drafter table's sizes; 40 layers as recipes/inkling_small_nvfp4
        _inkling({"hidden_size": 4096, "num_hidden_layers": 40, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
                  "moe_intermediate_size": 1536, "layer_types": INKLING_LAYERS}),
        {199999: "<|endoftext|>", 200057: "<|im_end|>"},
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    ),
}  # fmt: skip

# name: (aux ids, mask token id, FFN of the draft, heads / KV heads / head_dim)
EXPECTED = {
    "qwen3_8b": ([1, 9, 17, 25, 33], 151662, 12288, (32, 8, 128)),  # <|fim_pad|>
    "llama31_8b": ([1, 8, 15, 22, 29], 128002, 14336, (32, 8, 128)),  # reserved_special_token_0
    "qwen3_30b_a3b": ([1, 12, 23, 34, 45], 151662, 6144, (32, 4, 128)),
    "gpt_oss_20b": ([1, 7, 11, 17, 21], 200000, 3 * 2880, (64, 8, 64)),  # <|reserved_200000|>
    "deepseek_v3": ([1, 15, 30, 44, 58], 128000, 18432, (56, 8, 128)),  # place holder no 0
    "inkling": ([5, 17, 35, 47, 59], 200064, 24576, (64, 8, 128)),  # padded row, as the seed
    "inkling_small": ([5, 11, 23, 29, 35], 200064, 12288, (32, 8, 128)),
}


def _write_target(root: Path, name: str, tokenizer: bool = True) -> Path:
    config, tokens, special = TARGETS[name]
    target = root / name
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    if tokenizer:
        added = [{"id": i, "content": c, "special": True} for i, c in sorted(tokens.items())]
        tok = {"model": {"type": "BPE", "vocab": {}}, "added_tokens": added}
        (target / "tokenizer.json").write_text(json.dumps(tok))
        (target / "tokenizer_config.json").write_text(json.dumps(special))
    return target


def _comments(recipe: Path) -> str:
    """The recipe's comments as one line (notes wrap over several)."""
    lines = recipe.read_text().splitlines()
    return " ".join(ln.strip().lstrip("#").strip() for ln in lines if ln.strip().startswith("#"))


def _init(target: Path, out: Path, *args: str) -> dict:
    """init_recipe, then the dry run on data that exists (the recipe names the files that
    data_pipelines.regenerate makes, which the dry run refuses until they are there)."""
    assert main(["--target", str(target), "--out", str(out), *args]) == 0
    assert train.main(["--recipe", str(out), "--dry-run", *DATA_HERE]) == 0
    return yaml.safe_load(out.read_text())


@pytest.mark.parametrize("name", list(TARGETS))
def test_every_listed_target_gives_a_recipe_that_passes_the_dry_run(tmp_path, name, capsys):
    raw = _init(_write_target(tmp_path, name), tmp_path / f"{name}.yaml", "--gpus", "0")
    ids, mask, ffn, heads = EXPECTED[name]
    config = TARGETS[name][0]
    text = config.get("text_config") or config
    d = raw["draft"]
    assert d["target_layer_ids"] == ids
    assert d["num_target_layers"] == text["num_hidden_layers"]
    assert d["mask_token_id"] == mask
    assert d["vocab_size"] == text["vocab_size"]  # LM-head rows, padded
    assert d["hidden_size"] == text["hidden_size"]
    assert d["intermediate_size"] == ffn
    assert (d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]) == heads
    assert raw["dist"] == {"backend": "gloo", "zero_stage": 2, "precision": "fp32"}
    assert raw["target"]["backend"] == "hf" and raw["target"]["device"] == "cpu"
    assert "trainable_params:" in capsys.readouterr().out


def test_inkling_matches_the_production_seed(tmp_path):
    """Aux ids, mask token, vocab rows, hidden size and RoPE of recipes/inkling_nvfp4.yaml."""
    out = tmp_path / "inkling.yaml"
    raw = _init(_write_target(tmp_path, "inkling"), out, "--gpus", "8")
    seed = load_recipe(REPO / "recipes" / "inkling_nvfp4.yaml").draft
    d = raw["draft"]
    for key in ("target_layer_ids", "num_target_layers", "mask_token_id", "vocab_size",
                "hidden_size", "block_size", "markov_rank", "rope_theta", "num_hidden_layers",
                "max_position_embeddings"):  # fmt: skip
        assert d[key] == getattr(seed, key), key
    text = _comments(out)
    assert "padded LM-head row 200064" in text and "logical vocabulary 200058" in text
    assert "lm_head(h / 24.0)" in text and "before the deferred MLP short conv" in text
    args = raw["target"]["sglang"]["server_args"]
    assert raw["target"]["backend"] == "sglang" and args["tp_size"] == 8
    assert args["quantization"] == "modelopt_fp4" and args["attention_backend"] == "fa4"
    assert raw["dist"] == {
        "backend": "nccl",
        "zero_stage": 2,
        "precision": "bf16",
        "timeout_s": 14400,
    }
    assert raw["train"]["grad_accum"] == 1


def test_inkling_small_with_six_aux_layers_takes_every_full_attention_layer(tmp_path):
    # its seed's [1, 9, 17, 25, 33, 38] follow no pattern of this config (module docstring)
    raw = _init(_write_target(tmp_path, "inkling_small"), tmp_path / "s.yaml", "--aux-layers", "6")
    assert raw["draft"]["target_layer_ids"] == [5, 11, 17, 23, 29, 35]


def test_gpus_size_the_run_and_unverified_taps_stay_on_hf(tmp_path):
    raw = _init(_write_target(tmp_path, "qwen3_8b"), tmp_path / "q.yaml", "--gpus", "2")
    assert raw["target"]["backend"] == "sglang"
    assert raw["target"]["sglang"]["server_args"]["tp_size"] == 2
    assert raw["train"]["grad_accum"] == 4 and raw["dist"]["precision"] == "bf16"
    out = tmp_path / "g.yaml"
    raw = _init(_write_target(tmp_path, "gpt_oss_20b"), out, "--gpus", "8")
    assert raw["target"]["backend"] == "hf" and raw["target"]["device"] == "cuda"
    text = _comments(out)
    assert "not verified" in text and "the hf backend is the known path" in text
    assert "rope type yarn, its scaling copied" in text and "<|reserved_200000|> = 200000" in text
    assert raw["draft"]["rope_scaling"] == {
        "rope_type": "yarn",
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
    }


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_dflash_kinds(tmp_path, kind):
    raw = _init(_write_target(tmp_path, "qwen3_8b"), tmp_path / "d.yaml", "--kind", kind,
                "--gpus", "0")  # fmt: skip
    d = raw["draft"]
    assert d["kind"] == kind and d["block_size"] == 16
    assert d["layer_types"] == ["sliding_attention"] * d["num_hidden_layers"]
    assert raw["objective"]["bce_weight"] == 0.0 and raw["export"]["formats"] == ["sglang"]
    assert raw["objective"]["slot_weighting"] == "dpace"  # the DFlash recipes' D-PACE
    assert (d.get("selector_rank"), d.get("selector_top_k")) == (
        (64, 16) if kind == "dflash2" else (None, None)
    )
    assert "markov_rank" not in d and "enable_confidence_head" not in d


def test_no_tokenizer_names_the_file_or_takes_the_mask_id(tmp_path, capsys):
    target = _write_target(tmp_path, "llama31_8b", tokenizer=False)
    out = tmp_path / "l.yaml"
    assert main(["--target", str(target), "--out", str(out), "--gpus", "0"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err and not out.exists()
    raw = _init(target, out, "--gpus", "0", "--mask-token-id", "128005")
    assert raw["draft"]["mask_token_id"] == 128005
    assert main(["--target", str(target), "--out", str(out), "--mask-token-id", "128256"]) == 2


def test_aux_ids_spread_and_never_tap_the_last_layer():
    assert aux_layer_ids(4, None) == [0, 1, 2]  # the tiny targets' ids
    assert aux_layer_ids(36, None, 3) == [1, 17, 33]
    assert aux_layer_ids(66, {k for k in range(66) if (k + 1) % 6 == 0}) == [5, 17, 35, 47, 59]
    for n in range(2, 80):
        ids = aux_layer_ids(n, None)
        assert ids == sorted(set(ids)) and ids[-1] <= n - 2, n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_generated_recipes_train_the_tiny_targets(tmp_path, tiny_qwen3_dir, tiny_target_dir):
    """A generated recipe trains 20 steps on each tiny target and exports."""
    for name, target in (("qwen3", tiny_qwen3_dir), ("inkling", tiny_target_dir)):
        recipe = tmp_path / f"tiny_{name}.yaml"
        raw = _init(target, recipe, "--gpus", "0")
        assert raw["draft"]["mask_token_id"] == 9  # the tokenizer's <|mask|>
        assert raw["draft"]["target_layer_ids"] == [0, 1, 2]
        out = tmp_path / f"run_{name}"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(_free_port()), "train.py", "--recipe", str(recipe),
            "--resume", "none", f"train.output_dir={out}", "train.max_steps=20",
            "train.log_interval=1", "train.eval_interval=0", "checkpoint.save_interval=20",
            "data.max_rows=64", "data.max_length=160", "objective.num_anchors=16",
            "tracking.enabled=false",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        assert (out / "ckpt" / "step-20").is_dir(), sorted(p.name for p in (out / "ckpt").iterdir())
        assert (out / "export" / "sglang" / "config.json").is_file()
