"""Serving export (DSPARK_SPEC.md section 6) checked against the installed SGLang and
speculators code: their config parsing, the parameters their DSpark models build, their
weight loaders, and (speculators) its own forward pass against ours."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specforge_dspark.cli.export import main
from specforge_dspark.config.recipe import DraftRecipe, Recipe, resolved_dirs
from specforge_dspark.drafters.conventions import CONVENTIONS_KEY, ConventionsError
from specforge_dspark.drafters.dspark import (
    DSPARK_KEYS,
    DSparkConfig,
    DSparkDraft,
    build_visibility_mask,
)
from specforge_dspark.export import ExportError
from specforge_dspark.export.conventions import check_conventions
from specforge_dspark.export.dispatch import export_checkpoint
from specforge_dspark.export.dspark import export_draft
from specforge_dspark.objective.blocks import build_blocks
from specforge_dspark.objective.frozen_head import FrozenHead, load_frozen_head
from tests.helpers import TINY_DRAFT
from tests.sglang_shim import import_sglang

TINY = {**TINY_DRAFT, "vocab_size": 72, "mask_token_id": 65}  # mask in a padded row


def trained(cfg: DSparkConfig, seed: int = 0) -> DSparkDraft:
    """A draft with every parameter moved off its init (Markov W2 and norms included)."""
    torch.manual_seed(seed)
    draft = DSparkDraft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return draft


def random_head(cfg: DSparkConfig, logical: int, mup: float) -> FrozenHead:
    g = torch.Generator().manual_seed(7)
    H, V = cfg.hidden_size, cfg.vocab_size
    return FrozenHead(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g), logical, mup)


def bf16_rounded(draft: DSparkDraft) -> DSparkDraft:
    copy = DSparkDraft(draft.config)
    copy.load_state_dict({k: v.bfloat16().float() for k, v in draft.state_dict().items()})
    return copy


def our_logits(draft, head, aux_1SD, ids_1S, anchors_1N, vocab: int | None = None):
    """Teacher-forced draft logits and confidence, as in training: over all LM-head rows,
    or over the first `vocab` columns."""
    S, N, G = ids_1S.shape[1], anchors_1N.shape[1], draft.config.block_size
    valid = torch.ones(1, N, dtype=torch.bool)
    blocks = build_blocks(
        ids_1S, torch.ones_like(ids_1S), anchors_1N, valid, G, draft.config.mask_token_id, 4.0
    )
    visible = build_visibility_mask(anchors_1N, valid, torch.ones(1, S, dtype=torch.bool), G)
    with torch.no_grad():
        ctx = draft.context(aux_1SD)
        h = draft(ctx, torch.arange(S)[None], head.embed(blocks.ids_BNG), blocks.pos_BNG, visible)
        base = head.logits(h)[..., :vocab]
        return draft.apply_heads(h, base, blocks.prev_BNG)


def inputs(cfg: DSparkConfig, S: int, anchors: list[int], seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, S, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    ids = torch.randint(0, 60, (1, S), generator=g)
    return aux, ids, torch.tensor([anchors])


def sglang(name: str):
    """SGLang is installed by `make setup` and imports here: a failure is a failure."""
    return import_sglang(name)


# --------------------------------------------------------------------------- SGLang


def test_sglang_config_passes_sglangs_own_parsing(tmp_path):
    cfg = DSparkConfig(**TINY)
    out = export_draft(trained(cfg), cfg, tmp_path / "sglang", "sglang")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["model_type"] == "qwen3"
    assert raw["tie_word_embeddings"] is False
    assert "auto_map" not in raw and "speculators_model_type" not in raw
    for key in DSPARK_KEYS:  # at the root (the head builders read it) and mirrored
        assert raw[key] == raw["dflash_config"][key], key

    hf_config = sglang("sglang.srt.utils.hf_transformers.config").get_config(
        str(out), trust_remote_code=False
    )
    spec = sglang("sglang.srt.speculative.dspark_components.dspark_config")
    parsed = spec.parse_dspark_draft_config(draft_hf_config=hf_config)
    assert parsed.gamma == cfg.block_size
    assert parsed.target_layer_ids == cfg.target_layer_ids
    assert parsed.num_target_layers == cfg.num_target_layers
    assert parsed.num_hidden_layers == cfg.num_hidden_layers
    assert parsed.mask_token_id == cfg.mask_token_id
    assert (parsed.markov_rank, parsed.markov_head_type) == (cfg.markov_rank, "vanilla")
    assert spec.get_dspark_sample_from_anchor(hf_config) is True
    runtime = spec.resolve_runtime_config(
        draft_hf_config=hf_config, speculative_num_draft_tokens=None, target_vocab_size=72
    )
    assert (runtime.gamma, runtime.mask_token_id) == (cfg.block_size, cfg.mask_token_id)


def _sglang_model(hf_config, monkeypatch, ragged_mode: str):
    """SGLang's own Qwen3DSparkModel on CPU, TP 1 (real construction, real parameters)."""
    dspark = sglang("sglang.srt.models.dspark")
    rope = sglang("sglang.srt.layers.rotary_embedding.base")
    parallel = sglang("sglang.srt.runtime_context").get_parallel()
    # RoPE picks a vllm custom op off CUDA unless it believes it runs SGLang's CPU engine.
    monkeypatch.setattr(rope, "_is_cpu", True)
    # "static" (the default) builds no confidence head; the others do.
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", ragged_mode)
    single = dict(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, attn_dp_size=1)
    single.update(attn_dp_rank=0, attn_cp_size=1, attn_cp_rank=0)
    with parallel.override(**single):
        return dspark.Qwen3DSparkModel(hf_config)


def loaded_params(model, tensors: dict) -> dict:
    """SGLang's `load_weights` of `tensors` into `model`, every parameter first NaN: its
    parameters by name, after checking none was left unloaded."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.load_weights(iter(tensors.items()))
    params = dict(model.named_parameters())
    assert not [n for n, p in params.items() if p.isnan().any()], "parameters left unloaded"
    return params


def unpacked_params(model) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes SGLang's load_weights maps onto the model's parameters
    (the inverse of its stacked_params_mapping: qkv_proj <- q/k/v, gate_up_proj <- gate/up)."""
    want = {}
    for name, p in model.named_parameters():
        if name.endswith("self_attn.qkv_proj.weight"):
            attn = model.get_submodule(name.removesuffix(".qkv_proj.weight"))
            q, kv = attn.q_size, attn.kv_size
            assert p.shape[0] == q + 2 * kv
            for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                want[name.replace("qkv_proj", proj)] = (rows, p.shape[1])
        elif name.endswith("mlp.gate_up_proj.weight"):
            for proj in ("gate_proj", "up_proj"):
                want[name.replace("gate_up_proj", proj)] = (p.shape[0] // 2, p.shape[1])
        else:
            want[name] = tuple(p.shape)
    return want


@pytest.mark.parametrize("ragged_mode", ["compact", "static"])
def test_sglang_tensors_are_exactly_what_its_dspark_model_loads(tmp_path, monkeypatch, ragged_mode):
    cfg = DSparkConfig(**TINY)
    draft = trained(cfg)
    out = export_draft(draft, cfg, tmp_path / "sglang", "sglang")
    hf_config = sglang("sglang.srt.utils.hf_transformers.config").get_config(
        str(out), trust_remote_code=False
    )
    model = _sglang_model(hf_config, monkeypatch, ragged_mode)
    ours = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in ours.values())

    want = unpacked_params(model)
    if ragged_mode == "static":  # its loader skips confidence_head.* without a head
        assert model.confidence_head is None
        want["confidence_head.proj.weight"] = (1, cfg.hidden_size + cfg.markov_rank)
        want["confidence_head.proj.bias"] = (1,)
    assert {k: tuple(v.shape) for k, v in ours.items()} == want

    params = loaded_params(model, ours)
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}"
        qkv = torch.cat([ours[f"{pre}.self_attn.{p}_proj.weight"] for p in "qkv"]).float()
        assert torch.equal(params[f"{pre}.self_attn.qkv_proj.weight"], qkv)
        gate_up = torch.cat([ours[f"{pre}.mlp.{p}_proj.weight"] for p in ("gate", "up")]).float()
        assert torch.equal(params[f"{pre}.mlp.gate_up_proj.weight"], gate_up)
    for name, p in params.items():
        if name in ours:
            assert torch.equal(p.float(), ours[name].float()), name


# --------------------------------------------------------------------------- our model


def test_reloaded_export_reproduces_the_trained_logits(tmp_path):
    cfg = DSparkConfig(**TINY)
    draft = trained(cfg)
    head = random_head(cfg, logical=64, mup=2.0)
    args = inputs(cfg, S=14, anchors=[0, 4, 9, 12])
    want, want_conf = our_logits(draft, head, *args)

    fp32 = export_draft(draft, cfg, tmp_path / "fp32", "sglang", dtype=torch.float32)
    got, got_conf = our_logits(DSparkDraft.from_pretrained(fp32), head, *args)
    assert torch.equal(got, want) and torch.equal(got_conf, want_conf)

    bf16 = export_draft(draft, cfg, tmp_path / "bf16", "sglang")
    got, got_conf = our_logits(DSparkDraft.from_pretrained(bf16), head, *args)
    # Exactly the trained draft with its weights rounded to bf16 ...
    ref, ref_conf = our_logits(bf16_rounded(draft), head, *args)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(got_conf, ref_conf, rtol=0, atol=0)
    # ... which stays within bf16 tolerance of the trained one and keeps its greedy picks.
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.05 * want.std().item())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


def test_export_refuses_weights_that_do_not_fit(tmp_path):
    cfg = DSparkConfig(**TINY)
    state = trained(cfg).state_dict()
    state["layers.0.self_attn.qkv_proj.weight"] = state.pop("layers.0.self_attn.q_proj.weight")
    with pytest.raises(ExportError, match="qkv_proj"):
        export_draft(state, cfg, tmp_path / "x", "sglang")
    with pytest.raises(ExportError, match="format"):
        export_draft(trained(cfg), cfg, tmp_path / "x", "onnx")
    partitioned = trained(cfg)  # what a ZeRO-3 engine's module holds outside a gather
    partitioned.fc.weight = torch.nn.Parameter(torch.empty(0))
    with pytest.raises(ExportError, match="partitioned"):
        export_draft(partitioned, cfg, tmp_path / "x", "sglang")
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- speculators


def target_draft_config(target_dir: Path) -> DSparkConfig:
    t = json.loads((target_dir / "config.json").read_text())
    return DSparkConfig(
        **{
            **TINY,
            "hidden_size": t["hidden_size"],
            "head_dim": 32,
            "vocab_size": t["vocab_size"],
            "num_target_layers": t["num_hidden_layers"],
            "target_layer_ids": [0, 2],
            "mask_token_id": 9,
            "block_size": 4,
        }
    )


def load_in_speculators(out: Path):
    """speculators' own DSparkDraftModel from our export, with its CPU-capable attention."""
    speculators = importlib.import_module("speculators.models.dspark")
    config = speculators.DSparkSpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention is GPU-only
    model = speculators.DSparkDraftModel.from_pretrained(
        str(out), config=config, dtype=torch.float32
    )
    # Every stored tensor is a model tensor and arrived unchanged; only the verifier's
    # embedding (and LM head, when not stored) and final norm come from the verifier.
    stored = load_file(str(out / "model.safetensors"))
    state = model.state_dict()
    for name, t in stored.items():
        assert torch.equal(state[name], t.to(state[name].dtype)), name
    from_verifier = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    assert set(state) - set(stored) == from_verifier | ({"lm_head.weight"} - set(stored))
    return model.eval()


def speculators_logits(model, aux_1SD, ids_1S, anchors: list[int]):
    """Draft logits and confidence by speculators' own code (DSparkDraftModel.forward up to
    its loss), with its anchor sampling pinned to `anchors` through the loss mask."""
    S, N, G = ids_1S.shape[1], len(anchors), model.block_size
    loss_mask = torch.zeros(1, S, dtype=torch.long)
    loss_mask[0, anchors] = 1  # its only eligible anchors: it takes all of them, sorted
    with torch.no_grad():
        hidden, logits, _, _, idx = model._backbone_forward(
            aux_1SD,
            ids_1S,
            loss_mask,
            torch.randn(1, S, model.hidden_size),  # verifier last hidden: teacher only
            torch.zeros(1, S),
            max_anchors=N,
        )
        assert idx.view(N, G)[:, 0].tolist() == anchors
        block_tokens = ids_1S[0, idx].view(N, G)  # sample_from_anchor: prev = block tokens
        hidden = hidden.view(N, G, -1)
        prev_emb = model.markov_head.prev_embeddings(block_tokens)
        bias = model.markov_head.block_bias(
            prev_token_ids=block_tokens, hidden_states=hidden, prev_emb=prev_emb
        )
        conf = model.confidence_head(torch.cat([hidden, prev_emb], -1))
    return (logits.view(N, G, -1) + bias)[None], conf[None]


@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_speculators_export_loads_in_speculators_and_matches_our_logits(
    tmp_path, tiny_target_dir, vocab
):
    cfg = target_draft_config(tiny_target_dir)
    draft = trained(cfg, seed=1)
    sglang_dir = export_draft(
        draft, cfg, tmp_path / "sglang", "sglang", target_path=tiny_target_dir
    )
    # the re-export path: SGLang directory -> speculators ("full" by default)
    out = export_checkpoint(
        sglang_dir,
        "speculators",
        tmp_path / "spec",
        target_path=tiny_target_dir,
        speculators_vocab=None if vocab == "full" else vocab,
    )
    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["sample_from_anchor"] is True
    assert raw["block_size"] == cfg.block_size
    proposal = raw["speculators_config"]["proposal_methods"][0]
    assert proposal == {**proposal, "proposal_type": "greedy", "speculative_tokens": 4}
    assert raw["aux_hidden_state_layer_ids"] == [1, 3]
    assert raw["speculators_config"]["verifier"] == {
        "name_or_path": str(tiny_target_dir.resolve()),
        "architectures": ["InklingForCausalLM"],
    }
    assert raw["transformer_layer_config"]["vocab_size"] == 1088
    stored, trained_bf16 = (
        load_file(str(out / "model.safetensors")),
        load_file(str(sglang_dir / "model.safetensors")),
    )
    H, R = cfg.hidden_size, cfg.markov_rank
    head = load_frozen_head(tiny_target_dir)
    assert (head.vocab_rows, head.logical_vocab, head.mup_multiplier) == (1088, 1024, 4.0)
    if vocab == "full":  # every LM-head row; speculators reads the verifier's head itself
        assert raw["draft_vocab_size"] == 1088
        assert stored.keys() == trained_bf16.keys()  # no t2d, d2t or lm_head
        assert stored["markov_head.markov_w2.weight"].shape == (1088, R)
        # muP 4 folded into the final norm, the confidence head's h columns compensated
        # (a power of two: exact in bf16)
        assert torch.equal(stored["norm.weight"], trained_bf16["norm.weight"] / 4)
        conf, conf_trained = (t["confidence_head.proj.weight"] for t in (stored, trained_bf16))
        assert torch.equal(conf[:, :H], conf_trained[:, :H] * 4)
        assert torch.equal(conf[:, H:], conf_trained[:, H:])
        assert raw[CONVENTIONS_KEY]["mup_folded_into"] == "norm.weight"
        columns = None
    else:  # the 1024 ids the target can emit, the head / mup stored
        assert raw["draft_vocab_size"] == 1024
        assert stored["t2d"].sum() == 1024 and stored["t2d"][:1024].all()
        assert torch.equal(stored["d2t"], torch.zeros(1024, dtype=torch.long))
        assert stored["markov_head.markov_w2.weight"].shape == (1024, R)
        assert torch.equal(stored["norm.weight"], trained_bf16["norm.weight"])
        assert raw[CONVENTIONS_KEY]["mup_folded_into"] == "lm_head.weight"
        # The LM head is stored in bf16 (mup 4 is a power of two: the fold is exact).
        head = FrozenHead(head.embed_weight, head.lm_head_weight.bfloat16().float(), 1024, 4.0)
        columns = 1024
    assert raw[CONVENTIONS_KEY]["speculators_vocab"] == vocab

    model = load_in_speculators(out)
    if vocab == "full":
        assert torch.equal(model.lm_head.weight, head.lm_head_weight)  # the verifier's
    anchors = [2, 7, 11]
    aux, ids, anchors_1N = inputs(cfg, 20, anchors)
    want, want_conf = our_logits(
        DSparkDraft.from_pretrained(sglang_dir), head, aux, ids, anchors_1N, columns
    )
    got, got_conf = speculators_logits(model, aux, ids, anchors)
    assert got.shape[-1] == (1088 if vocab == "full" else 1024)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_conf, want_conf, rtol=1e-4, atol=1e-4)


def plain_target(path: Path, cfg: DSparkConfig, mup: float | None) -> Path:
    """A target directory with an unpadded LM head (no tokenizer: all rows are tokens)."""
    g = torch.Generator().manual_seed(11)
    V, H = cfg.vocab_size, cfg.hidden_size
    path.mkdir()
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": H}
    config |= {"vocab_size": V, "num_hidden_layers": cfg.num_target_layers}
    if mup is not None:
        config["logits_mup_width_multiplier"] = mup
    (path / "config.json").write_text(json.dumps(config))
    weights = {"model.embed_tokens.weight": torch.randn(V, H, generator=g)}
    weights |= {
        "lm_head.weight": torch.randn(V, H, generator=g),
        "model.norm.weight": torch.ones(H),
    }
    save_file(weights, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("mup", [None, 2.0])
def test_speculators_export_of_an_unpadded_target_uses_the_verifier_head(tmp_path, mup):
    cfg = DSparkConfig(**TINY)
    draft = trained(cfg, seed=2)
    target = plain_target(tmp_path / "target", cfg, mup=mup)
    out = export_draft(draft, cfg, tmp_path / "spec", "speculators", "org/t", target)
    raw = json.loads((out / "config.json").read_text())
    assert raw["draft_vocab_size"] == cfg.vocab_size
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "org/t"
    stored = load_file(str(out / "model.safetensors"))
    assert stored.keys() == draft.state_dict().keys()  # exactly the SGLang names
    assert raw[CONVENTIONS_KEY]["mup_folded_into"] == (mup and "norm.weight")

    raw["speculators_config"]["verifier"]["name_or_path"] = str(target)  # load it locally
    (out / "config.json").write_text(json.dumps(raw))
    model = load_in_speculators(out)
    anchors = [0, 5, 9]
    aux, ids, anchors_1N = inputs(cfg, 16, anchors)
    head = load_frozen_head(target)
    # with muP, speculators sees lm_head(norm'(x)) with norm' = norm / mup: our logits, and
    # the confidence head sees h again
    want, want_conf = our_logits(bf16_rounded(draft), head, aux, ids, anchors_1N)
    got, got_conf = speculators_logits(model, aux, ids, anchors)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_conf, want_conf, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("markov_head_type", ["gated", "rnn"])
def test_speculators_export_refuses_a_markov_head_vllm_cannot_load(tmp_path, markov_head_type):
    """vLLM's DSpark builds only the vanilla Markov head (and ignores markov_head_type):
    a gated or rnn drafter would be served without its gate or recurrence."""
    cfg = DSparkConfig(**{**TINY, "markov_head_type": markov_head_type})
    target = plain_target(tmp_path / "target", cfg, mup=None)
    with pytest.raises(ExportError, match=f"markov_head_type is '{markov_head_type}'"):
        export_draft(trained(cfg, seed=2), cfg, tmp_path / "spec", "speculators", "t", target)
    assert not (tmp_path / "spec").exists()
    sglang = export_draft(trained(cfg, seed=2), cfg, tmp_path / "sg", "sglang", target_path=target)
    assert json.loads((sglang / "config.json").read_text())["markov_head_type"] == markov_head_type


def test_speculators_export_refusals(tmp_path):
    cfg = DSparkConfig(**TINY)
    draft = trained(cfg, seed=2)
    mup_target = plain_target(tmp_path / "mup", cfg, mup=2.0)
    with pytest.raises(ExportError, match="muP multiplier 2.0 and no padded"):
        export_draft(
            draft,
            cfg,
            tmp_path / "x",
            "speculators",
            target_path=mup_target,
            speculators_vocab="reduced",
        )
    with pytest.raises(ExportError, match="speculators_vocab"):
        export_draft(
            draft,
            cfg,
            tmp_path / "x",
            "speculators",
            target_path=mup_target,
            speculators_vocab="pruned",
        )
    with pytest.raises(ExportError, match="target directory"):
        export_draft(draft, cfg, tmp_path / "x", "speculators")
    spec = export_draft(draft, cfg, tmp_path / "spec", "speculators", target_path=mup_target)
    with pytest.raises(ExportError, match="speculators export cannot be read back"):
        export_checkpoint(spec, "sglang", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def export_for_recipe(draft: DSparkDraft, recipe: Recipe) -> list[Path]:
    """Every format in `recipe.export.formats`, each under `<export dir>/<format>`.

    The test side of train.py's export_final, for an in-memory draft."""
    root = resolved_dirs(recipe)["export"]
    return [
        export_draft(
            draft,
            draft.config,
            root / fmt,
            fmt,
            verifier_name=recipe.export.verifier_name or None,
            target_path=recipe.target.path or None,
            speculators_vocab=recipe.export.speculators_vocab,
        )
        for fmt in recipe.export.formats
    ]


def test_export_for_recipe_writes_every_configured_format(tmp_path, tiny_target_dir):
    cfg = target_draft_config(tiny_target_dir)
    recipe = Recipe()
    recipe.target.path = str(tiny_target_dir)
    recipe.train.output_dir = str(tmp_path / "run")
    dirs = export_for_recipe(trained(cfg), recipe)
    assert dirs == [
        tmp_path / "run" / "export" / "sglang",
        tmp_path / "run" / "export" / "speculators",
    ]
    assert DSparkDraft.from_pretrained(dirs[0]).config == cfg
    raw = json.loads((dirs[1] / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["draft_vocab_size"] == 1088
    recipe.export.speculators_vocab = "reduced"
    recipe.export.formats = ["speculators"]
    (out,) = export_for_recipe(trained(cfg), recipe)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 1024


# --------------------------------------------------------------------------- conventions


def draft_recipe_of(cfg: DSparkConfig) -> DraftRecipe:
    return DraftRecipe(
        **{
            f.name: getattr(cfg, f.name)
            for f in dataclasses.fields(DraftRecipe)
            if hasattr(cfg, f.name)
        }
    )


def target_variant(root: Path, target: Path, **changes) -> Path:
    """The target with a changed config.json (its other files linked)."""
    root.mkdir()
    for f in target.iterdir():
        if f.name != "config.json":
            (root / f.name).symlink_to(f.resolve())
    config = json.loads((target / "config.json").read_text()) | changes
    (root / "config.json").write_text(json.dumps(config))
    return root


TINY_INKLING_CONVENTIONS = {
    "format_version": 1,
    "sample_from_anchor": True,
    "slot_convention": "slot k of the block anchored at position a predicts token a+k+1",
    "tap_convention": "pre_mlp_sconv",
    "layer_id_convention": "target_layer_ids: decoder layer k output (0-based); "
    "aux_hidden_state_layer_ids: k+1 (hidden-states index, 0 = embeddings)",
    "target_layer_ids": [0, 2],
    "aux_hidden_state_layer_ids": [1, 3],
    "num_target_layers": 4,
    "mask_token_id": 9,
    "logical_vocab": 1024,
    "vocab_rows": 1088,
    "mup_multiplier": 4.0,
}


def test_both_exports_record_the_conventions_and_their_loaders_accept_them(
    tmp_path, tiny_target_dir
):
    cfg = target_draft_config(tiny_target_dir)
    draft = trained(cfg)
    sglang_dir = export_draft(draft, cfg, tmp_path / "sg", "sglang", None, tiny_target_dir)
    spec_dir = export_draft(draft, cfg, tmp_path / "sp", "speculators", None, tiny_target_dir)
    sg = json.loads((sglang_dir / "config.json").read_text())[CONVENTIONS_KEY]
    sp = json.loads((spec_dir / "config.json").read_text())[CONVENTIONS_KEY]
    assert sg == {**TINY_INKLING_CONVENTIONS, "mup_folded_into": None}
    assert sp == {
        **TINY_INKLING_CONVENTIONS,
        "speculators_vocab": "full",
        "mup_folded_into": "norm.weight",
    }
    # without a target, the target's facts are unknown (null), the draft's are recorded
    bare = export_draft(draft, cfg, tmp_path / "bare", "sglang")
    rec = json.loads((bare / "config.json").read_text())[CONVENTIONS_KEY]
    assert rec["tap_convention"] is rec["logical_vocab"] is rec["mup_multiplier"] is None
    assert rec["mask_token_id"] == 9 and rec["vocab_rows"] == 1088
    # ... and re-exporting it with the target fills them in
    again = export_checkpoint(bare, "sglang", tmp_path / "again", tiny_target_dir)
    assert json.loads((again / "config.json").read_text())[CONVENTIONS_KEY] == sg
    # ... and a re-export without a target keeps what the source recorded
    kept = export_checkpoint(sglang_dir, "sglang", tmp_path / "kept")
    assert json.loads((kept / "config.json").read_text())[CONVENTIONS_KEY] == sg

    assert DSparkDraft.from_pretrained(sglang_dir).config == cfg
    speculators = importlib.import_module("speculators.models.dspark")
    config = speculators.DSparkSpeculatorConfig.from_pretrained(spec_dir)
    assert getattr(config, CONVENTIONS_KEY) == sp
    hf_config = sglang("sglang.srt.utils.hf_transformers.config").get_config(
        str(sglang_dir), trust_remote_code=False
    )
    spec = sglang("sglang.srt.speculative.dspark_components.dspark_config")
    parsed = spec.parse_dspark_draft_config(draft_hf_config=hf_config)
    assert (parsed.mask_token_id, parsed.target_layer_ids) == (9, [0, 2])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_sconv": False}, "tap_convention is 'pre_mlp_sconv' in .* but 'layer_output'"),
        ({"unpadded_vocab_size": 1000}, "logical_vocab is 1024 in .* but 1000"),
        ({"logits_mup_width_multiplier": 2.0}, "mup_multiplier is 4.0 in .* but 2.0"),
    ],
)
@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_reexport_for_a_target_with_other_conventions_is_refused(
    tmp_path, tiny_target_dir, change, message, fmt
):
    cfg = target_draft_config(tiny_target_dir)
    made = export_draft(trained(cfg), cfg, tmp_path / "sg", "sglang", None, tiny_target_dir)
    other = target_variant(tmp_path / "other", tiny_target_dir, **change)
    with pytest.raises(ExportError, match=message):
        export_checkpoint(made, fmt, tmp_path / "x", target_path=other)
    assert (
        main(
            [
                "--checkpoint",
                str(made),
                "--format",
                fmt,
                "--out",
                str(tmp_path / "x"),
                "--target",
                str(other),
            ]
        )
        == 2
    )
    assert not (tmp_path / "x").exists()


def test_check_conventions_refuses_a_start_point_made_for_other_settings(tmp_path, tiny_target_dir):
    cfg = target_draft_config(tiny_target_dir)
    out = export_draft(trained(cfg), cfg, tmp_path / "sg", "sglang", None, tiny_target_dir)
    recipe = Recipe(draft=draft_recipe_of(cfg))
    recipe.target.path = str(tiny_target_dir)
    check_conventions(out, recipe)  # agrees

    recipe.draft.mask_token_id = 10
    with pytest.raises(ConventionsError, match="mask_token_id is 9 in .* but 10"):
        check_conventions(out, recipe)
    recipe.draft.mask_token_id = 9
    other = target_variant(tmp_path / "other", tiny_target_dir, use_sconv=False)
    recipe.target.path = str(other)
    with pytest.raises(ConventionsError, match="tap_convention"):
        check_conventions(out, recipe)
    recipe.target.path = str(tiny_target_dir)
    # against a target alone (evaluation): only the target's facts
    check_conventions(out, target_path=tiny_target_dir)
    with pytest.raises(ConventionsError, match="tap_convention is 'pre_mlp_sconv' in .* but"):
        check_conventions(out, target_path=other)

    raw = json.loads((out / "config.json").read_text())
    raw[CONVENTIONS_KEY]["format_version"] = 2
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConventionsError, match="format_version is 2 in .* but 1"):
        check_conventions(out, recipe)
    # a drafter without the record (published elsewhere): what its config root serves counts
    raw.pop(CONVENTIONS_KEY)
    (out / "config.json").write_text(json.dumps(raw))
    check_conventions(out, recipe)
    recipe.draft.target_layer_ids = [1, 2]
    with pytest.raises(ConventionsError, match=r"target_layer_ids is \[0, 2\] in .* but \[1, 2\]"):
        check_conventions(out, recipe)


# --------------------------------------------------------------------------- checkpoints


def fake_training_checkpoint(
    root: Path, cfg_kwargs: dict, complete: bool = True, tap: str | None = None
) -> Path:
    """A ZeRO-0 step directory in the layout of specforge_dspark/training/checkpoint.py (with the
    features fingerprint's tap convention when `tap` is given)."""
    recipe = Recipe(draft=DraftRecipe(**cfg_kwargs))
    recipe.dist.zero_stage = 0
    draft = trained(DSparkConfig.from_recipe(recipe.draft), seed=5)
    step = root / "ckpt" / "step-7"
    step.mkdir(parents=True)
    torch.save({"module": draft.state_dict()}, step / "mp_rank_00_model_states.pt")
    state = {"format_version": 1, "world_size": 1, "recipe": recipe.to_dict(), "step": 7}
    if tap is not None:
        state["fingerprint"] = {"features": {"tap_convention": tap}}
    (step / "train_state.json").write_text(json.dumps(state))
    if complete:
        (step / "COMPLETE").write_text("")
    return step


def cli(checkpoint: Path, out: Path) -> int:
    return main(["--checkpoint", str(checkpoint), "--format", "sglang", "--out", str(out)])


def test_export_from_a_training_checkpoint_and_refusal_of_an_incomplete_one(tmp_path, capsys):
    step = fake_training_checkpoint(tmp_path / "run", TINY)
    saved = torch.load(step / "mp_rank_00_model_states.pt", weights_only=False)["module"]

    assert cli(step, tmp_path / "a") == 0
    got = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert got.keys() == saved.keys()
    assert all(torch.equal(got[k], v.bfloat16()) for k, v in saved.items())
    assert DSparkConfig.from_dict(json.loads((tmp_path / "a" / "config.json").read_text())) == (
        DSparkConfig(**TINY)
    )
    # the checkpoint root resolves to its latest complete step
    export_checkpoint(step.parent, "sglang", tmp_path / "b")
    with safe_open(str(tmp_path / "b" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("fc.weight"), got["fc.weight"])

    (step / "COMPLETE").unlink()
    with pytest.raises(ExportError, match="incomplete checkpoint"):
        export_checkpoint(step, "sglang", tmp_path / "c")
    assert cli(step, tmp_path / "c") == 2
    assert "incomplete checkpoint" in capsys.readouterr().err
    with pytest.raises(ExportError, match="no complete step-N"):
        export_checkpoint(step.parent, "sglang", tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_training_checkpoint_conventions_and_the_speculators_vocab_flag(
    tmp_path, tiny_target_dir, capsys
):
    fields = dataclasses.asdict(draft_recipe_of(target_draft_config(tiny_target_dir)))
    step = fake_training_checkpoint(tmp_path / "run", fields, tap="pre_mlp_sconv")
    args = ["--checkpoint", str(step), "--target", str(tiny_target_dir), "--out"]
    assert main([*args, str(tmp_path / "sg"), "--format", "sglang"]) == 0
    rec = json.loads((tmp_path / "sg" / "config.json").read_text())[CONVENTIONS_KEY]
    assert rec == {**TINY_INKLING_CONVENTIONS, "mup_folded_into": None}
    argv = [*args, str(tmp_path / "sp"), "--format", "speculators", "--speculators-vocab"]
    assert main([*argv, "reduced"]) == 0
    raw = json.loads((tmp_path / "sp" / "config.json").read_text())
    assert raw["draft_vocab_size"] == 1024 and raw[CONVENTIONS_KEY]["speculators_vocab"] == (
        "reduced"
    )
    assert (
        main([*args, str(tmp_path / "sg2"), "--format", "sglang", "--speculators-vocab", "full"])
        == 0
    )
    assert "--speculators-vocab is ignored" in capsys.readouterr().err

    # features taken with another tap than the target at hand has
    other = fake_training_checkpoint(tmp_path / "other", fields, tap="layer_output")
    with pytest.raises(ExportError, match="tap_convention is 'layer_output' in .* but"):
        export_checkpoint(other, "sglang", tmp_path / "x", target_path=tiny_target_dir)
    assert not (tmp_path / "x").exists()
