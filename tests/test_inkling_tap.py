"""The aux tap is SGLang's: Inkling's before each layer's MLP short convolution.

`sglang_inkling_taps` recomputes the tiny Inkling target layer by layer the way SGLang
0.5.23 runs it (models/inkling.py: the FFN exit leaves its MLP convolution pending for the
next layer's read; the tap is `complete_output + written_residual` = r + m), with its own
causal convolution, and every path that feeds a drafter must agree with it: the hf
backend, and the evaluation harness's prefill, cached verify and rerun steps. Other
architectures keep HF's `hidden_states[k+1]`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specforge_dspark.decoding.hf_target import HFTarget as EvalTarget
from specforge_dspark.engines.hf import HFTarget
from specforge_dspark.engines.tap import AuxTap, tap_convention
from specforge_dspark.transport.features import Sample, pad_batch

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = [0, 1, 2]
H = 128
TOL = 1e-5


@pytest.fixture(scope="module")
def target(tiny_target_dir, one_thread) -> HFTarget:
    return HFTarget(str(tiny_target_dir), "float32", "cpu", LAYERS, chunk=1)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(10, 1000, (1, n), generator=torch.Generator().manual_seed(seed))


def causal_conv(x_BSC: torch.Tensor, conv1d: torch.nn.Conv1d) -> torch.Tensor:
    """The depthwise causal convolution of a short convolution, without its residual."""
    K, C = conv1d.weight.shape[-1], x_BSC.shape[-1]
    y = F.conv1d(x_BSC.transpose(1, 2), conv1d.weight, padding=K - 1, groups=C)
    return y[..., : x_BSC.shape[1]].transpose(1, 2)


def _layer_kwargs(model, ids_1S: torch.Tensor) -> list[dict]:
    """The masks (and other keywords) each decoder layer gets in an uncached forward."""
    seen: list[dict] = []
    hooks = [
        layer.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw), with_kwargs=True)
        for layer in model.model.layers
    ]
    try:
        model.model(input_ids=ids_1S, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.inference_mode()
def sglang_inkling_taps(model, ids_1S: torch.Tensor) -> tuple[list, list]:
    """(tap [1, S, H], layer output [1, S, H]) per decoder layer, as SGLang computes them."""
    taps, outs = [], []
    h = model.model.embed_tokens(ids_1S)
    for layer, kw in zip(model.model.layers, _layer_kwargs(model, ids_1S), strict=True):
        kw = {k: v for k, v in kw.items() if k != "past_key_values"}
        a, _ = layer.self_attn(layer.input_layernorm(h), **kw)
        # the attention's convolution is applied by the FFN's input read: r includes it
        r = h + (causal_conv(a, layer.attn_sconv.conv1d) + a)
        m = layer.mlp(layer.post_attention_layernorm(r))
        taps.append(r + m)  # complete_output (m) + written_residual (r)
        h = r + (causal_conv(m, layer.mlp_sconv.conv1d) + m)  # the deferred ShortConvUpdate
        outs.append(h)
    return taps, outs


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_tap_conventions_by_config():
    assert tap_convention({"model_type": "inkling_text"}) == "pre_mlp_sconv"
    nested = {"model_type": "inkling_mm_model", "text_config": {"use_sconv": True}}
    assert tap_convention(nested) == "pre_mlp_sconv"
    # SGLang builds no mlp_sconv without use_sconv: its tap is then the layer output
    assert tap_convention({**nested, "text_config": {"use_sconv": False}}) == "layer_output"
    assert tap_convention({"model_type": "qwen3"}) == "layer_output"
    assert tap_convention({"model_type": "llama"}) == "layer_output"


def test_hf_backend_takes_sglangs_inkling_tap(target):
    assert tap_convention(target.model.config) == "pre_mlp_sconv"
    ids = _ids(41, seed=0)
    taps, outs = sglang_inkling_taps(target.model, ids)
    with torch.inference_mode():
        hs = target.model.model(input_ids=ids, output_hidden_states=True).hidden_states
    feats = target.forward(pad_batch([Sample(0, ids[0], torch.ones(41, dtype=torch.long))]), H)
    for i, k in enumerate(LAYERS):
        # the reference reproduces HF's layer, so its tap is the same model's
        assert _max_diff(outs[k], hs[k + 1]) <= TOL
        got = feats.aux_hidden[:, :, i * H : (i + 1) * H]
        assert _max_diff(got, taps[k]) <= TOL, f"aux slot {i} is not layer {k}'s SGLang tap"
        # and it is not HF's hidden_states[k+1]: the MLP convolution term is left out
        assert _max_diff(got, hs[k + 1]) > 1e-2


def test_padding_leaves_the_inkling_tap_of_valid_rows(target):
    short, long = _ids(13, seed=1), _ids(29, seed=2)
    ones = lambda n: torch.ones(n, dtype=torch.long)  # noqa: E731
    batch = pad_batch([Sample(0, short[0], ones(13)), Sample(1, long[0], ones(29))])
    target.chunk = 2  # one padded forward for both
    try:
        feats = target.forward(batch, H)
    finally:
        target.chunk = 1
    taps, _ = sglang_inkling_taps(target.model, short)
    want = torch.cat([taps[k] for k in LAYERS], dim=-1)[0]
    assert _max_diff(feats.aux_hidden[0, :13], want) <= TOL
    assert feats.aux_hidden[0, 13:].abs().sum() == 0


@pytest.mark.parametrize("cache_mode", ["crop", "rerun"])
def test_cached_decode_steps_give_the_uncached_tap(tiny_target_dir, cache_mode):
    """Prefill, partially accepted verifies and one-token steps: the committed tokens'
    features are those of one uncached forward over the whole sequence."""
    evaluator = EvalTarget.load(tiny_target_dir, LAYERS, cache_mode)
    seq = _ids(40, seed=3)[0].tolist()
    feats = [evaluator.prefill(seq[:20]).aux_SD]
    pos = 20
    # (tokens verified, tokens kept): the rejected tail is noise the cache must drop
    for n_verify, n_keep in [(4, 2), (3, 3), (1, 1), (5, 1), (1, 1), (4, 3)]:
        ids = seq[pos : pos + n_keep] + [7] * (n_verify - n_keep)
        ver = evaluator.verify(ids)
        fresh = evaluator.commit(ids, n_keep)
        feats.append(ver.aux_SD[:n_keep] if fresh is None else fresh)
        pos += n_keep
    taps, _ = sglang_inkling_taps(evaluator.model, torch.tensor([seq[:pos]]))
    want = torch.cat([taps[k] for k in LAYERS], dim=-1)[0]
    assert evaluator.cache_length() == pos
    assert _max_diff(torch.cat(feats), want) <= TOL


def _tiny_qwen3(path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def test_other_architectures_keep_hidden_states_k_plus_1(tmp_path):
    path = _tiny_qwen3(tmp_path / "qwen3")
    layers = [0, 1]
    qwen = HFTarget(str(path), "float32", "cpu", layers, chunk=1)
    assert tap_convention(qwen.model.config) == "layer_output"
    ids = torch.randint(0, 128, (1, 17), generator=torch.Generator().manual_seed(4))
    feats = qwen.forward(pad_batch([Sample(0, ids[0], torch.ones(17, dtype=torch.long))]), 32)
    with torch.inference_mode():
        hs = qwen.model(input_ids=ids, output_hidden_states=True).hidden_states
    want = torch.cat([hs[k + 1] for k in layers], dim=-1)
    assert torch.equal(feats.aux_hidden, want)
    evaluator = EvalTarget(qwen.model, None, layers)
    assert torch.equal(evaluator.prefill(ids[0].tolist()).aux_SD, want[0])


def test_inkling_tap_refuses_a_model_without_mlp_sconv(tmp_path):
    qwen = HFTarget(str(_tiny_qwen3(tmp_path / "qwen3")), "float32", "cpu", [0], chunk=1)
    qwen.model.config.model_type = "inkling_text"  # claims Inkling, lacks its modules
    with pytest.raises(ValueError, match=r"pre_mlp_sconv tap.*layers \[0\]"):
        AuxTap(qwen.model, [0])
