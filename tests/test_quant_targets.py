"""A quantized copy of the tiny target (engines/quant_targets.py,
`python -m specforge_dspark.targets --quant`): the decoder's linear weights are exactly the
format's round trip, the embedding and LM head are untouched, and our hf loaders put
those layers' inputs through the format as served kernels do."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specforge_dspark.engines.quant_formats import fp8_round_trip, nvfp4_round_trip
from specforge_dspark.engines.quant_targets import MARKER, write_quantized_copy

pytestmark = pytest.mark.usefixtures("one_thread")
ROUND_TRIP = {"nvfp4": nvfp4_round_trip, "fp8": fp8_round_trip}


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_a_quantized_copy_rounds_the_linear_weights_and_its_activations(
    fmt, tiny_target_dir, tmp_path
):
    from specforge_dspark.decoding.hf_target import HFTarget

    copy = write_quantized_copy(tiny_target_dir, tmp_path / f"tiny_{fmt}", fmt)
    spec = json.loads((copy / "config.json").read_text())[MARKER]
    before, after = (load_file(d / "model.safetensors") for d in (tiny_target_dir, copy))
    assert spec["format"] == fmt and spec["activations"] and len(spec["weights"]) >= 8
    for name, t in before.items():
        if name in spec["weights"]:
            assert torch.equal(after[name], ROUND_TRIP[fmt](t)), name
            assert not torch.equal(after[name], t), f"{name}: nothing was rounded"
        else:
            assert torch.equal(after[name], t), name
    assert not any("embed" in n or "lm_head" in n for n in spec["weights"])

    target = HFTarget.load(copy, [0, 1, 2])
    modules = dict(target.model.named_modules())
    name = spec["weights"][0].removesuffix(".weight")
    linear = modules.get(name) or modules[name.removeprefix("model.")]
    x = torch.randn(3, linear.in_features)
    rows = torch.cat([ROUND_TRIP[fmt](r[None], per_row=True) for r in x])  # one row at a time
    want = torch.nn.functional.linear(rows, linear.weight, linear.bias)
    assert torch.equal(linear(x), want)  # the input went through the format, row by row
    alone = ROUND_TRIP[fmt](x[1:2], per_row=True)  # a row's quantization ignores its batch
    assert torch.equal(alone[0], ROUND_TRIP[fmt](x, per_row=True)[1])

    plain = HFTarget.load(tiny_target_dir, [0, 1, 2])
    ids = torch.tensor([plain.tokenizer.encode("Natalia sold clips to 48 of her friends")])
    with torch.no_grad():
        a, b = (t.model(input_ids=ids).logits[0] for t in (plain, target))
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert not torch.equal(a, b) and agree > 0.5, agree  # drifted, not destroyed


def test_a_quantized_lm_head_is_the_head_training_reads(tiny_qwen3_dir, tmp_path):
    """`head=True` (`--quant-head`): the LM head is rounded too and served with its input in
    the format; training's frozen head reads the same weights and quantizes its input the
    same way, so the teacher's logits are the served ones."""
    from specforge_dspark.engines.quant_targets import load_causal_lm
    from specforge_dspark.objective.frozen_head import FrozenHead, load_frozen_head

    copy = write_quantized_copy(tiny_qwen3_dir, tmp_path / "q_head", "nvfp4", head=True)
    assert "lm_head.weight" in json.loads((copy / "config.json").read_text())[MARKER]["weights"]
    model = load_causal_lm(copy, torch_dtype=torch.float32)
    ids = torch.tensor([[5, 17, 301, 42, 9, 77, 12, 600]])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    head = load_frozen_head(copy)
    assert head.head_format == "nvfp4"
    served, h = out.logits[0], out.hidden_states[-1][0]  # the final norm's output
    torch.testing.assert_close(head.teacher_logits(h), served, rtol=1e-5, atol=1e-5)
    unquantized_input = FrozenHead(head.embed_weight, head.lm_head_weight, head.logical_vocab)
    assert (unquantized_input.teacher_logits(h) - served).abs().max() > 1e-3  # it matters

    body_only = write_quantized_copy(tiny_qwen3_dir, tmp_path / "q", "nvfp4")
    assert load_frozen_head(body_only).head_format is None  # the default leaves the head
    tied = tmp_path / "tied"
    tied.mkdir()
    (tied / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    (tied / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="tie_word_embeddings: its LM head is the embedding"):
        write_quantized_copy(tied, tmp_path / "tied_q", "nvfp4", head=True)
