"""The DSpark draft network against independent references (tiny configs, CPU)."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from safetensors import safe_open

from specforge_dspark.config.recipe import DraftRecipe
from specforge_dspark.drafters.dspark import (
    DSPARK_KEYS,
    DSparkConfig,
    DSparkDraft,
    build_visibility_mask,
)
from tests.helpers import TINY_DRAFT


def tiny_config(**over) -> DSparkConfig:
    return DSparkConfig(**{**TINY_DRAFT, **over})


def randomized(cfg: DSparkConfig, seed: int = 0) -> DSparkDraft:
    """A draft whose every parameter (norm weights, Markov W2 included) is random."""
    torch.manual_seed(seed)
    draft = DSparkDraft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return draft


# --------------------------------------------------------------------------- mask


def test_visibility_mask_matches_elementwise_reference():
    g = torch.Generator().manual_seed(1)
    B, N, S, G = 3, 4, 9, 3
    anchors = torch.randint(0, S, (B, N), generator=g)
    block_valid = torch.rand(B, N, generator=g) > 0.3
    ctx_valid = torch.ones(B, S, dtype=torch.bool)
    ctx_valid[1, 6:] = False  # right padding
    ctx_valid[2, :2] = False
    got = build_visibility_mask(anchors, block_valid, ctx_valid, G)
    assert got.shape == (B, N * G, S + N * G) and got.dtype == torch.bool
    for b in range(B):
        for q in range(N * G):
            j = q // G
            for c in range(S):
                want = bool(c < anchors[b, j] and ctx_valid[b, c] and block_valid[b, j])
                assert bool(got[b, q, c]) == want, (b, q, c)
            for k in range(N * G):
                want = bool(k // G == j and block_valid[b, j])
                assert bool(got[b, q, S + k]) == want, (b, q, k)


def test_fully_masked_rows_give_zero_attention_finite_outputs_and_grads():
    draft = randomized(tiny_config())
    B, N, G, S, H = 2, 2, 3, 5, 32
    anchors = torch.tensor([[0, 3], [2, 4]])
    block_valid = torch.tensor([[False, True], [False, False]])  # row 1: nothing visible
    visible = build_visibility_mask(anchors, block_valid, torch.ones(B, S, dtype=torch.bool), G)
    ctx = torch.randn(B, S, H, requires_grad=True)
    emb = torch.randn(B, N, G, H, requires_grad=True)
    pos = anchors[..., None] + torch.arange(G)
    args = (torch.arange(S).expand(B, S), emb, pos, visible)
    h = draft(ctx, *args)
    h.square().sum().backward()
    assert h.isfinite().all() and emb.grad.isfinite().all() and ctx.grad.isfinite().all()
    assert all(p.grad.isfinite().all() for p in draft.parameters() if p.grad is not None)
    # A query that sees nothing must not depend on the context, nor on other tokens.
    h2 = draft(ctx.detach() + 5.0, *args)
    torch.testing.assert_close(h2[1], h[1])
    torch.testing.assert_close(h2[0, 0], h[0, 0])
    assert not torch.allclose(h2[0, 1], h[0, 1])
    # With zero attention output each masked row is a pure MLP residual of its embedding.
    layer_free = emb[1].detach()
    for layer in draft.layers:
        layer_free = layer_free + layer.mlp(layer.post_attention_layernorm(layer_free))
    torch.testing.assert_close(h[1], draft.norm(layer_free))


# --------------------------------------------------------------------------- forward


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope_one(x_nE, pos, theta):
    """Rotate each (i, i + E/2) pair of every head by pos * theta^(-2i/E)."""
    E = x_nE.shape[-1]
    out = x_nE.clone()
    for i in range(E // 2):
        a = pos * theta ** (-2.0 * i / E)
        c, s = math.cos(a), math.sin(a)
        out[:, i] = x_nE[:, i] * c - x_nE[:, i + E // 2] * s
        out[:, i + E // 2] = x_nE[:, i + E // 2] * c + x_nE[:, i] * s
    return out


def naive_forward(draft, ctx, ctx_pos, emb, pos, anchors, block_valid, ctx_valid):
    """float64 reference with explicit loops over batch, block, query and key."""
    cfg = draft.config
    W = {k: v.double() for k, v in draft.state_dict().items()}
    A, C, E, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    B, N, G, H = emb.shape
    S = ctx.shape[1]
    x = emb.double().clone()
    out = torch.zeros(B, N, G, H, dtype=torch.float64)
    for b in range(B):
        for j in range(N):
            xb = x[b, j].clone()  # [G, H]: a block only ever reads itself and the context
            for i in range(cfg.num_hidden_layers):
                p = f"layers.{i}."
                w = lambda n, p=p: W[p + n]
                hn = _rms(xb, w("input_layernorm.weight"), eps)

                def keys(src, positions, w=w):
                    k = (src @ w("self_attn.k_proj.weight").T).view(-1, C, E)
                    k = _rms(k, w("self_attn.k_norm.weight"), eps)
                    k = torch.stack(
                        [_rope_one(k[t], positions[t], cfg.rope_theta) for t in range(len(src))]
                    )
                    return k, (src @ w("self_attn.v_proj.weight").T).view(-1, C, E)

                kc, vc = keys(ctx[b].double(), [float(t) for t in ctx_pos[b]])
                kb, vb = keys(hn, [float(t) for t in pos[b, j]])
                attn = torch.zeros(G, A * E, dtype=torch.float64)
                for g in range(G):
                    q = (hn[g] @ w("self_attn.q_proj.weight").T).view(A, E)
                    q = _rope_one(
                        _rms(q, w("self_attn.q_norm.weight"), eps),
                        float(pos[b, j, g]),
                        cfg.rope_theta,
                    )
                    for a in range(A):
                        kv = a // (A // C)
                        cand = [
                            (kc[c, kv], vc[c, kv])
                            for c in range(S)
                            if c < anchors[b, j] and ctx_valid[b, c]
                        ]
                        cand += [(kb[t, kv], vb[t, kv]) for t in range(G)]
                        if not block_valid[b, j]:
                            cand = []
                        if not cand:
                            continue
                        scores = torch.stack([q[a] @ k for k, _ in cand]) / math.sqrt(E)
                        probs = torch.softmax(scores, 0)
                        attn[g, a * E : (a + 1) * E] = sum(
                            pr * v for pr, (_, v) in zip(probs, cand, strict=True)
                        )
                xb = xb + attn @ w("self_attn.o_proj.weight").T
                hn = _rms(xb, w("post_attention_layernorm.weight"), eps)
                gate = hn @ w("mlp.gate_proj.weight").T
                up = hn @ w("mlp.up_proj.weight").T
                xb = xb + (gate * torch.sigmoid(gate) * up) @ w("mlp.down_proj.weight").T
            out[b, j] = _rms(xb, W["norm.weight"], eps)
    return out


def test_forward_matches_naive_reference_with_gqa():
    cfg = tiny_config()
    draft = randomized(cfg).double()
    B, N, G, S, H = 2, 3, cfg.block_size, 6, cfg.hidden_size
    g = torch.Generator().manual_seed(3)
    anchors = torch.tensor([[0, 3, 5], [1, 4, 2]])
    block_valid = torch.tensor([[True, True, False], [True, True, True]])
    ctx_valid = torch.ones(B, S, dtype=torch.bool)
    ctx_valid[1, 1] = False
    aux = torch.randn(B, S, 2 * H, generator=g, dtype=torch.float64)
    ctx = draft.context(aux)
    torch.testing.assert_close(
        ctx, _rms(aux @ draft.fc.weight.T, draft.hidden_norm.weight, cfg.rms_norm_eps)
    )
    ctx_pos = torch.arange(S).expand(B, S) + torch.tensor([[0], [3]])  # any absolute positions
    emb = torch.randn(B, N, G, H, generator=g, dtype=torch.float64)
    pos = anchors[..., None] + torch.arange(G) + torch.tensor([0, 3])[:, None, None]
    visible = build_visibility_mask(anchors, block_valid, ctx_valid, G)
    got = draft(ctx, ctx_pos, emb, pos, visible)
    want = naive_forward(draft, ctx.detach(), ctx_pos, emb, pos, anchors, block_valid, ctx_valid)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_forward_rejects_a_mask_of_the_wrong_shape():
    draft = DSparkDraft(tiny_config())
    with pytest.raises(ValueError, match="visible_BQK"):
        draft(
            torch.zeros(1, 4, 32),
            torch.arange(4)[None],
            torch.zeros(1, 1, 3, 32),
            torch.arange(3)[None, None],
            torch.ones(1, 3, 4, dtype=torch.bool),
        )


# --------------------------------------------------------------------------- heads


def test_apply_heads_vanilla_is_w2_w1_prev_plus_base_and_confidence_on_h_and_w1():
    draft = randomized(tiny_config())
    B, N, G, H, V = 2, 3, 3, 32, 40  # 40 < vocab_size 50: the bias is cropped to the base logits
    h = torch.randn(B, N, G, H)
    base = torch.randn(B, N, G, V)
    prev = torch.randint(0, 50, (B, N, G))
    logits, conf = draft.apply_heads(h, base, prev)
    W1, W2 = draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight
    torch.testing.assert_close(logits, base + (W1[prev] @ W2.T)[..., :V])
    proj = draft.confidence_head.proj
    want_conf = torch.cat((h, W1[prev]), -1) @ proj.weight[0] + proj.bias[0]
    assert conf.shape == (B, N, G)
    torch.testing.assert_close(conf, want_conf)


def test_apply_heads_confidence_variants():
    h, base = torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3, 50)
    prev = torch.randint(0, 50, (1, 2, 3))
    without = randomized(tiny_config(confidence_head_with_markov=False))
    proj = without.confidence_head.proj
    assert proj.in_features == 32
    torch.testing.assert_close(
        without.apply_heads(h, base, prev)[1], h @ proj.weight[0] + proj.bias[0]
    )
    assert (
        randomized(tiny_config(enable_confidence_head=False)).apply_heads(h, base, prev)[1] is None
    )
    with pytest.raises(ValueError, match="vocab_size"):
        without.apply_heads(h, torch.randn(1, 2, 3, 51), prev)


def test_apply_heads_gated_follows_sglang_formula():
    draft = randomized(tiny_config(markov_head_type="gated"))
    mh = draft.markov_head
    assert tuple(mh.gate_proj.weight.shape) == (6, 32 + 6) and mh.gate_proj.bias is not None
    h, base = torch.randn(2, 2, 3, 32), torch.randn(2, 2, 3, 50)
    prev = torch.randint(0, 50, (2, 2, 3))
    logits, conf = draft.apply_heads(h, base, prev)
    e = mh.markov_w1.weight[prev]
    # sglang GatedMarkovHead.step_bias: W2(sigmoid(gate_proj([h ; e])) * e)
    gate = torch.sigmoid(torch.cat((h, e), -1) @ mh.gate_proj.weight.T + mh.gate_proj.bias)
    torch.testing.assert_close(logits, base + (gate * e) @ mh.markov_w2.weight.T)
    assert conf.shape == (2, 2, 3)


def test_apply_heads_rnn_follows_sglang_recurrence():
    draft = randomized(tiny_config(markov_head_type="rnn"))
    mh = draft.markov_head
    R, H = 6, 32
    assert tuple(mh.joint_proj.weight.shape) == (3 * R, 2 * R + H)
    h, base = torch.randn(2, 2, 3, H), torch.randn(2, 2, 3, 50)
    prev = torch.randint(0, 50, (2, 2, 3))
    logits, conf = draft.apply_heads(h, base, prev)
    # sglang RNNHead: state 0 at slot 0; z = [state ; e ; h]; gate/cand/out chunks of joint_proj.
    want = torch.empty_like(logits)
    for b in range(2):
        for n in range(2):
            state = torch.zeros(R)
            for k in range(3):
                z = torch.cat((state, mh.markov_w1.weight[prev[b, n, k]], h[b, n, k]))
                raw = mh.joint_proj.weight @ z + mh.joint_proj.bias
                gate, cand, out = torch.sigmoid(raw[:R]), torch.tanh(raw[R : 2 * R]), raw[2 * R :]
                want[b, n, k] = base[b, n, k] + mh.markov_w2.weight @ torch.tanh(out)
                state = gate * state + (1 - gate) * cand
    torch.testing.assert_close(logits, want)
    assert conf.shape == (2, 2, 3)


# --------------------------------------------------------------------------- propose


def test_propose_slot_convention_and_sequential_markov():
    """Slot k drafts the token after the bonus's k-th successor; prev of slot 0 = bonus."""
    V, G, H = 12, 4, 32
    draft = randomized(tiny_config(vocab_size=V, markov_rank=V, block_size=G, mask_token_id=11))
    # Markov head: W1 = identity, W2 = shift, so the bias favours prev + 1 with weight 10.
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.copy_(torch.eye(V))
        draft.markov_head.markov_w2.weight.copy_(10.0 * torch.roll(torch.eye(V), 1, dims=0))
    calls = {}
    real_forward = draft.forward

    def spy_forward(ctx, ctx_pos, emb, pos, visible):
        calls.update(ctx_len=ctx.shape[1], ctx_pos=ctx_pos, pos=pos, visible=visible)
        return real_forward(ctx, ctx_pos, emb, pos, visible)

    draft.forward = spy_forward
    embedded = []

    def embed_fn(ids):
        embedded.append(ids.clone())
        return torch.randn(len(ids), H)

    base_logits = torch.zeros(G, V - 2)  # logical vocab: columns 10 and 11 are padded rows
    ctx = torch.randn(1, 9, H)
    tokens, conf = draft.propose(ctx, 6, 3, embed_fn, lambda h: base_logits.clone())
    assert embedded[0].tolist() == [3, 11, 11, 11]  # [bonus, MASK * (G-1)]
    assert calls["ctx_len"] == 6 and calls["ctx_pos"].tolist() == [list(range(6))]
    assert calls["pos"].tolist() == [[[6, 7, 8, 9]]]  # positions ctx_len .. ctx_len+G-1
    assert calls["visible"][0, :, :6].all() and calls["visible"][0, :, 6:].all()
    assert tokens.tolist() == [4, 5, 6, 7]  # bonus + 1, then sequential prev + 1
    assert conf.shape == (G,)
    # Base logits decide when they dominate; the padded rows 10, 11 are never drafted.
    strong = torch.full((G, V - 2), -50.0)
    strong[torch.arange(G), torch.tensor([2, 0, 9, 5])] = 50.0
    tokens, _ = draft.propose(ctx, 6, 9, embed_fn, lambda h: strong.clone())
    assert tokens.tolist() == [2, 0, 9, 5]
    tokens, _ = draft.propose(ctx, 6, 9, embed_fn, lambda h: torch.zeros(G, V - 2))
    assert tokens.tolist() == [0, 1, 2, 3]  # 9 + 1 = 10 is padded: argmax stays in 0..9


def test_propose_confidence_uses_prev_bonus_then_drafts():
    V, G, H = 12, 3, 32
    draft = randomized(tiny_config(vocab_size=V, block_size=G, mask_token_id=1))
    emb_table = torch.randn(V, H)
    ctx = torch.randn(1, 5, H)
    logits_table = torch.randn(H, V)
    tokens, conf = draft.propose(ctx, 5, 4, lambda ids: emb_table[ids], lambda h: h @ logits_table)
    visible = build_visibility_mask(
        torch.tensor([[5]]),
        torch.ones(1, 1, dtype=torch.bool),
        torch.ones(1, 5, dtype=torch.bool),
        G,
    )
    ids = torch.tensor([4, 1, 1])
    h = draft(
        ctx,
        torch.arange(5)[None],
        emb_table[ids][None, None],
        (5 + torch.arange(G))[None, None],
        visible,
    )
    prev = torch.cat((torch.tensor([[[4]]]), tokens[None, None, :-1]), -1)
    logits, want_conf = draft.apply_heads(h, h @ logits_table, prev)
    assert (
        tokens.tolist() == logits[0, 0].argmax(-1).tolist()
    )  # greedy = teacher forced on own drafts
    torch.testing.assert_close(conf, want_conf[0, 0])


# --------------------------------------------------------------------------- config


INKLING = dict(
    hidden_size=6144,
    num_hidden_layers=5,
    num_attention_heads=64,
    num_key_value_heads=16,
    head_dim=64,
    intermediate_size=12288,
    hidden_act="silu",
    rope_theta=8e6,
    vocab_size=201024,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
)
INKLING_DSPARK = dict(
    block_size=7,
    target_layer_ids=[5, 17, 35, 47, 59],
    num_target_layers=66,
    mask_token_id=200064,
    markov_rank=256,
    markov_head_type="vanilla",
    enable_confidence_head=True,
    confidence_head_with_markov=True,
    layer_types=["full_attention"] * 5,
)


def test_config_round_trip_and_sglang_layout():
    cfg = tiny_config(markov_head_type="rnn", confidence_head_with_markov=False)
    d = cfg.to_dict()
    assert DSparkConfig.from_dict(json.loads(json.dumps(d))) == cfg
    assert d["architectures"] == ["Qwen3DSparkModel"] and d["model_type"] == "qwen3"
    assert d["tie_word_embeddings"] is False
    assert "auto_map" not in d and "speculators_model_type" not in d
    for key in DSPARK_KEYS:
        assert d[key] == d["dflash_config"][key] == getattr(cfg, key), key
    assert d["layer_types"] == ["full_attention", "full_attention"]


def test_published_inkling_config_with_keys_only_in_dflash_config():
    d = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        **INKLING,
        "dflash_config": dict(INKLING_DSPARK),
    }
    cfg = DSparkConfig.from_dict(d)
    assert cfg == DSparkConfig(**INKLING, **INKLING_DSPARK)
    assert cfg.to_dict()["markov_rank"] == 256  # re-exported with the root keys SGLang needs


def test_published_config_with_root_keys_and_defaults():
    d = {
        **INKLING,
        **INKLING_DSPARK,
        "rope_parameters": {"rope_type": "default", "rope_theta": 8e6},
    }
    for key in ("num_key_value_heads", "head_dim", "enable_confidence_head", "layer_types"):
        del d[key]
    del d["rope_theta"]
    cfg = DSparkConfig.from_dict(d)
    assert cfg.rope_theta == 8e6
    assert cfg.num_key_value_heads == 64 and cfg.head_dim == 6144 // 64
    assert cfg.enable_confidence_head and cfg.layer_types == ["full_attention"] * 5
    d2 = {**INKLING, **INKLING_DSPARK, "dflash_config": {"block_size": 16}}
    with pytest.warns(UserWarning, match="block_size"):
        assert DSparkConfig.from_dict(d2).block_size == 7  # the root wins


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_key_value_heads=24), "num_key_value_heads"),
        (dict(mask_token_id=201024), "mask_token_id"),
        (dict(markov_head_type="lstm"), "markov_head_type"),
        (dict(target_layer_ids=[5, 66]), "target_layer_ids"),
        (dict(head_dim=63), "head_dim"),
        (dict(sample_from_anchor=False), "sample_from_anchor"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
        (dict(layer_types=["sliding_attention"] * 5), "layer_types"),
        (dict(mask_token_id=None), "mask_token_id"),
    ],
)
def test_config_errors_name_the_field(change, message):
    d = {**INKLING, **INKLING_DSPARK, **change}
    with pytest.raises(ValueError, match=message):
        DSparkConfig.from_dict(d)


def test_from_recipe_copies_fields_by_name():
    recipe = DraftRecipe(hidden_size=64, markov_head_type="gated", target_layer_ids=[0, 1, 2])
    cfg = DSparkConfig.from_recipe(recipe)
    for name in ("hidden_size", "num_key_value_heads", "rope_theta", "block_size", "markov_rank"):
        assert getattr(cfg, name) == getattr(recipe, name)
    assert cfg.markov_head_type == "gated" and cfg.target_layer_ids == [0, 1, 2]
    assert cfg.layer_types == ["full_attention"] * recipe.num_hidden_layers


# --------------------------------------------------------------------------- files


def expected_tensors(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of DSPARK_SPEC.md section 6, written out independently."""
    H, A, C, E, F = 32, 4, 2, 8, 48
    V, R = cfg.vocab_size, cfg.markov_rank
    out = {
        "fc.weight": (H, 2 * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
        "markov_head.markov_w1.weight": (V, R),
        "markov_head.markov_w2.weight": (V, R),
        "confidence_head.proj.weight": (1, H + R),
        "confidence_head.proj.bias": (1,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (A * E, H),
            p + "self_attn.k_proj.weight": (C * E, H),
            p + "self_attn.v_proj.weight": (C * E, H),
            p + "self_attn.o_proj.weight": (H, A * E),
            p + "self_attn.q_norm.weight": (E,),
            p + "self_attn.k_norm.weight": (E,),
            p + "mlp.gate_proj.weight": (F, H),
            p + "mlp.up_proj.weight": (F, H),
            p + "mlp.down_proj.weight": (H, F),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
        }
    return out


def test_save_load_round_trip_names_shapes_and_dtype(tmp_path):
    cfg = tiny_config()
    draft = randomized(cfg)
    draft.save_pretrained(tmp_path / "fp32", dtype=torch.float32)
    draft.save_pretrained(tmp_path / "bf16")
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert shapes == expected_tensors(cfg)
    saved = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert saved["dtype"] == "bfloat16" and saved["markov_rank"] == cfg.markov_rank
    loaded = DSparkDraft.from_pretrained(tmp_path / "fp32")
    assert loaded.config == cfg
    B, N, G, S = 1, 2, 3, 4
    aux, emb = torch.randn(B, S, 64), torch.randn(B, N, G, 32)
    anchors = torch.tensor([[1, 3]])
    vis = build_visibility_mask(
        anchors, torch.ones(B, N, dtype=torch.bool), torch.ones(B, S, dtype=torch.bool), G
    )
    args = (torch.arange(S)[None], emb, anchors[..., None] + torch.arange(G), vis)
    h = draft(draft.context(aux), *args)
    torch.testing.assert_close(loaded(loaded.context(aux), *args), h, rtol=0, atol=0)
    prev, base = torch.randint(0, 50, (B, N, G)), torch.randn(B, N, G, 50)
    got_logits, got_conf = loaded.apply_heads(h, base, prev)
    want_logits, want_conf = draft.apply_heads(h, base, prev)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
    torch.testing.assert_close(got_conf, want_conf, rtol=0, atol=0)
    bf16 = DSparkDraft.from_pretrained(tmp_path / "bf16")
    torch.testing.assert_close(bf16.fc.weight, draft.fc.weight.bfloat16().float())
    assert all(p.requires_grad for p in loaded.parameters())


def test_from_pretrained_names_a_bad_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    draft = DSparkDraft(tiny_config())
    draft.save_pretrained(tmp_path, dtype=torch.float32)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = torch.zeros(50, 32)  # skipped, as SGLang does
    tensors["layers.0.mlp.up_proj.weight"] = torch.zeros(47, 32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.weight has shape \(47, 32\)"):
        DSparkDraft.from_pretrained(tmp_path)
    del tensors["layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors \['layers\.0\.mlp\.up_proj\.weight'\]"):
        DSparkDraft.from_pretrained(tmp_path)


def test_production_parameter_count_on_meta():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = DSparkConfig(**INKLING, **INKLING_DSPARK)
    with torch.device("meta"):
        draft = DSparkDraft(cfg)
    assert sum(p.numel() for p in draft.parameters() if p.requires_grad) == 1_738_783_617
    # The seed card's 1.93B differs by exactly fc (5 * 6144 -> 6144).
    assert draft.fc.weight.numel() == 188_743_680
