"""The hf target in-process: aux layer convention, post-norm last hidden, padding."""

from __future__ import annotations

import pytest
import torch

from specforge_dspark.engines.hf import HFTarget
from specforge_dspark.engines.tap import read_target_dims
from specforge_dspark.transport.features import Sample, pad_batch

LAYER_IDS = [0, 1, 2]


@pytest.fixture(scope="module")
def target(tiny_target_dir) -> HFTarget:
    return HFTarget(str(tiny_target_dir), "float32", "cpu", LAYER_IDS, chunk=2)


@pytest.fixture(scope="module")
def hidden(tiny_target_dir) -> int:
    return read_target_dims(tiny_target_dir, LAYER_IDS).hidden_size


def _samples(lengths: list[int], seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(i, torch.randint(10, 1000, (n,), generator=g), torch.ones(n, dtype=torch.long))
        for i, n in enumerate(lengths)
    ]


def test_aux_layer_k_is_the_sglang_tap_of_decoder_layer_k(target, hidden):
    """Aux layer k = decoder layer k's output less its MLP short convolution's conv term
    (SGLang's Inkling tap, tests/test_inkling_tap.py), not a neighbour layer's."""
    outputs: list[torch.Tensor] = []
    conv_terms: list[torch.Tensor] = []  # mlp_sconv(m) - m
    layers = target.model.model.layers
    hooks = [
        layer.register_forward_hook(lambda mod, inp, out: outputs.append(out)) for layer in layers
    ]
    hooks += [
        layer.mlp_sconv.register_forward_hook(lambda mod, inp, out: conv_terms.append(out - inp[0]))
        for layer in layers
    ]
    try:
        feats = target.forward(pad_batch(_samples([37])), hidden)
    finally:
        for h in hooks:
            h.remove()
    assert len(outputs) == len(conv_terms) == len(layers) == 4
    taps = [out[0] - conv[0] for out, conv in zip(outputs, conv_terms, strict=True)]
    for i, k in enumerate(LAYER_IDS):
        got = feats.aux_hidden[0, :, i * hidden : (i + 1) * hidden]
        torch.testing.assert_close(got, taps[k], atol=1e-5, rtol=0, msg=f"aux slot {i}")
        assert not torch.allclose(got, outputs[k][0], atol=1e-3), "HF's hidden_states[k+1]"
    # and not an off-by-one neighbour
    assert not torch.allclose(feats.aux_hidden[0, :, :hidden], taps[1], atol=1e-3)


def test_last_hidden_is_post_norm_lm_head_input(target, hidden):
    """The model's own logits = lm_head(last_hidden / muP multiplier), logical vocab."""
    batch = pad_batch(_samples([29], seed=1))
    feats = target.forward(batch, hidden)
    model = target.model
    cfg = model.config
    assert cfg.logits_mup_width_multiplier == 4.0 and cfg.unpadded_vocab_size == 1024
    with torch.inference_mode():
        logits = model(batch.input_ids).logits
        head = model.lm_head(feats.last_hidden / cfg.logits_mup_width_multiplier)
    assert model.lm_head.weight.shape[0] == 1088
    assert torch.equal(head[..., : cfg.unpadded_vocab_size], logits)
    # post-norm: undoing the muP division or skipping the final norm breaks it
    with torch.inference_mode():
        unscaled = model.lm_head(feats.last_hidden)[..., :1024]
    assert not torch.allclose(unscaled, logits)
    assert not torch.allclose(
        feats.last_hidden.norm(dim=-1), feats.aux_hidden[..., -hidden:].norm(dim=-1)
    )


def test_right_padding_keeps_valid_rows_and_zeroes_the_rest(target, hidden):
    samples = _samples([11, 23], seed=2)
    padded = target.forward(pad_batch(samples), hidden)
    assert padded.aux_hidden.shape == (2, 23, 3 * hidden)
    assert padded.loss_mask[0, 11:].sum() == 0 and padded.lengths.tolist() == [11, 23]
    alone = target.forward(pad_batch(samples[:1]), hidden)
    torch.testing.assert_close(padded.aux_hidden[0, :11], alone.aux_hidden[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded.last_hidden[0, :11], alone.last_hidden[0], atol=1e-5, rtol=0)
    assert padded.aux_hidden[0, 11:].abs().sum() == 0
    assert padded.last_hidden[0, 11:].abs().sum() == 0


def test_bad_layer_ids_are_refused(tiny_target_dir):
    with pytest.raises(ValueError, match="strictly ascending"):
        read_target_dims(tiny_target_dir, [1, 1])
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\]"):
        read_target_dims(tiny_target_dir, [0, 3])


def test_one_sequence_per_forward_makes_features_independent_of_batching(target, hidden):
    samples = _samples([11, 23], seed=3)
    target.chunk = 1  # target.batch_size 1
    try:
        both = target.forward(pad_batch(samples), hidden)
        alone = target.forward(pad_batch(samples[:1]), hidden)
    finally:
        target.chunk = 2
    assert torch.equal(both.aux_hidden[0, :11], alone.aux_hidden[0])
    assert torch.equal(both.last_hidden[0, :11], alone.last_hidden[0])
