"""A quantized copy of the tiny target (engines/quant_targets.py,
`python -m specforge_dspark.tiny --quant`): the decoder's linear weights are exactly the
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
