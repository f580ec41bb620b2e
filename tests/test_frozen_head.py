"""The frozen target embedding and LM head, against transformers' own Inkling model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specforge_dspark.objective.frozen_head import FrozenHead, load_frozen_head


@pytest.fixture(scope="module")
def hf_target(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


def _tensors(target_dir, *names):
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        return {n: f.get_tensor(n) for n in names}


def test_embed_and_logits_match_the_hf_model(tiny_target_dir, hf_target):
    head = load_frozen_head(tiny_target_dir)
    cfg = hf_target.config
    assert (head.vocab_rows, head.hidden_size) == (cfg.vocab_size, cfg.hidden_size) == (1088, 128)
    assert head.logical_vocab == cfg.unpadded_vocab_size == 1024
    assert head.mup_multiplier == cfg.logits_mup_width_multiplier == 4.0
    assert not any(b.requires_grad for b in head.buffers()) and not head.training
    assert list(head.parameters()) == [] and head.state_dict() == {}  # never saved or optimised

    ids = torch.tensor([[1, 9, 300, 1023, 1087]])  # 9 = <|mask|>; 1087 is a padded row
    raw = hf_target.get_input_embeddings()
    # SGLang's DSpark embeds with the RAW table (no embed_norm), see frozen_head.py.
    torch.testing.assert_close(head.embed(ids), raw.weight[ids], rtol=0, atol=0)
    normed = raw(ids)  # transformers' InklingNormedEmbedding applies embed_norm
    assert not torch.allclose(head.embed(ids), normed)

    text = torch.tensor([[1, 3, 200, 201, 57, 900, 4]])
    with torch.no_grad():
        last_hidden = hf_target.model(text).last_hidden_state  # post final norm
        want = hf_target(text).logits
    got = head.logits(last_hidden)
    assert got.shape[-1] == 1088 and want.shape[-1] == 1024
    torch.testing.assert_close(got[..., : head.logical_vocab], want, rtol=1e-5, atol=1e-5)
    # Dividing by the multiplier exactly once is what makes them equal.
    plain = last_hidden @ hf_target.lm_head.weight.T
    torch.testing.assert_close(got, plain / 4.0, rtol=1e-5, atol=1e-5)


def test_sharded_index_loads_the_same_tensors(tiny_target_dir, tmp_path):
    single = load_frozen_head(tiny_target_dir)
    with safe_open(str(tiny_target_dir / "model.safetensors"), framework="pt") as f:
        names = sorted(f.keys())
        tensors = {n: f.get_tensor(n) for n in names}
    shards = {"model-00001-of-00002.safetensors": [], "model-00002-of-00002.safetensors": []}
    for name in names:  # the embedding and the LM head end up in different shards
        shard = "model-00002-of-00002.safetensors" if name == "lm_head.weight" else None
        shards[shard or "model-00001-of-00002.safetensors"].append(name)
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(tmp_path / file))
    weight_map = {n: file for file, members in shards.items() for n in members}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(tiny_target_dir / "config.json", tmp_path / "config.json")
    sharded = load_frozen_head(tmp_path, dtype=torch.bfloat16)
    assert sharded.embed_weight.dtype == torch.bfloat16
    torch.testing.assert_close(sharded.embed_weight, single.embed_weight.bfloat16())
    torch.testing.assert_close(sharded.lm_head_weight, single.lm_head_weight.bfloat16())
    assert (sharded.logical_vocab, sharded.mup_multiplier) == (1024, 4.0)


def _write(dirpath, tensors, config):
    dirpath.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dirpath / "model.safetensors"))
    (dirpath / "config.json").write_text(json.dumps(config))


def test_tied_weights_reuse_the_embedding(tmp_path):
    emb = torch.randn(40, 8)
    _write(
        tmp_path / "flag",
        {"model.embed_tokens.weight": emb, "lm_head.weight": torch.zeros(40, 8)},
        {"tie_word_embeddings": True, "hidden_size": 8},
    )
    _write(tmp_path / "absent", {"model.embed_tokens.weight": emb}, {})
    h = torch.randn(3, 8)
    for name in ("flag", "absent"):
        head = load_frozen_head(tmp_path / name)
        assert head.lm_head_weight.data_ptr() == head.embed_weight.data_ptr()  # one copy
        torch.testing.assert_close(head.logits(h), h @ emb.T)
        assert (head.logical_vocab, head.mup_multiplier) == (40, 1.0)


def test_inkling_raw_names_multimodal_config_and_tokenizer_vocab(tmp_path, tiny_target_dir):
    emb, unemb = torch.randn(1088, 16), torch.randn(1088, 16)
    _write(
        tmp_path,
        {"model.llm.embed.weight": emb, "model.llm.unembed.weight": unemb},
        {"tie_word_embeddings": False, "text_config": {"logits_mup_width_multiplier": 2.0}},
    )
    shutil.copy(tiny_target_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    head = load_frozen_head(tmp_path)
    assert head.logical_vocab == 1024  # tokenizer entries < 1088 LM-head rows
    h = torch.randn(2, 16)
    torch.testing.assert_close(head.logits(h), (h / 2.0) @ unemb.T)
    torch.testing.assert_close(head.embed(torch.tensor([5])), emb[5:6])


def test_shape_mismatch_names_file_and_tensor(tmp_path):
    _write(
        tmp_path,
        {"model.embed_tokens.weight": torch.zeros(40, 8), "lm_head.weight": torch.zeros(40, 6)},
        {"tie_word_embeddings": False},
    )
    with pytest.raises(
        ValueError, match=r"model\.safetensors: lm_head\.weight has shape \[40, 6\]"
    ):
        load_frozen_head(tmp_path)
    _write(
        tmp_path,
        {"model.embed_tokens.weight": torch.zeros(40, 8), "lm_head.weight": torch.zeros(40, 8)},
        {"hidden_size": 8, "vocab_size": 48},
    )
    with pytest.raises(
        ValueError, match=r"model\.embed_tokens\.weight has 40 rows.*vocab_size is 48"
    ):
        load_frozen_head(tmp_path)
    _write(tmp_path, {"model.decoder.weight": torch.zeros(4, 4)}, {})
    with pytest.raises(ValueError, match="no token embedding"):
        load_frozen_head(tmp_path)


def _bf16_head(mup=2.0, cap=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(300, 64, generator=g).bfloat16()
    h = (3.0 * torch.randn(5, 64, generator=g)).bfloat16()
    return FrozenHead(w, w, 300, mup, cap), h


def test_teacher_logits_keep_float32_output_of_a_bf16_head():
    """SGLang's Inkling: bf16 hidden / muP, bf16 head, float32 OUTPUT (no bf16 rounding of
    the logits before the softmax)."""
    head, h = _bf16_head()
    want_z = (h / 2.0).double() @ head.lm_head_weight.double().T  # exact products, float64
    want_p = torch.softmax(want_z, -1)
    z = head.teacher_logits(h)
    assert z.dtype == torch.float32 and z.shape == (5, 300)
    torch.testing.assert_close(z.double(), want_z, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(torch.softmax(z, -1).double(), want_p, rtol=1e-5, atol=1e-7)
    # bf16-rounded logits (the draft's base logits, and the old teacher) are far off
    rounded_p = torch.softmax(head.logits(h).float(), -1).double()
    assert head.logits(h).dtype == torch.bfloat16
    assert not torch.allclose(rounded_p, want_p, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("cap", [5.0, 0.0, -1.0])
def test_final_logit_softcapping_applies_to_the_teacher_only(tmp_path, cap):
    """cap * tanh(z / cap) after the float32 head, read from the config (text_config too);
    SGLang treats 0 or a negative cap as none. The draft's base logits never get it."""
    w, unemb = torch.randn(40, 8), torch.randn(40, 8)
    config = {"text_config": {"logits_mup_width_multiplier": 2.0, "final_logit_softcapping": cap}}
    _write(tmp_path, {"model.llm.embed.weight": w, "model.llm.unembed.weight": unemb}, config)
    head = load_frozen_head(tmp_path)
    h = 4.0 * torch.randn(3, 8)
    z = (h / 2.0) @ unemb.T
    want = cap * torch.tanh(z / cap) if cap > 0 else z
    assert head.logit_softcap == (cap if cap > 0 else None)
    torch.testing.assert_close(head.teacher_logits(h), want)
    torch.testing.assert_close(head.logits(h), z)
    bf16_head, hb = _bf16_head(cap=cap)
    zb = (hb / 2.0).float() @ bf16_head.lm_head_weight.float().T
    want_b = cap * torch.tanh(zb / cap) if cap > 0 else zb
    torch.testing.assert_close(bf16_head.teacher_logits(hb), want_b, rtol=1e-6, atol=1e-5)
