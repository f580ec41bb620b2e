"""Our exported drafter against SGLang 0.5.23's own code, run on CPU.

SGLang's config parser reads our config.json; its `Qwen3DSparkModel` is built from that
config, loads our model.safetensors with its own `load_weights`, and its layers (norms,
fused projections, RoPE, SiluAndMul, Markov and confidence heads) recompute our draft's
outputs. Only the attention kernel (RadixAttention needs a GPU pool) is replaced by an
explicit softmax over the keys SGLang's DSpark worker writes: the context positions before
the anchor (`write_target_hidden_kv`) and the block itself (non-causal "full_attention").
"""

from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import load_file

from specforge_dspark.drafters.dspark import DSparkConfig, DSparkDraft, build_visibility_mask

from .helpers import TINY_DRAFT
from .sglang_shim import SglangUnavailable, import_sglang

A, C, E, H = 4, 2, 8, 32


@pytest.fixture(scope="module")
def sgl():
    try:
        return types.SimpleNamespace(
            config=import_sglang("sglang.srt.speculative.dspark_components.dspark_config"),
            dspark=import_sglang("sglang.srt.models.dspark"),
            rope_base=import_sglang("sglang.srt.layers.rotary_embedding.base"),
            runtime=import_sglang("sglang.srt.runtime_context"),
            hf_utils=import_sglang("sglang.srt.utils.hf_transformers_utils"),
        )
    except SglangUnavailable as e:  # make setup installs it: a broken install fails
        pytest.fail(str(e))


def tiny_config(markov_head_type: str = "vanilla") -> DSparkConfig:
    cfg = DSparkConfig(**{**TINY_DRAFT, "markov_head_type": markov_head_type})
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (H, A, C)
    return cfg


def exported(tmp_path, markov_head_type: str) -> DSparkDraft:
    torch.manual_seed(0)
    draft = DSparkDraft(tiny_config(markov_head_type))
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    draft.save_pretrained(tmp_path, dtype=torch.float32)
    return draft


def sglang_model(sgl, path, monkeypatch):
    """SGLang's Qwen3DSparkModel for `path`, built as its loader would, with our weights."""
    # CPU: skip RotaryEmbedding's vllm-kernel import (we call forward_native); build the
    # confidence head, which SGLang builds only outside the default static verify mode.
    monkeypatch.setattr(sgl.rope_base, "_is_cpu", True)
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "cap-accept")
    config = sgl.hf_utils.get_config(str(path), trust_remote_code=False)
    with sgl.runtime.get_parallel().override(tp_size=1, tp_rank=0):
        model = sgl.dspark.Qwen3DSparkModel(config)
    model.load_weights(iter(load_file(str(path / "model.safetensors")).items()))
    return model, config


def test_sglang_parses_our_config(sgl, tmp_path):
    cfg = tiny_config("gated")
    draft = DSparkDraft(cfg)
    draft.save_pretrained(tmp_path)
    config = sgl.hf_utils.get_config(str(tmp_path), trust_remote_code=False)
    for source in (cfg.to_dict(), config):
        parsed = sgl.config.parse_dspark_draft_config(draft_hf_config=source)
        assert parsed.gamma == cfg.block_size
        assert parsed.target_layer_ids == cfg.target_layer_ids
        assert parsed.num_target_layers == cfg.num_target_layers
        assert parsed.num_hidden_layers == cfg.num_hidden_layers
        assert parsed.mask_token_id == cfg.mask_token_id
        assert (parsed.markov_rank, parsed.markov_head_type) == (6, "gated")
        assert sgl.config.get_dspark_sample_from_anchor(source) is True
    runtime = sgl.config.resolve_runtime_config(
        draft_hf_config=config, speculative_num_draft_tokens=None, target_vocab_size=50
    )
    assert (runtime.gamma, runtime.verify_num_draft_tokens, runtime.mask_token_id) == (3, 4, 7)
    assert config.rope_parameters["rope_theta"] == 500.0 and config.tie_word_embeddings is False


@pytest.mark.parametrize("markov_head_type", ["vanilla", "gated", "rnn"])
def test_sglang_loads_every_tensor_by_name_and_shape(sgl, tmp_path, monkeypatch, markov_head_type):
    draft = exported(tmp_path, markov_head_type)
    model, _ = sglang_model(sgl, tmp_path, monkeypatch)
    assert (
        type(model.markov_head).__name__
        == {
            "vanilla": "VanillaMarkov",
            "gated": "GatedMarkovHead",
            "rnn": "RNNHead",
        }[markov_head_type]
    )
    # SGLang's parameters, with its fused projections split back into checkpoint names
    # (DFlashDraftModel.load_weights' stacked_params_mapping).
    expected = {}
    for name, param in model.named_parameters():
        if ".qkv_proj." in name:
            attn = model.get_submodule(name.rsplit(".", 2)[0])
            sizes = {"q_proj": attn.q_size, "k_proj": attn.kv_size, "v_proj": attn.kv_size}
            for part, rows in sizes.items():
                expected[name.replace("qkv_proj", part)] = (rows, param.shape[1])
        elif ".gate_up_proj." in name:
            for part in ("gate_proj", "up_proj"):
                expected[name.replace("gate_up_proj", part)] = (param.shape[0] // 2, param.shape[1])
        else:
            expected[name] = tuple(param.shape)
    ours = {k: tuple(v.shape) for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    assert ours == expected
    # ...and the values landed where our modules have them.
    sg = dict(model.named_parameters())
    mine = draft.state_dict()
    for name, param in sg.items():
        if ".qkv_proj." in name:
            parts = [mine[name.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            torch.testing.assert_close(param, torch.cat(parts), rtol=0, atol=0)
        elif ".gate_up_proj." in name:
            parts = [mine[name.replace("gate_up_proj", p)] for p in ("gate_proj", "up_proj")]
            torch.testing.assert_close(param, torch.cat(parts), rtol=0, atol=0)
        else:
            torch.testing.assert_close(param, mine[name], rtol=0, atol=0)


def row_parallel(linear, x):
    """A RowParallelLinear's matmul at TP 1 (its forward wants a live TP process group)."""
    return linear.quant_method.apply(linear, x, bias=None)


def sglang_block(model, ctx_SH, anchor, emb_GH):
    """SGLang's layers on one block at positions anchor.., context 0..anchor-1."""
    G = emb_GH.shape[0]
    pos_ctx, pos_blk = torch.arange(anchor), anchor + torch.arange(G)
    x = emb_GH
    for layer in model.layers:
        attn = layer.self_attn
        rope = attn.rotary_emb
        k_ctx, v_ctx = attn.kv_proj_only(ctx_SH)  # KV injection: no input_layernorm
        k_ctx = rope.forward_native(pos_ctx, k_ctx.clone(), attn.apply_k_norm(k_ctx))[1]
        h = layer.input_layernorm(x)
        q, k, v = attn.qkv_proj(h)[0].split([attn.q_size, attn.kv_size, attn.kv_size], -1)
        q = attn.q_norm(q.reshape(-1, E)).view_as(q)
        q, k = rope.forward_native(pos_blk, q, attn.apply_k_norm(k))
        keys = torch.cat((k_ctx, k)).view(-1, C, E).repeat_interleave(A // C, 1)
        values = torch.cat((v_ctx, v)).view(-1, C, E).repeat_interleave(A // C, 1)
        scores = torch.einsum("gae,kae->agk", q.view(G, A, E), keys) * attn.scaling
        out = torch.einsum("agk,kae->gae", scores.softmax(-1), values).reshape(G, A * E)
        x = x + row_parallel(attn.o_proj, out)
        h = layer.post_attention_layernorm(x)
        x = x + row_parallel(layer.mlp.down_proj, layer.mlp.act_fn(layer.mlp.gate_up_proj(h)[0]))
    return model.norm(x)


@pytest.mark.parametrize("markov_head_type", ["vanilla", "gated", "rnn"])
def test_sglang_layers_reproduce_our_outputs(sgl, tmp_path, monkeypatch, markov_head_type):
    draft = exported(tmp_path, markov_head_type)
    model, _ = sglang_model(sgl, tmp_path, monkeypatch)
    g = torch.Generator().manual_seed(2)
    S, G, anchors = 8, 3, [5, 2]
    aux = torch.randn(S, 2 * H, generator=g)
    emb = torch.randn(1, 2, G, H, generator=g)
    with torch.no_grad():
        ctx = draft.context(aux[None])
        torch.testing.assert_close(ctx[0], model.project_target_hidden(aux))
        anchors_BN = torch.tensor([anchors])
        visible = build_visibility_mask(
            anchors_BN, torch.ones(1, 2, dtype=torch.bool), torch.ones(1, S, dtype=torch.bool), G
        )
        pos = anchors_BN[..., None] + torch.arange(G)
        h = draft(ctx, torch.arange(S)[None], emb, pos, visible)
        for j, a in enumerate(anchors):
            want = sglang_block(model, ctx[0, :a], a, emb[0, j])
            torch.testing.assert_close(h[0, j], want, rtol=1e-5, atol=1e-5)

        prev = torch.randint(0, 50, (1, 2, G), generator=g)
        base = torch.randn(1, 2, G, 50, generator=g)
        logits, conf = draft.apply_heads(h, base, prev)
        head = model.markov_head
        for j in range(2):  # SGLang's step-by-step Markov loop, teacher forced
            state = head.init_state(h[0, j, :1])
            for k in range(G):
                bias, state = head.step_bias(
                    prev[0, j, k : k + 1], hidden_states=h[0, j, k : k + 1], state=state
                )
                torch.testing.assert_close(logits[0, j, k], base[0, j, k] + bias[0])
        want_conf = model.confidence_head(h, head.get_prev_embeddings(prev))
        torch.testing.assert_close(conf, want_conf)
