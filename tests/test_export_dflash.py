"""The DFlash export is what SGLang 0.5.23's DFLASH loader reads: its own config parsing,
per-layer attention settings, model construction and load_weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specforge_dspark.drafters.conventions import CONVENTIONS_KEY
from specforge_dspark.drafters.dflash import DFlashConfig, DFlashDraft
from specforge_dspark.export import ExportError
from specforge_dspark.export import dflash as export_dflash
from specforge_dspark.export.dispatch import export_checkpoint
from specforge_dspark.export.source import checkpoint_kind
from tests.sglang_shim import import_sglang
from tests.test_dflash import TINY
from tests.test_export import loaded_params, unpacked_params

pytestmark = pytest.mark.usefixtures("one_thread")


def trained(cfg: DFlashConfig) -> DFlashDraft:
    torch.manual_seed(0)
    draft = DFlashDraft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return draft


def _hf_config(out):
    return import_sglang("sglang.srt.utils.hf_transformers.config").get_config(
        str(out), trust_remote_code=False
    )


def sglang_dflash_model(name: str, hf_config, monkeypatch):
    """SGLang's own `models/dflash.py` class `name` built from `hf_config` on one rank."""
    dflash = import_sglang("sglang.srt.models.dflash")
    rope = import_sglang("sglang.srt.layers.rotary_embedding.base")
    parallel = import_sglang("sglang.srt.runtime_context").get_parallel()
    monkeypatch.setattr(rope, "_is_cpu", True)
    single = dict(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, attn_dp_size=1)
    single.update(attn_dp_rank=0, attn_cp_size=1, attn_cp_rank=0)
    with parallel.override(**single):
        return getattr(dflash, name)(hf_config)


def test_config_passes_sglangs_dflash_parsing(tmp_path):
    cfg = DFlashConfig(**{**TINY, "block_size": 16, "sliding_window": 32})
    out = export_dflash.export_dflash(trained(cfg), None, tmp_path / "dflash")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and "speculators_model_type" not in raw
    assert raw[CONVENTIONS_KEY]["slot_convention"] == export_dflash.SLOT_CONVENTION

    hf_config = _hf_config(out)
    utils = import_sglang("sglang.srt.speculative.dflash_utils")
    parsed = utils.parse_dflash_draft_config(draft_hf_config=hf_config)
    assert parsed.resolve_block_size(default=None) == 16
    assert parsed.target_layer_ids == cfg.target_layer_ids
    assert parsed.num_target_layers == cfg.num_target_layers
    assert parsed.num_hidden_layers == cfg.num_hidden_layers
    assert parsed.mask_token_id == cfg.mask_token_id
    assert (parsed.conv_kernel_size, parsed.selector_rank, parsed.projector_type) == (0, 0, None)
    assert list(utils.get_dflash_layer_types(hf_config)) == cfg.layer_types
    # SGLang stores window_left = sliding_window - 1 (HF windows include the query itself)
    assert utils.get_dflash_attention_sliding_window_size(hf_config) == 31

    dflash = import_sglang("sglang.srt.models.dflash")
    radix = import_sglang("sglang.srt.layers.radix_attention")
    kinds = [dflash._get_dflash_layer_attention_params(hf_config, i) for i in range(2)]
    assert kinds == [(31, radix.AttentionType.DECODER), (-1, radix.AttentionType.ENCODER_ONLY)]


def test_tensors_are_exactly_what_sglangs_dflash_model_loads(tmp_path, monkeypatch):
    cfg = DFlashConfig(**TINY)
    out = export_dflash.export_dflash(trained(cfg), None, tmp_path / "dflash")
    model = sglang_dflash_model("DFlashDraftModel", _hf_config(out), monkeypatch)
    ours = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in ours.values())
    assert {k: tuple(v.shape) for k, v in ours.items()} == unpacked_params(model)
    params = loaded_params(model, ours)
    qkv = torch.cat([ours[f"layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]).float()
    assert torch.equal(params["layers.1.self_attn.qkv_proj.weight"], qkv)
    for name, p in params.items():
        if name in ours:
            assert torch.equal(p.float(), ours[name].float()), name
    assert [layer.self_attn.sliding_window_size for layer in model.layers] == [5, -1]


def test_checkpoint_kind_and_reexport(tmp_path):
    cfg = DFlashConfig(**TINY)
    out = export_dflash.export_dflash(trained(cfg), None, tmp_path / "a", dtype=torch.float32)
    assert checkpoint_kind(out) == "dflash"
    again = export_checkpoint(out, "sglang", tmp_path / "b")
    assert DFlashDraft.from_pretrained(again).config == cfg
    with pytest.raises(ExportError, match="only as sglang"):
        export_checkpoint(out, "speculators", tmp_path / "c")
